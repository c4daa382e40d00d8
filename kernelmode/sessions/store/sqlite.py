"""The SQLite store (the default: a file in the data dir): sessions outlive a restart of `serve`
(as ``lost`` when their kernel is gone). Its migrations are the checks of ``_migrate``, made at
each open under one write lock."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from ...models import Artifact, RunResult, SessionInfo
from .base import Args, SessionStore, micros
from .leases import SqliteLeases
from .managers import SqliteManagers

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    kernel_id TEXT,
    workspace TEXT,
    info TEXT NOT NULL,
    -- Copies of the record's fields that listings select and order by (kept in step by save
    -- and mark_lost), so a page reads its own rows only: see _INDEXES.
    tenant TEXT,
    created_us INTEGER,
    status TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    code TEXT NOT NULL,
    result TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_session ON runs (session_id, seq);
-- Who owns a session id's records (runs, artifacts, notebook): kept after the session is closed.
CREATE TABLE IF NOT EXISTS owners (
    session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS session_files (
    session_id TEXT NOT NULL,
    name TEXT NOT NULL,
    artifact TEXT NOT NULL,
    PRIMARY KEY (session_id, name)
);
-- Checkpoints: their blobs are in the artifact store (checkpoints.py), their metadata here.
CREATE TABLE IF NOT EXISTS checkpoints (
    checkpoint_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    created REAL NOT NULL,
    info TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_session ON checkpoints (session_id, created);
-- Which manager owns a session until when (leases.py): seconds since the epoch.
CREATE TABLE IF NOT EXISTS leases (
    session_id TEXT PRIMARY KEY,
    manager_id TEXT NOT NULL,
    expires_at REAL NOT NULL
);
-- The managers sharing the store and their pool kernels (managers.py): one, on SQLite.
CREATE TABLE IF NOT EXISTS managers (
    manager_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    home TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pool_kernels (
    kernel_id TEXT PRIMARY KEY,
    manager_id TEXT NOT NULL
);
-- Which manager holds each MCP connection (api/forwarding.py routes its requests there).
CREATE TABLE IF NOT EXISTS mcp_sessions (
    mcp_session_id TEXT PRIMARY KEY,
    manager_id TEXT NOT NULL
);
"""


# Created after _migrate: a store made before these columns existed gets them first.
_INDEXES = """
CREATE INDEX IF NOT EXISTS sessions_by_created ON sessions (created_us, session_id);
CREATE INDEX IF NOT EXISTS sessions_by_tenant ON sessions (tenant, created_us, session_id);
CREATE INDEX IF NOT EXISTS sessions_by_status ON sessions (status, tenant);
-- Runs not known to have ended (running, or written by a kernelmode without the column): the
-- start finds the interrupted ones among these few.
CREATE INDEX IF NOT EXISTS runs_not_ended ON runs (run_id) WHERE running IS NOT 0;
-- The hibernation expiry pass reads the hibernated sessions due, not every hibernated record.
CREATE INDEX IF NOT EXISTS sessions_hibernated_by_expiry ON sessions (expires_ms) WHERE status = 'hibernated';
"""

# Any writer of a record keeps its status and tenant columns in step, an older kernelmode too (it
# writes the record alone: INSERT, or an UPDATE of info): the triggers are in the database, so
# an open need not scan for rows it changed. A row it inserted has no created_us (exact to the
# microsecond only in Python): an open fills those few through the index.
_LISTED = "json_extract(NEW.info, '$.status'), json_extract(NEW.info, '$.tenant')"
_TRIGGERS = tuple(f"""
CREATE TRIGGER IF NOT EXISTS sessions_listed_after_{event.split()[0].lower()} AFTER {event} ON sessions
WHEN NEW.status IS NOT json_extract(NEW.info, '$.status') OR NEW.tenant IS NOT json_extract(NEW.info, '$.tenant')
BEGIN UPDATE sessions SET (status, tenant) = ({_LISTED}) WHERE rowid = NEW.rowid; END;
""" for event in ("INSERT", "UPDATE OF info"))
# When a record expires, in milliseconds since the epoch (SQLite's time resolution; the exact
# time is checked on the record): computed from the record, so no writer can leave it behind.
_EXPIRES = "json_extract(info, '$.expires_at')"
_EXPIRES_MS = (f"CAST(strftime('%s', {_EXPIRES}) AS INTEGER) * 1000 "
               f"+ CAST(substr(strftime('%f', {_EXPIRES}), 4) AS INTEGER)")


