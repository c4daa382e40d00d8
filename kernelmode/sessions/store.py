"""SQLite session store: sessions outlive a restart of `serve` (as ``lost`` when their kernel is gone)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ..models import Artifact, CheckpointInfo, RunResult, SessionInfo


def storable(text: str) -> str:
    """``text`` as SQLite can hold it: a lone surrogate (``"\\udcff"`` sent in JSON, which
    Python runs as it is) is kept escaped, as ``\\udcff``, instead of failing the write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text

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
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def micros(t: datetime) -> int:
    """``t`` as whole microseconds since the epoch: exact, and ordered as the datetimes are
    (a naive time is taken as UTC)."""
    aware = t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)
    return (aware - _EPOCH) // timedelta(microseconds=1)


class SessionStore:
    """Small synchronous store; each call is one short transaction."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
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

    @staticmethod
    def _listed(info: SessionInfo) -> tuple[str | None, int, str]:
        """The record's values of the listing columns."""
        return info.tenant, micros(info.created_at), str(info.status)

    def close(self) -> None:
        self._db.close()

    def save(self, info: SessionInfo, kernel_id: str, workspace: Path) -> None:
        self._db.execute(
            "INSERT INTO sessions (session_id, kernel_id, workspace, info, tenant, created_us, status) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET kernel_id=excluded.kernel_id, "
            "workspace=excluded.workspace, info=excluded.info, tenant=excluded.tenant, "
            "created_us=excluded.created_us, status=excluded.status",
            (info.session_id, kernel_id, str(workspace), info.model_dump_json(), *self._listed(info)),
        )

    def get(self, session_id: str) -> SessionInfo | None:
        row = self._db.execute("SELECT info FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return SessionInfo.model_validate_json(row[0]) if row else None

    def all(self) -> list[SessionInfo]:
        """Every stored session, in creation order (then id): each record read (tools and tests;
        the start and listings read through the indexes)."""
        rows = self._db.execute("SELECT info FROM sessions ORDER BY created_us, session_id").fetchall()
        return [SessionInfo.model_validate_json(r[0]) for r in rows]

    def page(self, tenant: str | None, after: tuple[datetime, str] | None, limit: int,
             newest_first: bool = False) -> list[SessionInfo]:
        """At most ``limit`` sessions of ``tenant`` (None: of every tenant, the admin's view) in
        creation order then id (or the reverse, ``newest_first``), after the position ``after``
        (a session's creation time and id) in that order. Reads those rows only (the indexes)."""
        where: list[str] = []
        args: list[str | int] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if after is not None:
            where.append(f"(created_us, session_id) {'<' if newest_first else '>'} (?, ?)")
            args += [micros(after[0]), after[1]]
        order = "DESC" if newest_first else "ASC"
        rows = self._db.execute(
            f"SELECT info FROM sessions {'WHERE ' + ' AND '.join(where) if where else ''} "
            f"ORDER BY created_us {order}, session_id {order} LIMIT ?", (*args, limit)).fetchall()
        return [SessionInfo.model_validate_json(r[0]) for r in rows]

    def status_counts(self) -> dict[str, int]:
        """How many stored sessions have each status (no record is read)."""
        return dict(self._db.execute("SELECT status, COUNT(*) FROM sessions GROUP BY status").fetchall())

    def delete(self, session_id: str) -> None:
        """Forget the session; its runs stay (their artifacts outlive the session)."""
        self._db.execute("DELETE FROM sessions WHERE session_id=?", (session_id,))

    def take_id(self, session_id: str, tenant: str) -> None:
        """A new session takes over an id: the old session's runs and files are no longer its."""
        self._db.execute("DELETE FROM runs WHERE session_id=?", (session_id,))
        self._db.execute("DELETE FROM session_files WHERE session_id=?", (session_id,))
        self._db.execute("INSERT OR REPLACE INTO owners (session_id, tenant) VALUES (?, ?)",
                         (session_id, tenant))

    def owner(self, session_id: str) -> str | None:
        """The tenant of the id's records, or None (unknown id, or made before tenants existed)."""
        row = self._db.execute("SELECT tenant FROM owners WHERE session_id=?", (session_id,)).fetchone()
        return row[0] if row else None

    def add_session_file(self, session_id: str, artifact: Artifact) -> None:
        """A file of the session itself (its notebook), kept like the runs' artifacts."""
        self._db.execute("INSERT OR REPLACE INTO session_files (session_id, name, artifact) VALUES (?, ?, ?)",
                         (session_id, artifact.path, artifact.model_dump_json()))

    def session_files(self, session_id: str) -> list[Artifact]:
        rows = self._db.execute("SELECT artifact FROM session_files WHERE session_id=? ORDER BY rowid",
                                (session_id,)).fetchall()
        return [Artifact.model_validate_json(r[0]) for r in rows]

    def workspace(self, session_id: str) -> Path | None:
        row = self._db.execute("SELECT workspace FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return Path(row[0]) if row and row[0] else None

    def workspaces(self) -> set[Path]:
        return {Path(r[0]) for r in self._db.execute("SELECT workspace FROM sessions") if r[0]}

    def mark_lost(self, info: SessionInfo) -> None:
        """The session's kernel is gone (with the `serve` that ran it); its files stay."""
        self._db.execute(
            "UPDATE sessions SET info=?, status='lost' WHERE session_id=?",
            (info.model_copy(update={"status": "lost", "expires_at": None}).model_dump_json(),
             info.session_id),
        )

    def mark_all_lost(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Sessions of a previous `serve` whose kernels are gone (all but those in ``keep``,
        whose kernels were adopted): their ids, in order. One statement over the status index;
        the records are changed as ``mark_lost`` changes them."""
        # A hibernated session has no kernel to lose: it wakes as ever. Two ranges around 'lost'
        # and 'hibernated' (not NOT IN): the index finds the few live ones among many lost.
        rows = self._db.execute(
            "UPDATE sessions SET status = 'lost', info = json_set(info, '$.status', 'lost', '$.expires_at', "
            "json('null')) WHERE (status < 'hibernated' OR (status > 'hibernated' AND status < 'lost') "
            "OR status > 'lost') AND session_id NOT IN (SELECT value FROM json_each(?)) RETURNING session_id",
            (json.dumps(sorted(keep)),)).fetchall()
        return sorted(r[0] for r in rows)

    def with_kernels(self, kernel_ids: set[str] | frozenset[str]) -> list[SessionInfo]:
        """The sessions not lost whose kernel is among ``kernel_ids``, in creation order: only
        their records are read."""
        if not kernel_ids:
            return []
        rows = self._db.execute(
            "SELECT info FROM sessions WHERE kernel_id IN (SELECT value FROM json_each(?)) "
            "AND status IS NOT 'lost' ORDER BY created_us, session_id", (json.dumps(sorted(kernel_ids)),)).fetchall()
        return [i for i in (SessionInfo.model_validate_json(r[0]) for r in rows) if i.kernel_id in kernel_ids]

    def kernel_ids(self) -> set[str]:
        """The kernels stored sessions have had (no record is read)."""
        return {r[0] for r in self._db.execute("SELECT kernel_id FROM sessions WHERE kernel_id IS NOT NULL")}

    def hibernated(self, tenant: str | None = None) -> list[SessionInfo]:
        """The hibernated sessions (of ``tenant``, or of every tenant), in creation order."""
        rows = self._db.execute(
            "SELECT info FROM sessions WHERE status = 'hibernated' AND (? IS NULL OR tenant = ?) "
            "ORDER BY created_us, session_id", (tenant, tenant)).fetchall()
        return [SessionInfo.model_validate_json(r[0]) for r in rows]

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

    def hibernated_workspaces(self) -> set[Path]:
        """The workspaces of hibernated sessions (no record is read)."""
        return {Path(r[0]) for r in self._db.execute(
            "SELECT workspace FROM sessions WHERE status = 'hibernated' AND workspace IS NOT NULL") if r[0]}

    def add_run(self, code: str, result: RunResult, events: list[dict[str, Any]] | None = None) -> None:
        """``events``: the run's output in arrival order (what a notebook export shows)."""
        # A run is written when it starts (status running) and again when it ends, in its place.
        self._db.execute(
            "INSERT INTO runs (run_id, session_id, seq, code, result, events, running) VALUES "
            "(?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM runs WHERE session_id=?), ?, ?, ?, ?) "
            "ON CONFLICT(run_id) DO UPDATE SET result=excluded.result, events=excluded.events, "
            "running=excluded.running",
            (result.run_id, result.session_id, result.session_id, storable(code), result.model_dump_json(),
             json.dumps(events, default=str) if events is not None else None, result.status == "running"),
        )

    def runs_in_flight(self) -> list[RunResult]:
        """Runs recorded as started and never as ended (their server died under them): for the
        start. Only the runs not known to have ended are read (an index): those an older
        kernelmode wrote, once, to learn whether they ended, then the running ones."""
        self._db.execute("UPDATE runs SET running = json_extract(result, '$.status') = 'running' "
                         "WHERE running IS NOT 0 AND running IS NOT (json_extract(result, '$.status') = 'running')")
        rows = self._db.execute("SELECT result FROM runs WHERE running IS NOT 0").fetchall()
        return [RunResult.model_validate_json(r[0]) for r in rows]

    def forget_run_if_running(self, run_id: str) -> None:
        self._db.execute("DELETE FROM runs WHERE run_id=? AND json_extract(result, '$.status') = 'running'",
                         (run_id,))

    def end_run(self, result: RunResult) -> None:
        self._db.execute("UPDATE runs SET result=?, running=? WHERE run_id=?",
                         (result.model_dump_json(), result.status == "running", result.run_id))

    def get_run(self, run_id: str) -> RunResult | None:
        row = self._db.execute("SELECT result FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return RunResult.model_validate_json(row[0]) if row else None

    def history(self, session_id: str) -> list[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        """(code, result, output events or None) of each run, in order."""
        rows = self._db.execute(
            "SELECT code, result, events FROM runs WHERE session_id=? ORDER BY seq", (session_id,)
        ).fetchall()
        return [(code, RunResult.model_validate_json(res), json.loads(ev) if ev else None)
                for code, res, ev in rows]

    def has_runs(self, session_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM runs WHERE session_id=? LIMIT 1", (session_id,)).fetchone() is not None

    def runs(self, session_id: str) -> list[tuple[str, RunResult]]:
        rows = self._db.execute(
            "SELECT code, result FROM runs WHERE session_id=? ORDER BY seq", (session_id,)
        ).fetchall()
        return [(code, RunResult.model_validate(json.loads(res))) for code, res in rows]

    def run_count(self, session_id: str) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs WHERE session_id=?", (session_id,)).fetchone()[0])

    def history_iter(self, session_id: str) -> Iterator[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        """``history``, one run at a time (a notebook export holds one run's output, not all).

        Each run is its own short query, so no statement stays open while others write. A run
        with its events does not need the result's copy of the same output: SQLite drops it."""
        seqs = [r[0] for r in self._db.execute(
            "SELECT seq FROM runs WHERE session_id=? ORDER BY seq", (session_id,))]
        for seq in seqs:
            row = self._db.execute(
                "SELECT code, CASE WHEN events IS NULL THEN result ELSE "
                "json_remove(result, '$.outputs', '$.stdout', '$.stderr') END, events "
                "FROM runs WHERE session_id=? AND seq=?", (session_id, seq)).fetchone()
            if row is not None:  # the id was taken over meanwhile
                yield row[0], RunResult.model_validate_json(row[1]), json.loads(row[2]) if row[2] else None

    def run_events(self, run_id: str) -> list[dict[str, Any]]:
        """A run's output events in arrival order (empty for runs stored without them)."""
        row = self._db.execute("SELECT events FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return json.loads(row[0]) if row and row[0] else []

    # -- checkpoints ---------------------------------------------------------------------------------
    def add_checkpoint(self, info: CheckpointInfo, tenant: str) -> None:
        self._db.execute(
            "INSERT INTO checkpoints (checkpoint_id, session_id, tenant, created, info) VALUES (?, ?, ?, ?, ?)",
            (info.checkpoint_id, info.session_id, tenant, info.created_at.timestamp(), info.model_dump_json()))

    def checkpoint(self, checkpoint_id: str) -> tuple[CheckpointInfo, str] | None:
        """(checkpoint, its tenant), or None."""
        row = self._db.execute("SELECT info, tenant FROM checkpoints WHERE checkpoint_id=?",
                               (checkpoint_id,)).fetchone()
        return (CheckpointInfo.model_validate_json(row[0]), row[1]) if row else None

    def checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first."""
        rows = self._db.execute("SELECT info FROM checkpoints WHERE session_id=? ORDER BY created DESC",
                                (session_id,)).fetchall()
        return [CheckpointInfo.model_validate_json(r[0]) for r in rows]

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._db.execute("DELETE FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,))
