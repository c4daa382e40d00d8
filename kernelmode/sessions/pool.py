"""The warm pool: started, sandboxed, preamble-ready kernels that no session has used yet.

Its size follows the recent demand (``starts.pool_target``): at least ``sessions.pool_size``,
after a burst as many as the burst asked for, up to ``sessions.pool_max`` and within
``sessions.pool_memory_mb``. Refills start kernels in parallel through the start gate (a
create's own start goes first), wait while runs or creates are under way (up to
``REFILL_DEFER_SECONDS``), and import ``sessions.pool_preimport`` in each kernel. Each kernel
serves exactly one session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..config import Settings
from ..errors import KernelmodeError, SandboxUnavailable
from ..models import Limits, SessionInfo
from .kernel_env import Kernels, public_text, told
from .kernels import Kernel
from .live import now
from .preimport import preimport
from .starts import Demand, StartGate, pool_target

log = logging.getLogger("kernelmode.sessions")
REFILL_DEFER_SECONDS = 5.0  # longest a refill waits for runs and creates to end
KERNEL_MB_ESTIMATE = 150.0  # a warm kernel with numpy and pandas, where none can be measured
BACKOFF_MIN, BACKOFF_MAX = 0.5, 30.0  # after a failed start (a broken sandbox: no hot loop)


class WarmPool:
    def __init__(self, settings: Settings, kernels: Kernels, sandbox: str, *,
                 busy: Callable[[], bool] = lambda: False, room: Callable[[], int] | None = None,
                 usage: Callable[[str], int | None] = lambda kernel_id: None,
                 usable: Callable[[], bool] = lambda: True) -> None:
        """``busy``: whether runs or creates are under way (a refill waits for them); ``room``:
        the sessions the server may still hold; ``usage``: a kernel's memory use in bytes (or None);
        ``usable``: whether the waiting kernels may be handed out now (ownership.fresh: not while
        another manager may have shut them down as a dead manager's)."""
        self.settings = settings
        self.kernels = kernels
        self.sandbox = sandbox
        self._ready: list[Kernel] = []
        self._task: asyncio.Task[None] | None = None
        self._starting = 0  # refills under way
        self.gate = StartGate(settings.sessions.pool_parallel_starts)
        self.demand = Demand()
        self.busy = busy
        self.room = room or (lambda: settings.sessions.max_sessions)
        self.usage = usage
        self.usable = usable
        # The pool kernel being started first (done when its start ends), and whether a create
        # waits for it: one that comes while it starts takes it rather than start a second beside it.
        self._next: asyncio.Future[SandboxUnavailable | None] | None = None
        self._claimed = False
        self._stopping = False
        # Why the last kernel start failed, None once one succeeds: /readyz reports it.
        self.error: str | None = None
        # The wait after a failed start, doubling up to BACKOFF_MAX: the pool's, not a worker's, so
        # that new workers (a refill after each take) do not start again at the shortest.
        self.backoff = BACKOFF_MIN

    @property
    def ready(self) -> int:
        """Kernels ready to be handed out now."""
        return len(self._ready)

    @property
    def size(self) -> int:
        """The configured floor."""
        return self.settings.sessions.pool_size

    def kernel_mb(self) -> float:
        """A warm kernel's memory: the largest measured among the waiting ones, else an estimate."""
        measured = [b for k in self._ready if (b := self.usage(k.kernel_id))]
        return max(measured) / 2**20 if measured else KERNEL_MB_ESTIMATE

    def target(self) -> int:
        """Warm kernels to keep now (between the floor and ``pool_max``; see ``pool_target``)."""
        cfg = self.settings.sessions
        if cfg.pool_size <= 0:
            return 0
        return pool_target(cfg.pool_size, cfg.pool_max, self.demand.peak(), self.kernel_mb(),
                           cfg.pool_memory_mb, self.room())

    @property
    def state(self) -> str:
        """off (size 0), full (at its floor), refilling (kernels starting as they should) or
        failing (the last start failed: ``error`` says why; retried with a backoff)."""
        if self.size <= 0:
            return "off"
        if self.error is not None:
            return "failing"
        return "full" if len(self._ready) >= self.size and not self._starting else "refilling"

    def refill(self, delay: float = 0.0) -> None:
        if self._stopping or self.size <= 0:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._fill(delay), name="pool")

    async def _fill(self, delay: float) -> None:
        # After a take, let the new session's first runs have the CPU before a kernel starts.
        await asyncio.sleep(delay)
        if self._next is None:
            # The very first kernel starts alone: a create that waits for it (the embedded MCP
            # server's first call, sent while the service starts) gets it sooner, without a second
            # start and its imports beside it on the cores.
            await self._worker(starts=1)
        workers = max(1, min(self.gate.slots, self.target() - len(self._ready)))
        await asyncio.gather(*(self._worker() for _ in range(workers)))

    def _short(self) -> bool:
        return len(self._ready) + self._starting < self.target()

    async def _quiet(self) -> None:
        """Wait while runs or creates are under way (their answers first: a burst's first cells
        before the pool's kernels and their imports). Below the floor at most
        REFILL_DEFER_SECONDS (a server always busy still gets its floor back); above it, as long
        as it takes: growing the pool is for when the machine is idle."""
        waited = 0.0
        while self.busy():  # noqa: ASYNC110 - busy() reads state kept elsewhere: polled
            if waited >= REFILL_DEFER_SECONDS and len(self._ready) < self.size:
                return
            await asyncio.sleep(0.1)
            waited += 0.1

    async def _worker(self, starts: int | None = None) -> None:
        """Start kernels while the pool is short (``starts``: at most that many tries)."""
        while self._short() and not self._stopping and (starts is None or starts > 0):
            if starts is not None:
                starts -= 1
            await self._quiet()
            if not self._short() or self._stopping:
                return
            self._starting += 1
            try:
                await self._start_one()
                self.backoff, self.error = BACKOFF_MIN, None
            except KernelmodeError as e:
                self.error = public_text(e)  # /readyz is public
                backoff, self.backoff = self.backoff, min(self.backoff * 2, BACKOFF_MAX)
                log.warning("warm pool: could not start a kernel (%s); retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
            finally:
                self._starting -= 1

    async def _start_one(self) -> None:
        t = now()
        placeholder = SessionInfo(
            session_id="pool", status="idle", created_at=t, last_activity=t,
            ttl_seconds=self.settings.sessions.ttl_seconds, limits=self.settings.sandbox.limits,
            sandbox=self.sandbox,
        )
        first = self._next is None
        if first:
            self._next = asyncio.get_running_loop().create_future()
        failed: SandboxUnavailable | None = None
        try:
            await self.gate.acquire(create=False)
            t0, took = time.monotonic(), None
            try:
                k = await self.kernels.new(placeholder)
                took = time.monotonic() - t0
            except SandboxUnavailable as e:  # its claimant answers this too (claim)
                failed = e
                raise
            finally:
                self.gate.release(took)
            # A create waiting for this very kernel takes it now: it would wait longer for the
            # imports than they save it (the embedded MCP server's first session).
            if not (first and self._claimed):
                if not await preimport(k, self.settings.sessions.pool_preimport, self.kernels.start_timeout):
                    await k.discard()
                    return
            self._ready.append(k)
        finally:
            if first:
                self._started(failed)

    async def start_for(self, info: SessionInfo) -> Kernel:
        """A kernel started for a create the pool could not serve, in its turn at the start
        gate; ServerBusy (at once) when that turn would come too late (``create_queue_seconds``)."""
        self.gate.admit(self.settings.sessions.create_queue_seconds)
        await self.gate.acquire(create=True)
        t0, took = time.monotonic(), None
        try:
            k = await self.kernels.new(info)
            took = time.monotonic() - t0
            return k
        finally:
            self.gate.release(took)

    def _started(self, failed: SandboxUnavailable | None = None) -> None:
        """The pool kernel's start ended (in the pool, failed or cancelled): wake its claimant,
        with the error when the kernel died as it started (``failed``)."""
        if self._next is not None and not self._next.done():
            self._next.set_result(failed)
        self._next, self._claimed = None, False

    def resize(self) -> None:
        """Follow the target now (the reaper's round): start kernels when short (sessions that
        ended made room a burst did not leave), stop the waiting ones beyond it (the newest first)."""
        if self._short():
            self.refill()
        extra = len(self._ready) - max(self.target(), self.size)
        if extra > 0 and not self._stopping:
            gone, self._ready = self._ready[-extra:], self._ready[:-extra]
            for k in gone:
                asyncio.create_task(k.discard())

    def waiting(self) -> list[Kernel]:
        """The kernels ready to be handed out (what the liveness probe watches)."""
        return list(self._ready)

    def evict(self, k: Kernel) -> None:
        """``k`` stopped answering: out of the pool (its DELETE in the background), refill."""
        if k in self._ready:
            self._ready.remove(k)
            asyncio.create_task(k.discard())
            self.refill()

    def take(self, limits: Limits) -> Kernel | None:
        """A pool kernel for a session with the default limits; never one that ran any code
        (but kernelmode's: the preamble, ``pool_preimport``)."""
        if limits != self.settings.sandbox.limits or not self.usable():
            return None
        self.demand.add()
        self.refill(self.settings.sessions.pool_refill_delay_seconds)  # grows after a burst
        while self._ready:
            k = self._ready.pop(0)
            if k.ready:
                return k
            asyncio.create_task(k.discard())  # died while waiting: replaced by the refill
        return None

    async def claim(self, limits: Limits, tenant: str | None = None) -> Kernel | None:
        """``take``, or, when a pool kernel is starting and nobody waits for it yet, that one
        once it is up: it is ready sooner than one started now beside it (the first session
        after start, e.g. the embedded MCP server's). Not while the pool is failing: its next
        start is likely to fail too, and the create's own start says why. If the kernel it waited
        for died as it started (SandboxUnavailable), the create gets that error at once: a start of
        its own would die the same way, after the same wait (as ``tenant`` may be told it:
        kernel_env.told)."""
        k = self.take(limits)
        if k is None and self._next is not None and not self._claimed and limits == self.settings.sandbox.limits \
                and self.usable() and self.error is None:
            self._claimed = True
            failed = await asyncio.shield(self._next)
            if failed is not None:
                raise told(SandboxUnavailable(failed.message, details=failed.details), tenant)
            if self._ready:
                k = self._ready.pop(0)  # not take(): this create's demand is counted already
                if not k.ready:
                    asyncio.create_task(k.discard())
                    k = None
        return k

    async def drop(self, shutdown: bool = True) -> None:
        """Discard every waiting kernel (``shutdown`` False: the gateway is gone, and they with it)."""
        waiting, self._ready = self._ready, []
        self.error = None  # a failure of the gateway that went: the next start says what is now
        for k in waiting:
            await k.discard(shutdown=shutdown)

    def halt(self) -> None:
        """No refill from now on (shutdown's first step: nothing new starts while it stops)."""
        self._stopping = True

    async def stop(self) -> None:
        """Stop filling and discard the waiting kernels, all at once. A start in flight is
        cancelled once the gateway has answered it (``GatewayClient.start_kernel``), and its
        DELETE (``Kernels.retire``) is answered before this returns: the gateway is stopped next,
        and a kernel it has not registered yet would outlive it."""
        self.halt()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        waiting, self._ready = self._ready, []
        await asyncio.gather(*(k.discard() for k in waiting), return_exceptions=True)
        if self.kernels.retiring:
            await asyncio.wait(set(self.kernels.retiring), timeout=self.settings.gateway.shutdown_timeout_seconds + 2)
