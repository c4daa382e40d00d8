"""The warm pool: started, sandboxed, preamble-ready kernels that no session has used yet."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..config import Settings
from ..errors import KernelmodeError
from ..models import Limits, SessionInfo
from .kernel_env import Kernels
from .kernels import Kernel
from .live import now

log = logging.getLogger("kernelmode.sessions")


class WarmPool:
    def __init__(self, settings: Settings, kernels: Kernels, sandbox: str) -> None:
        self.settings = settings
        self.kernels = kernels
        self.sandbox = sandbox
        self._ready: list[Kernel] = []
        self._task: asyncio.Task[None] | None = None
        # The pool kernel being started (done when its start ends), and whether a create waits
        # for it: one that comes while it starts takes it rather than start a second beside it.
        self._next: asyncio.Future[None] | None = None
        self._claimed = False
        self._stopping = False
        # Why the last kernel start failed, None once one succeeds: /readyz reports it.
        self.error: str | None = None

    @property
    def ready(self) -> int:
        """Kernels ready to be handed out now."""
        return len(self._ready)

    @property
    def size(self) -> int:
        """The configured size."""
        return self.settings.sessions.pool_size

    @property
    def state(self) -> str:
        """off (size 0), full (at its floor), refilling (kernels starting as they should) or
        failing (the last start failed: ``error`` says why; retried with a backoff)."""
        if self.size <= 0:
            return "off"
        if self.error is not None:
            return "failing"
        return "full" if len(self._ready) >= self.size else "refilling"

    def refill(self, delay: float = 0.0) -> None:
        if self._stopping or self.size <= 0:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._fill(delay), name="pool")

    async def _fill(self, delay: float) -> None:
        # After a take, let the new session's first runs have the CPU before a kernel starts.
        await asyncio.sleep(delay)
        backoff = 0.5
        while len(self._ready) < self.size and not self._stopping:
            t = now()
            placeholder = SessionInfo(
                session_id="pool", status="idle", created_at=t, last_activity=t,
                ttl_seconds=self.settings.sessions.ttl_seconds, limits=self.settings.sandbox.limits,
                sandbox=self.sandbox,
            )
            self._next = asyncio.get_running_loop().create_future()
            try:
                self._ready.append(await self.kernels.new(placeholder))
                backoff, self.error = 0.5, None
            except KernelmodeError as e:
                self.error = str(e)
                self._started()
                log.warning("warm pool: could not start a kernel (%s); retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            finally:
                self._started()

    def _started(self) -> None:
        """The pool kernel's start ended (in the pool, failed or cancelled): wake its claimant."""
        if self._next is not None and not self._next.done():
            self._next.set_result(None)
        self._next, self._claimed = None, False

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
        """A pool kernel for a session with the default limits; never one that ran any code."""
        if limits != self.settings.sandbox.limits:
            return None
        while self._ready:
            k = self._ready.pop(0)
            if k.ready:
                return k
            asyncio.create_task(k.discard())  # died while waiting: replaced by the refill
        return None

    async def claim(self, limits: Limits) -> Kernel | None:
        """``take``, or, when a pool kernel is starting and nobody waits for it yet, that one
        once it is up: it is ready sooner than one started now beside it (the first session
        after start, e.g. the embedded MCP server's)."""
        k = self.take(limits)
        if k is None and self._next is not None and not self._claimed and limits == self.settings.sandbox.limits:
            self._claimed = True
            await asyncio.shield(self._next)
            k = self.take(limits)
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