class SqliteStore(SessionStore):
    """The store in one SQLite file (WAL): one connection, shared by the threads that read it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.leases = SqliteLeases(self._rows)
        self.managers = SqliteManagers(self._rows)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(runs)")}
        if "events" not in columns:  # a store made before outputs were kept in order
            self._db.execute("ALTER TABLE runs ADD COLUMN events TEXT")
        if "running" not in columns:  # NULL: not known yet (runs_in_flight reads the record once)
            self._db.execute("ALTER TABLE runs ADD COLUMN running INTEGER")
        self._migrate()
        self._db.executescript(_INDEXES)

    def _migrate(self) -> None:
        """Give a store made before listings were indexed its listing columns, filled from each
        record (once: later opens find no row without them), and the triggers that keep them in
        step with the record whoever writes it; a store opened before the triggers existed is
        brought in step once, when they are made."""
        self._db.execute("BEGIN IMMEDIATE")  # all or nothing, and one opener at a time
        try:
            columns = {r[1] for r in self._db.execute("PRAGMA table_xinfo(sessions)")}
            for name, kind in (("tenant", "TEXT"), ("created_us", "INTEGER"), ("status", "TEXT"),
                               ("expires_ms", f"INTEGER GENERATED ALWAYS AS ({_EXPIRES_MS}) VIRTUAL")):
                if name not in columns:
                    self._db.execute(f"ALTER TABLE sessions ADD COLUMN {name} {kind}")
            rows = self._db.execute("SELECT info FROM sessions WHERE created_us IS NULL").fetchall()
            for (raw,) in rows:
                info = SessionInfo.model_validate_json(raw)
                self._db.execute("UPDATE sessions SET tenant=?, created_us=?, status=? WHERE session_id=?",
                                 (*self._listed(info), info.session_id))
            if self._db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'trigger' AND name "
                                "LIKE 'sessions_listed_after_%'").fetchone()[0] < 2:
                # Made by a kernelmode without them: an older one may have changed records since.
                self._db.execute("UPDATE sessions SET status=json_extract(info, '$.status'), "
                                 "tenant=json_extract(info, '$.tenant') WHERE status IS NOT json_extract(info, "
                                 "'$.status') OR tenant IS NOT json_extract(info, '$.tenant')")
                for trigger in _TRIGGERS:
                    self._db.execute(trigger)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _rows(self, sql: str, args: Args = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, args).fetchall()

    def _row(self, sql: str, args: Args = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._db.execute(sql, args).fetchone()
        return row

    def _run(self, sql: str, args: Args = ()) -> None:
        self._db.execute(sql, args)

    def close(self) -> None:
        self._db.close()

    def describe(self) -> str:
        return f"SQLite {self._path}"

    def save(self, info: SessionInfo, kernel_id: str, workspace: Path) -> None:
        self._db.execute(
            "INSERT INTO sessions (session_id, kernel_id, workspace, info, tenant, created_us, status) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET kernel_id=excluded.kernel_id, "
            "workspace=excluded.workspace, info=excluded.info, tenant=excluded.tenant, "
            "created_us=excluded.created_us, status=excluded.status",
            (info.session_id, kernel_id, str(workspace), info.model_dump_json(), *self._listed(info)),
        )

    def add_session_file(self, session_id: str, artifact: Artifact) -> None:
        # REPLACE deletes and inserts: a new rowid, the end of the order.
        self._db.execute("INSERT OR REPLACE INTO session_files (session_id, name, artifact) VALUES (?, ?, ?)",
                         (session_id, artifact.path, artifact.model_dump_json()))

    def session_files(self, session_id: str) -> list[Artifact]:
        rows = self._db.execute("SELECT artifact FROM session_files WHERE session_id=? ORDER BY rowid",
                                (session_id,)).fetchall()
        return [Artifact.model_validate_json(r[0]) for r in rows]

    def mark_lost(self, info: SessionInfo) -> None:
        self._db.execute(
            "UPDATE sessions SET info=?, status='lost' WHERE session_id=?",
            (info.model_copy(update={"status": "lost", "expires_at": None}).model_dump_json(),
             info.session_id),
        )

    def mark_all_lost(self, keep: set[str] | frozenset[str] = frozenset(), manager_id: str | None = None) -> list[str]:
        """One statement over the status index."""
        leased = ("AND session_id NOT IN (SELECT session_id FROM leases WHERE manager_id <> ? "
                  "AND expires_at > ?) ") if manager_id is not None else ""
        # A hibernated session has no kernel to lose: it wakes as ever. Two ranges around 'lost'
        # and 'hibernated' (not NOT IN): the index finds the few live ones among many lost.
        rows = self._db.execute(
            "UPDATE sessions SET status = 'lost', info = json_set(info, '$.status', 'lost', '$.expires_at', "
            "json('null')) WHERE (status < 'hibernated' OR (status > 'hibernated' AND status < 'lost') "
            f"OR status > 'lost') AND session_id NOT IN (SELECT value FROM json_each(?)) {leased}RETURNING session_id",
            (json.dumps(sorted(keep)), *((manager_id, time.time()) if manager_id is not None else ()))).fetchall()
        return sorted(r[0] for r in rows)

    def with_kernels(self, kernel_ids: set[str] | frozenset[str]) -> list[SessionInfo]:
        if not kernel_ids:
            return []
        rows = self._db.execute(
            "SELECT info FROM sessions WHERE kernel_id IN (SELECT value FROM json_each(?)) "
            "AND status IS NOT 'lost' ORDER BY created_us, session_id", (json.dumps(sorted(kernel_ids)),)).fetchall()
        return [i for i in (SessionInfo.model_validate_json(r[0]) for r in rows) if i.kernel_id in kernel_ids]

    def hibernated_expired(self, at: datetime) -> list[SessionInfo]:
        """The hibernated sessions whose ``expires_at`` is ``at`` or before: the index finds them
        (to the millisecond, one more for rounding), their records decide."""
        rows = self._db.execute(
            # Named: without statistics SQLite would take the status index, every hibernated row.
            "SELECT info FROM sessions INDEXED BY sessions_hibernated_by_expiry "
            "WHERE status = 'hibernated' AND expires_ms <= ? "
            "ORDER BY created_us, session_id", (micros(at) // 1000 + 1,)).fetchall()
        return [i for i in (SessionInfo.model_validate_json(r[0]) for r in rows)
                if i.expires_at is not None and i.expires_at <= at]

    def runs_in_flight(self) -> list[RunResult]:
        """Only the runs not known to have ended are read (an index): those an older kernelmode
        wrote, once, to learn whether they ended, then the running ones."""
        self._db.execute("UPDATE runs SET running = json_extract(result, '$.status') = 'running' "
                         "WHERE running IS NOT 0 AND running IS NOT (json_extract(result, '$.status') = 'running')")
        rows = self._db.execute("SELECT result FROM runs WHERE running IS NOT 0").fetchall()
        return [RunResult.model_validate_json(r[0]) for r in rows]

    def forget_run_if_running(self, run_id: str) -> None:
        self._db.execute("DELETE FROM runs WHERE run_id=? AND json_extract(result, '$.status') = 'running'",
                         (run_id,))

    def history_iter(self, session_id: str) -> Iterator[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        """A run with its events does not need the result's copy of the same output: SQLite
        drops it."""
        seqs = [r[0] for r in self._db.execute(
            "SELECT seq FROM runs WHERE session_id=? ORDER BY seq", (session_id,))]
        for seq in seqs:
            row = self._db.execute(
                "SELECT code, CASE WHEN events IS NULL THEN result ELSE "
                "json_remove(result, '$.outputs', '$.stdout', '$.stderr') END, events "
                "FROM runs WHERE session_id=? AND seq=?", (session_id, seq)).fetchone()
            if row is not None:  # the id was taken over meanwhile
                yield row[0], RunResult.model_validate_json(row[1]), json.loads(row[2]) if row[2] else None

