"""The PostgreSQL store (``store.url: postgresql://...``): what several managers share.

One psycopg 3 connection in autocommit, so each call is one short transaction as on SQLite;
psycopg serializes the threads that share it. Fencing: with ``fence`` set (ownership.py), a
session's record and runs are written only while the writer holds the session's lease, checked in
the writing statement itself (``_fenced``), so a manager that wakes from a freeze past its lease
never overwrites what the session's new owner wrote. The schema is migrations.py's. Text columns hold
the records' JSON as the SQLite store does (``info::jsonb`` would refuse the ``\\u0000`` a run's
output may hold), so the few queries that change a record do it in Python.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ...errors import ConfigError, SessionStoreUnavailable
from ...models import Artifact, RunResult, SessionInfo
from .base import Args, SessionStore, micros
from .egress_tokens import EgressTokens
from .leases import PostgresLeases
from .managers import PostgresManagers
from .migrations import migrate

# A statement that runs longer fails instead of holding the manager's event loop (all of them are
# single-row or index reads; the migration lock is taken by a statement of its own).
STATEMENT_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_SECONDS = 10


def describe(url: str) -> str:
    """``url`` without its password, for logs and errors: user@host:port/dbname."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "an unparsable URL"
    host = parts.get("host") or "localhost"
    user = f"{parts['user']}@" if parts.get("user") else ""
    return f"{user}{host}:{parts.get('port') or 5432}/{parts.get('dbname') or ''}"


def probe(url: str) -> str:
    """What a manager would find at ``url``, changing nothing (`kernelmode doctor`): the schema's
    version, or that the first `serve` will create it. ConfigError when it cannot connect or the
    schema is newer than this kernelmode's."""
    from .migrations import MIGRATIONS

    with PostgresStore._open(url) as conn:
        exists = conn.execute("SELECT to_regclass('kernelmode_schema') IS NOT NULL").fetchone()
        if not (exists and exists[0]):
            return f"PostgreSQL {describe(url)}: no kernelmode tables yet (the first serve creates them)"
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM kernelmode_schema").fetchone()
    version = int(row[0]) if row else 0
    if version > len(MIGRATIONS):
        raise ConfigError(f"store.url: the database's schema is version {version}, newer than this "
                          f"kernelmode's ({len(MIGRATIONS)}): upgrade kernelmode, or use another database")
    state = "current" if version == len(MIGRATIONS) else f"serve migrates it to {len(MIGRATIONS)}"
    return f"PostgreSQL {describe(url)}: schema version {version} ({state})"


