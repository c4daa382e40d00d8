"""Kernel starts under way at once, and how big the warm pool should be now.

``StartGate``: at most ``sessions.pool_parallel_starts`` kernel starts at a time, a create's
before the pool's refills (a refill never holds up a create that waits), first come first
served; it knows how long a start took lately, so a create can be told at once that it would
wait longer than ``sessions.create_queue_seconds`` (``ServerBusy``: 503 and Retry-After) rather
than pile up until it times out. More starts at once than cores only slow every one of them.

``pool_target``: the adaptive pool's size, from the recent demand (``Demand``), between the
floor and the ceiling, within the memory budget and the sessions the server may still hold.
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from collections.abc import Callable

from ..errors import ServerBusy

DEFAULT_START_SECONDS = 1.0  # a start's time until some have been measured
DEMAND_WINDOW_SECONDS = 600.0  # how far back demand is remembered
BURST_SECONDS = 10.0  # creates within this long of each other count as one burst


class StartGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        self._creates: collections.deque[asyncio.Future[None]] = collections.deque()
        self._refills: collections.deque[asyncio.Future[None]] = collections.deque()
        self._took: collections.deque[float] = collections.deque(maxlen=9)  # s of the last starts

    @property
    def start_seconds(self) -> float:
        """A start's time lately (the median of the last few)."""
        return statistics.median(self._took) if self._took else DEFAULT_START_SECONDS

    def expected_wait(self) -> float:
        """Seconds a create asking now would wait before its start begins."""
        ahead = self.busy + len(self._creates)
        if ahead < self.slots:
            return 0.0
        return math.ceil((ahead - self.slots + 1) / self.slots) * self.start_seconds

    def admit(self, budget: float) -> None:
        """ServerBusy when a create asking now would wait longer than ``budget`` s before its
        start begins (0: never refused). A create with no queue ahead always goes, however long
        a start takes lately (else a slow machine would refuse every create)."""
        wait = self.expected_wait()
        if budget > 0 and wait > budget:
            retry = max(1, math.ceil(wait))
            raise ServerBusy(f"{self.busy + len(self._creates)} kernel starts are under way or queued "
                             f"(about {wait:.0f} s of waiting); try again in {retry} s",
                             details={"retry_after_seconds": retry})

    async def acquire(self, create: bool) -> None:
        """A slot: a create's at once unless every slot is taken (then in its turn); a refill's
        only when no create waits."""
        if self.busy < self.slots and not self._creates and (create or not self._refills):
            self.busy += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._creates if create else self._refills
        queue.append(fut)
        try:
            await fut  # the slot is counted by release() before this wakes
        except asyncio.CancelledError:
            if fut in queue:
                queue.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release(None)  # granted just as it was cancelled: pass the slot on
            raise

    def release(self, took: float | None) -> None:
        """A start ended (``took`` s; None: not a full start, not counted); the next in line gets the slot."""
        if took is not None:
            self._took.append(took)
        self.busy -= 1
        for queue in (self._creates, self._refills):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    self.busy += 1
                    fut.set_result(None)
                    return


class Demand:
    """When creates that a pool kernel could serve arrived (the last ``DEMAND_WINDOW_SECONDS``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()

    def add(self) -> None:
        self._times.append(self._clock())

    def peak(self) -> int:
        """The most creates that arrived within ``BURST_SECONDS`` of each other lately."""
        t = self._clock()
        while self._times and self._times[0] < t - DEMAND_WINDOW_SECONDS:
            self._times.popleft()
        best, i = 0, 0
        times = self._times
        for j in range(len(times)):
            while times[j] - times[i] > BURST_SECONDS:
                i += 1
            best = max(best, j - i + 1)
        return best


def pool_target(floor: int, ceiling: int, peak: int, kernel_mb: float, memory_mb: int, room: int) -> int:
    """Warm kernels to keep: the recent peak of creates, at least ``floor`` (always kept), at most
    ``ceiling`` (never below the floor), the kernels above the floor within ``memory_mb`` at
    ``kernel_mb`` each, and no more than ``room`` (sessions the server may still hold) needs."""
    want = min(max(floor, peak), max(floor, ceiling))
    if kernel_mb > 0:
        want = min(want, floor + int(memory_mb // kernel_mb))
    return max(floor, min(want, room))
