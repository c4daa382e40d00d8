"""The reaper: every ``interval`` seconds, sessions idle past their time-to-live are deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime

from .live import LiveSession

log = logging.getLogger("kernelmode.sessions")


def expired(live: Iterable[LiveSession], at: datetime) -> list[str]:
    """Sessions past their expiry that run nothing now."""
    return [s.info.session_id for s in live
            if not s.lock.locked() and s.info.expires_at and s.info.expires_at <= at]


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
