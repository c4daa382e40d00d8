"""The reaper: every ``interval`` seconds, sessions idle past their time-to-live are deleted (or
hibernated, and hibernated ones past theirs deleted). A manager reaps only the sessions it owns
(its live map); the store-wide pass over hibernated sessions runs on one manager at a time, the
holder of the ``:reaper`` lease (ownership.py), so nothing is reaped twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from ..errors import SessionNotFound
from .live import LiveSession, now

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager

log = logging.getLogger("kernelmode.sessions")


def expired(live: Iterable[LiveSession], at: datetime) -> list[str]:
    """Sessions past their expiry that run nothing now."""
    return [s.info.session_id for s in live
            if not s.lock.locked() and s.info.expires_at and s.info.expires_at <= at]


REAPER_LEASE = ":reaper"  # the store-wide pass's singleton lease (no session id has a colon)


async def reap_pass(m: SessionManager) -> list[str]:
    """One round: the pool resized, then this manager's idle sessions hibernated (or deleted
    when hibernation is off) and, on the holder of the reaper lease, hibernated sessions past
    their time deleted. The sessions hibernated or deleted for idleness."""
    m.pool.resize()  # the pool follows demand: grown after a burst, shrunk when it fades
    if m.hibernation.on:
        t = now()
        # A due session may be deleted while an earlier one hibernates: skip it, never a KeyError.
        slept = [sid for sid in m.hibernation.due(t) if await m._hibernate(sid)]
        if m.ownership.take(REAPER_LEASE):
            for sid in m.hibernation.expired(t):
                log.info("hibernated session %s expired", sid)
                with contextlib.suppress(SessionNotFound):
                    await m.delete(sid, reason="expired")
        return slept
    gone = expired(m.live, now())
    for sid in gone:
        log.info("session %s expired (idle past its ttl)", sid)
        with contextlib.suppress(SessionNotFound):
            await m.delete(sid, reason="expired")
    return gone


class Reaper:
    def __init__(self, interval: float, reap: Callable[[], Awaitable[object]]) -> None:
        self.interval = interval
        self.reap = reap
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever(), name="reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")
