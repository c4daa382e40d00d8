"""Runs in flight and recently finished: what long-run polling (REST and MCP) reads.

A run executes in its own task, so a caller that stops waiting (``wait_seconds`` passed, a client
gone) loses nothing: the output keeps arriving in the run's collector, and the final RunResult is
in the session store for good. Once a run ends, only a stub of it stays here (for ``retention``
seconds): its output (display data of many MB) is read back from the store when it is polled,
never held in memory for the hour a finished run stays pollable.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import KernelmodeError
from ..gateway.execution import OutputCollector
from ..models import ErrorDetail, RunProgress, RunResult
from ..tools.approvals import RunGate

if sys.version_info >= (3, 11):
    async def _within(timeout: float, wait: Callable[[], Awaitable[None]]) -> bool:
        """Whether ``wait()`` ended within ``timeout`` s. asyncio.timeout, not wait_for: no task
        and no extra loop pass (an MCP call waits so for each run it follows)."""
        try:
            async with asyncio.timeout(timeout):
                await wait()
            return True
        except TimeoutError:
            return False
else:
    async def _within(timeout: float, wait: Callable[[], Awaitable[None]]) -> bool:
        try:
            await asyncio.wait_for(wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


TAG_CHARS = 8  # a run id's first hex digits name the manager that took it (``run_tag``)


def run_tag(manager_id: str) -> str:
    """The prefix of the run ids a manager makes. A run is written to the store only when it
    starts: until then (queued behind another, waiting for the code policy's approval) or when it
    failed before it started, only the manager that took it knows it. Its id names that manager,
    so another manager forwards a poll of it to that one alone, and a made-up id (which names no
    live manager but by a 1 in 2^32 chance) to none: no request per other manager to amplify."""
    return hashlib.sha256(manager_id.encode()).hexdigest()[:TAG_CHARS]


def new_run_id(tag: str) -> str:
    """32 hex digits, as before: ``tag`` then random ones (96 bits of them with a tag)."""
    return tag + uuid.uuid4().hex[len(tag):]


@dataclass
class LiveRun:
    run_id: str
    session_id: str
    collector: OutputCollector
    code: str = ""
    task: asyncio.Task[RunResult] | None = None
    result: RunResult | None = None
    failure: KernelmodeError | None = None  # the plumbing failed (not the user's code)
    finished_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stored: bool = False  # a finished run's stub: its result and events are in the session store
    gate: RunGate | None = None  # its calls waiting for approval (tools/approvals.py)
    recorded: bool = False  # written to the store as running (its end is written in its place)
    handed_over: bool = False  # its session's new owner (another manager) ended it in the store

    @property
    def awaiting(self) -> bool:
        """A pending approval that no asker (MCP elicitation) is working on: callers must hear it."""
        return not self.done and self.gate is not None and self.gate.unasked

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def stub(self) -> LiveRun:
        """What a finished run keeps in memory: who, when, and a failure's message; no output."""
        return LiveRun(run_id=self.run_id, session_id=self.session_id, finished_at=self.finished_at,
                       collector=OutputCollector(0), failure=self.failure,
                       stored=self.failure is None or self.handed_over)

    def snapshot(self) -> RunResult:
        """The run as a RunResult: the final one, or ``running`` with the output so far."""
        if self.result is not None:
            return self.result
        pending = self.gate.listing() if self.gate is not None else []
        result = self.collector.to_result(self.run_id, self.session_id,
                                          "awaiting_approval" if pending else "running", error=None)
        result.pending_approvals = pending
        return result

    def progress(self, offset: int) -> RunProgress:
        events = self.collector.events
        offset = min(max(offset, 0), len(events))
        pending = self.gate.listing() if self.gate is not None and not self.done else []
        status: Any = self.result.status if self.result is not None else (
            "error" if self.failure is not None else "awaiting_approval" if pending else "running")
        return RunProgress(
            run_id=self.run_id, session_id=self.session_id, status=status, done=self.done,
            offset=offset, next_offset=len(events), events=events[offset:],
            result=self.result, pending_approvals=pending,
            failure=ErrorDetail(**self.failure.to_dict()) if self.failure is not None else None,
            approvals_version=self.gate.version if self.gate is not None else 0,
            truncated=self.collector.truncated, outputs_dropped=self.collector.dropped_outputs,
        )

    async def wait_changed(self, offset: int | None, timeout: float, seen: int | None = None) -> None:
        """Return when there are events past ``offset``, the run has ended, its approvals changed
        (one came or was decided; one that already waited does not end it: no busy polling), or
        ``timeout`` passed. ``offset`` None: output does not end the wait (nobody is shown it).
        ``seen``: the approvals' version the caller last saw (a change since then ends the wait
        at once); None: the version now."""
        if seen is None:
            seen = self.gate.version if self.gate is not None else 0

        def waiting() -> bool:
            return not self.done and (offset is None or len(self.collector.events) <= offset) and (
                self.gate is None or self.gate.version == seen)

        async def wait() -> None:
            while waiting():
                self.changed.clear()
                await self.changed.wait()

        if waiting() and timeout > 0:
            await _within(timeout, wait)


class RunRegistry:
    """Runs by id: all that are in flight, plus finished ones for ``retention`` seconds (at most
    ``max_finished`` of them, oldest dropped first)."""

    def __init__(self, retention: float, max_finished: int = 10_000) -> None:
        self.retention = retention
        self.max_finished = max_finished
        self._runs: dict[str, LiveRun] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()

    def add(self, run: LiveRun) -> None:
        self._runs[run.run_id] = run

    def get(self, run_id: str) -> LiveRun | None:
        self._expire()
        return self._runs.get(run_id)

    def finished(self, run: LiveRun) -> None:
        """The run ended (its result is in the session store, or it failed): those waiting on it
        keep the run itself; the registry keeps only its stub."""
        run.finished_at = time.monotonic()
        run.changed.set()
        self._runs[run.run_id] = run.stub()
        self._finished[run.run_id] = run.finished_at
        self._expire()

    def in_flight(self, session_id: str | None = None) -> list[LiveRun]:
        return [r for r in self._runs.values()
                if not r.done and (session_id is None or r.session_id == session_id)]

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.retention
        while self._finished:
            run_id, at = next(iter(self._finished.items()))
            if at > cutoff and len(self._finished) <= self.max_finished:
                break
            self._finished.popitem(last=False)
            self._runs.pop(run_id, None)
