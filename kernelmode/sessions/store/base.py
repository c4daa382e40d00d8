"""The session store's interface, and the queries both backends run as written.

A backend (sqlite.py, postgres.py) gives three primitives (``_rows``, ``_row``, ``_run``: one
statement each, with ``?`` placeholders) and the methods whose SQL differs between the two
(JSON functions, upserts that replace, index hints). Each call is one short statement, made from
the event loop as the SQLite store always was (see docs/scaling.md on what that costs on
PostgreSQL), but for the heartbeat's and the takeover scan's, made in a thread on a connection
of their own (``background``).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ...errors import SessionOwnedElsewhere
from ...models import Artifact, CheckpointInfo, RunResult, SessionInfo
from .egress_tokens import EgressTokens
from .leases import Fence, Leases
from .managers import Managers

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
Args = Sequence[Any]


def storable(text: str) -> str:
    """``text`` as a database can hold it: a lone surrogate (``"\\udcff"`` sent in JSON, which
    Python runs as it is) is kept escaped, as ``\\udcff``, instead of failing the write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def micros(t: datetime) -> int:
    """``t`` as whole microseconds since the epoch: exact, and ordered as the datetimes are
    (a naive time is taken as UTC)."""
    aware = t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)
    return (aware - _EPOCH) // timedelta(microseconds=1)