@functools.lru_cache(maxsize=512)
def _pg(sql: str) -> str:
    """The shared SQL's ``?`` placeholders as psycopg's ``%s`` (and a literal ``%`` escaped)."""
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresStore(SessionStore):
    """The store in a PostgreSQL database, migrated on open (safe when managers open it together)."""

    shared = True

    def __init__(self, url: str, migrated: bool = False) -> None:
        """``migrated``: the schema is current already (a second connection of one manager)."""
        self._url = url
        self._lock = threading.Lock()  # one reconnect at a time
        self._conn = self._connect()
        try:
            if not migrated:
                migrate(self._conn)
        except BaseException:
            self._conn.close()
            raise
        self.leases = PostgresLeases(self._rows)
        self.egress_tokens = EgressTokens(self._rows, self._run)
        self.managers = PostgresManagers(self._rows)

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        return self._open(self._url)

    @staticmethod
    def _open(url: str) -> psycopg.Connection[tuple[Any, ...]]:
        try:
            return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS,
                                   options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}")
        except psycopg.OperationalError as e:  # translated once, here: say where and what
            raise ConfigError(f"store.url: cannot connect to PostgreSQL at {describe(url)}: "
                              f"{str(e).strip()}") from e

    def _live(self) -> psycopg.Connection[tuple[Any, ...]]:
        """The connection, made again if the last one broke (the server restarted, a network
        cut): the statement that saw it break failed, the next one runs on a new connection."""
        conn = self._conn
        if conn.broken or conn.closed:
            with self._lock:
                if self._conn.broken or self._conn.closed:
                    self._conn = self._connect()
                conn = self._conn
        return conn

    def _cursor(self, sql: str, args: Args) -> psycopg.Cursor[tuple[Any, ...]]:
        try:
            return self._live().execute(_pg(sql), args)
        except (psycopg.OperationalError, ConfigError) as e:  # down, cut, or over statement_timeout
            raise SessionStoreUnavailable(
                f"the session store (PostgreSQL at {describe(self._url)}) did not answer: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; retry in a moment") from e

    def _rows(self, sql: str, args: Args = ()) -> list[tuple[Any, ...]]:
        return self._cursor(sql, args).fetchall()

    def _row(self, sql: str, args: Args = ()) -> tuple[Any, ...] | None:
        return self._cursor(sql, args).fetchone()

    def _run(self, sql: str, args: Args = ()) -> None:
        self._cursor(sql, args)

    def close(self) -> None:
        self._conn.close()

    def background(self) -> PostgresStore:
        return PostgresStore(self._url, migrated=True)

    def describe(self) -> str:
        return f"PostgreSQL {describe(self._url)}"

    def _text(self, text: str) -> str:
        # PostgreSQL's text holds no NUL character: kept escaped, as a lone surrogate is.
        return super()._text(text).replace("\x00", "\\x00")

    def _fenced(self, session_sql: str = "?") -> str:
        if self.fence is None:
            return "TRUE"
        # FOR SHARE: a take of the lease by another manager waits until this write commits, and
        # a take committed meanwhile is seen (the condition is checked again on the new row).
        return (f"EXISTS (SELECT 1 FROM leases WHERE leases.session_id = {session_sql} "
                "AND leases.manager_id = ? AND leases.expires_at > now() FOR SHARE)")

    def _fence_args(self, *session_id: str) -> tuple[str, ...]:
        return () if self.fence is None else (*session_id, self.fence.manager_id)

    def save(self, info: SessionInfo, kernel_id: str, workspace: Path) -> None:
        expires = micros(info.expires_at) if info.expires_at is not None else None
        if not self._rows(
            "INSERT INTO sessions (session_id, kernel_id, workspace, info, tenant, created_us, status, expires_us) "
            f"SELECT ?, ?, ?, ?, ?, ?, ?, ? WHERE {self._fenced()} "
            "ON CONFLICT(session_id) DO UPDATE SET kernel_id=excluded.kernel_id, "
            "workspace=excluded.workspace, info=excluded.info, tenant=excluded.tenant, "
            "created_us=excluded.created_us, status=excluded.status, expires_us=excluded.expires_us "
            "RETURNING session_id",
            (info.session_id, kernel_id, str(workspace), info.model_dump_json(), *self._listed(info), expires,
             *self._fence_args(info.session_id))):
            self._refused(info.session_id)

    def mark_lost(self, info: SessionInfo) -> None:
        self._run("UPDATE sessions SET info=?, status='lost', expires_us=NULL WHERE session_id=?",
                  (info.model_copy(update={"status": "lost", "expires_at": None}).model_dump_json(),
                   info.session_id))

    def mark_all_lost(self, keep: set[str] | frozenset[str] = frozenset(), manager_id: str | None = None) -> list[str]:
        """The records are read, changed and written back each only if its status is still the
        one read (a save meanwhile wins) and no other manager leases it by then."""
        leased = ("AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.session_id = sessions.session_id "
                  "AND l.manager_id <> ? AND l.expires_at > now()) ") if manager_id is not None else ""
        mine = (manager_id,) if manager_id is not None else ()
        rows = self._rows("SELECT info, status FROM sessions WHERE status NOT IN ('hibernated', 'lost') "
                          f"AND NOT (session_id = ANY(?)) {leased}", (sorted(keep), *mine))
        lost = []
        for raw, status in rows:
            info = SessionInfo.model_validate_json(raw)
            changed = info.model_copy(update={"status": "lost", "expires_at": None}).model_dump_json()
            if self._rows("UPDATE sessions SET info=?, status='lost', expires_us=NULL "
                          f"WHERE session_id=? AND status=? {leased}RETURNING session_id",
                          (changed, info.session_id, status, *mine)):
                lost.append(info.session_id)
        return sorted(lost)

    def with_kernels(self, kernel_ids: set[str] | frozenset[str]) -> list[SessionInfo]:
        if not kernel_ids:
            return []
        rows = self._rows("SELECT info FROM sessions WHERE kernel_id = ANY(?) AND status <> 'lost' "
                          "ORDER BY created_us, session_id", (sorted(kernel_ids),))
        return [i for i in (SessionInfo.model_validate_json(r[0]) for r in rows) if i.kernel_id in kernel_ids]

    def hibernated_expired(self, at: datetime) -> list[SessionInfo]:
        rows = self._rows("SELECT info FROM sessions WHERE status = 'hibernated' AND expires_us <= ? "
                          "ORDER BY created_us, session_id", (micros(at),))
        return [i for i in (SessionInfo.model_validate_json(r[0]) for r in rows)
                if i.expires_at is not None and i.expires_at <= at]

    def add_session_file(self, session_id: str, artifact: Artifact) -> None:
        # excluded.added is the new row's serial: a rewrite moves to the end, as on SQLite.
        self._run("INSERT INTO session_files (session_id, name, artifact) VALUES (?, ?, ?) "
                  "ON CONFLICT (session_id, name) DO UPDATE SET artifact=excluded.artifact, added=excluded.added",
                  (session_id, artifact.path, artifact.model_dump_json()))

    def session_files(self, session_id: str) -> list[Artifact]:
        rows = self._rows("SELECT artifact FROM session_files WHERE session_id=? ORDER BY added", (session_id,))
        return [Artifact.model_validate_json(r[0]) for r in rows]

    def runs_in_flight(self) -> list[RunResult]:
        return [RunResult.model_validate_json(r[0]) for r in self._rows("SELECT result FROM runs WHERE running")]

    def forget_run_if_running(self, run_id: str) -> None:
        # Fenced too, quietly: a run another manager took over is its to end (interrupted).
        self._run(f"DELETE FROM runs WHERE run_id=? AND running AND {self._fenced('runs.session_id')}",
                  (run_id, *self._fence_args()))

    def history_iter(self, session_id: str) -> Iterator[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        seqs = [r[0] for r in self._rows("SELECT seq FROM runs WHERE session_id=? ORDER BY seq", (session_id,))]
        for seq in seqs:
            row = self._row("SELECT code, result, events FROM runs WHERE session_id=? AND seq=?", (session_id, seq))
            if row is not None:  # the id was taken over meanwhile
                yield row[0], RunResult.model_validate_json(row[1]), json.loads(row[2]) if row[2] else None