class SessionStore(ABC):
    """Sessions, runs, session files, checkpoints' metadata and leases; each call is one short
    transaction. ``leases``: which manager owns which session (leases.py); ``managers``: the
    managers sharing the store and their pool kernels (managers.py)."""

    leases: Leases
    egress_tokens: EgressTokens  # remote kernels' egress credentials (egress_tokens.py)
    managers: Managers
    shared = False  # several managers may use it at once (PostgreSQL): ownership.py takes leases
    # The manager whose lease a session's record and runs are written under (ownership.py sets
    # it on a shared store): a write of a session it no longer holds is refused (``_fenced``).
    fence: Fence | None = None

    # -- the backend's primitives ------------------------------------------------------------------
    @abstractmethod
    def _rows(self, sql: str, args: Args = ()) -> list[tuple[Any, ...]]:
        """Every row the statement returns."""

    @abstractmethod
    def _row(self, sql: str, args: Args = ()) -> tuple[Any, ...] | None:
        """The statement's first row, or None."""

    @abstractmethod
    def _run(self, sql: str, args: Args = ()) -> None:
        """A statement that returns no rows."""

    @abstractmethod
    def close(self) -> None: ...

    def background(self) -> SessionStore:
        """The store on a connection of its own, for statements run in a thread off the event
        loop (the heartbeat, the takeover scan: ownership.py); close it after. One manager's
        SQLite store has no heartbeat: itself."""
        return self

    @abstractmethod
    def describe(self) -> str:
        """Which backend and where, for the log (no password)."""

    def _text(self, text: str) -> str:
        """User text (a run's code) as the backend can hold it."""
        return storable(text)

    def _fenced(self, session_sql: str = "?") -> str:
        """The condition of a write of a session's record or runs, in the writing statement
        itself: always true here (one manager); the shared store's holds while the writer holds
        the lease of the session that ``session_sql`` names (postgres.py)."""
        return "1 = 1"

    def _fence_args(self, *session_id: str) -> tuple[str, ...]:
        """The arguments of ``_fenced``'s condition (none here)."""
        return ()

    def _refused(self, session_id: str) -> None:
        """A fenced write found the lease gone: the manager stops acting for the session (the
        fence's ``lost``) and the request is answered 503 ``session_owned_elsewhere``."""
        if self.fence is not None:
            self.fence.lost(session_id)
        raise SessionOwnedElsewhere(
            f"session {session_id!r} is no longer this manager's (it was frozen or cut off from the store "
            "longer than store.lease_seconds, and another manager took the session over): nothing was "
            "written here; send the request again")

    @staticmethod
    def _listed(info: SessionInfo) -> tuple[str | None, int, str]:
        """The record's values of the listing columns."""
        return info.tenant, micros(info.created_at), str(info.status)

    # -- sessions: SQL that differs ----------------------------------------------------------------
    @abstractmethod
    def save(self, info: SessionInfo, kernel_id: str, workspace: Path) -> None: ...

    @abstractmethod
    def mark_lost(self, info: SessionInfo) -> None:
        """The session's kernel is gone (with the `serve` that ran it); its files stay."""

    @abstractmethod
    def mark_all_lost(self, keep: set[str] | frozenset[str] = frozenset(), manager_id: str | None = None) -> list[str]:
        """Sessions of a previous `serve` whose kernels are gone (all but those in ``keep``,
        whose kernels were adopted, and the hibernated ones): their ids, in order; the records
        are changed as ``mark_lost`` changes them. ``manager_id``: the sessions another manager
        holds an unexpired lease on are its own, and kept too (checked in the same statement)."""

    @abstractmethod
    def with_kernels(self, kernel_ids: set[str] | frozenset[str]) -> list[SessionInfo]:
        """The sessions not lost whose kernel is among ``kernel_ids``, in creation order: only
        their records are read."""

    @abstractmethod
    def hibernated_expired(self, at: datetime) -> list[SessionInfo]:
        """The hibernated sessions whose ``expires_at`` is ``at`` or before, in creation order."""

    @abstractmethod
    def add_session_file(self, session_id: str, artifact: Artifact) -> None:
        """A file of the session itself (its notebook), kept like the runs' artifacts; written
        again, it moves to the end of ``session_files``."""

    @abstractmethod
    def session_files(self, session_id: str) -> list[Artifact]:
        """The session's own files, in the order they were last written."""

    @abstractmethod
    def runs_in_flight(self) -> list[RunResult]:
        """Runs recorded as started and never as ended (their server died under them): for the
        start."""

    @abstractmethod
    def forget_run_if_running(self, run_id: str) -> None: ...

    @abstractmethod
    def history_iter(self, session_id: str) -> Iterator[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        """``history``, one run at a time (a notebook export holds one run's output, not all).
        Each run is its own short query, so no statement stays open while others write."""

    # -- sessions: the same SQL on both ------------------------------------------------------------
    def get(self, session_id: str) -> SessionInfo | None:
        row = self._row("SELECT info FROM sessions WHERE session_id=?", (session_id,))
        return SessionInfo.model_validate_json(row[0]) if row else None

    def all(self) -> list[SessionInfo]:
        """Every stored session, in creation order (then id): each record read (tools and tests;
        the start and listings read through the indexes)."""
        rows = self._rows("SELECT info FROM sessions ORDER BY created_us, session_id")
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
        rows = self._rows(
            f"SELECT info FROM sessions {'WHERE ' + ' AND '.join(where) if where else ''} "
            f"ORDER BY created_us {order}, session_id {order} LIMIT ?", (*args, limit))
        return [SessionInfo.model_validate_json(r[0]) for r in rows]

    def status_counts(self) -> dict[str, int]:
        """How many stored sessions have each status (no record is read)."""
        return {status: int(n) for status, n in self._rows("SELECT status, COUNT(*) FROM sessions GROUP BY status")}

    def delete(self, session_id: str) -> None:
        """Forget the session; its runs stay (their artifacts outlive the session)."""
        self._run("DELETE FROM sessions WHERE session_id=?", (session_id,))

    def take_id(self, session_id: str, tenant: str) -> None:
        """A new session takes over an id: the old session's runs and files are no longer its."""
        self._run("DELETE FROM runs WHERE session_id=?", (session_id,))
        self._run("DELETE FROM session_files WHERE session_id=?", (session_id,))
        self._run("INSERT INTO owners (session_id, tenant) VALUES (?, ?) "
                  "ON CONFLICT(session_id) DO UPDATE SET tenant=excluded.tenant", (session_id, tenant))

    def owner(self, session_id: str) -> str | None:
        """The tenant of the id's records, or None (unknown id, or made before tenants existed)."""
        row = self._row("SELECT tenant FROM owners WHERE session_id=?", (session_id,))
        return row[0] if row else None

    # -- MCP connections: the manager whose SDK holds each (api/forwarding.py) ---------------------
    def record_mcp_session(self, mcp_session_id: str, manager_id: str) -> None:
        self._run("INSERT INTO mcp_sessions (mcp_session_id, manager_id) VALUES (?, ?) "
                  "ON CONFLICT (mcp_session_id) DO UPDATE SET manager_id=excluded.manager_id",
                  (mcp_session_id, manager_id))

    def mcp_session_manager(self, mcp_session_id: str) -> str | None:
        row = self._row("SELECT manager_id FROM mcp_sessions WHERE mcp_session_id=?", (mcp_session_id,))
        return row[0] if row else None

    def forget_mcp_session(self, mcp_session_id: str) -> None:
        self._run("DELETE FROM mcp_sessions WHERE mcp_session_id=?", (mcp_session_id,))

    def workspace(self, session_id: str) -> Path | None:
        row = self._row("SELECT workspace FROM sessions WHERE session_id=?", (session_id,))
        return Path(row[0]) if row and row[0] else None

    def workspaces(self) -> set[Path]:
        return {Path(r[0]) for r in self._rows("SELECT workspace FROM sessions") if r[0]}

    def kernel_ids(self) -> set[str]:
        """The kernels stored sessions have had (no record is read)."""
        return {r[0] for r in self._rows("SELECT kernel_id FROM sessions WHERE kernel_id IS NOT NULL")}

    def hibernated(self, tenant: str | None = None) -> list[SessionInfo]:
        """The hibernated sessions (of ``tenant``, or of every tenant), in creation order."""
        mine, args = ("AND tenant = ? ", (tenant,)) if tenant is not None else ("", ())
        rows = self._rows(f"SELECT info FROM sessions WHERE status = 'hibernated' {mine}"
                          "ORDER BY created_us, session_id", args)
        return [SessionInfo.model_validate_json(r[0]) for r in rows]

    def hibernated_workspaces(self) -> set[Path]:
        """The workspaces of hibernated sessions (no record is read)."""
        return {Path(r[0]) for r in self._rows(
            "SELECT workspace FROM sessions WHERE status = 'hibernated' AND workspace IS NOT NULL") if r[0]}

    # -- runs ------------------------------------------------------------------------------------------
    def add_run(self, code: str, result: RunResult, events: list[dict[str, Any]] | None = None) -> None:
        """``events``: the run's output in arrival order (what a notebook export shows).
        SessionOwnedElsewhere when the writer no longer holds the session's lease (``_fenced``)."""
        # A run is written when it starts (status running) and again when it ends, in its place.
        # (SELECT ... WHERE, not VALUES: the lease's condition is in the writing statement.)
        if not self._rows(
            "INSERT INTO runs (run_id, session_id, seq, code, result, events, running) "
            "SELECT ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM runs WHERE session_id=?), ?, ?, ?, ? "
            f"WHERE {self._fenced()} ON CONFLICT(run_id) DO UPDATE SET result=excluded.result, "
            "events=excluded.events, running=excluded.running RETURNING run_id",
            (result.run_id, result.session_id, result.session_id, self._text(code), result.model_dump_json(),
             json.dumps(events, default=str) if events is not None else None, result.status == "running",
             *self._fence_args(result.session_id)),
        ):
            self._refused(result.session_id)

    def end_run(self, result: RunResult) -> bool:
        """A run left running ends as ``result`` (an adopter's ``interrupted``): only if it is still
        running, in the same statement, so a result its manager recorded just before never is
        overwritten. Whether it was still running."""
        return bool(self._rows("UPDATE runs SET result=?, running=? WHERE run_id=? AND running RETURNING run_id",
                               (result.model_dump_json(), result.status == "running", result.run_id)))

    def get_run(self, run_id: str) -> RunResult | None:
        row = self._row("SELECT result FROM runs WHERE run_id=?", (run_id,))
        return RunResult.model_validate_json(row[0]) if row else None

    def history(self, session_id: str) -> list[tuple[str, RunResult, list[dict[str, Any]] | None]]:
        """(code, result, output events or None) of each run, in order."""
        rows = self._rows("SELECT code, result, events FROM runs WHERE session_id=? ORDER BY seq", (session_id,))
        return [(code, RunResult.model_validate_json(res), json.loads(ev) if ev else None)
                for code, res, ev in rows]

    def has_runs(self, session_id: str) -> bool:
        return self._row("SELECT 1 FROM runs WHERE session_id=? LIMIT 1", (session_id,)) is not None

    def runs(self, session_id: str) -> list[tuple[str, RunResult]]:
        rows = self._rows("SELECT code, result FROM runs WHERE session_id=? ORDER BY seq", (session_id,))
        return [(code, RunResult.model_validate(json.loads(res))) for code, res in rows]

    def run_count(self, session_id: str) -> int:
        row = self._row("SELECT COUNT(*) FROM runs WHERE session_id=?", (session_id,))
        return int(row[0]) if row else 0

    def run_events(self, run_id: str) -> list[dict[str, Any]]:
        """A run's output events in arrival order (empty for runs stored without them)."""
        row = self._row("SELECT events FROM runs WHERE run_id=?", (run_id,))
        return json.loads(row[0]) if row and row[0] else []

    # -- checkpoints -----------------------------------------------------------------------------------
    def add_checkpoint(self, info: CheckpointInfo, tenant: str) -> None:
        self._run(
            "INSERT INTO checkpoints (checkpoint_id, session_id, tenant, created, info) VALUES (?, ?, ?, ?, ?)",
            (info.checkpoint_id, info.session_id, tenant, info.created_at.timestamp(), info.model_dump_json()))

    def checkpoint(self, checkpoint_id: str) -> tuple[CheckpointInfo, str] | None:
        """(checkpoint, its tenant), or None."""
        row = self._row("SELECT info, tenant FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,))
        return (CheckpointInfo.model_validate_json(row[0]), row[1]) if row else None

    def checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first."""
        rows = self._rows("SELECT info FROM checkpoints WHERE session_id=? ORDER BY created DESC", (session_id,))
        return [CheckpointInfo.model_validate_json(r[0]) for r in rows]

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._run("DELETE FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,))
