"""Manager-owned liveness: every kernel is asked ``kernel_info`` on its control channel, with a
deadline, once per ``gateway.probe_interval_seconds``; one that misses ``gateway.probe_misses``
probes in a row is *lost*.

Why the manager, and not the gateway: a gateway's view of its kernels is not enough. A kernel
frozen by its node (SIGSTOP, a blackholed network) stays listed ``idle`` and never answers;
Enterprise Gateway restarts a killed kernel under the same id and the old websocket goes silently
dead; its DELETE on a lost node hangs 30 s and then fails (``GATEWAY-NOTES.md``). So:

- a run in flight on a lost kernel ends at once as ``kernel_died`` with cause ``lost`` and a
  ``detail`` saying what is known (never a guessed signal or OOM);
- the session is marked ``dead`` with that cause; its next run starts a fresh kernel (and
  restores the latest checkpoint), while the old kernel's DELETE goes on in the background;
- a lost kernel of the warm pool is dropped and the pool refilled.

Misses count only while the gateway itself answers (``GET /api/kernelspecs``), or once it has
been silent longer than a kernel launch may take: a gateway that froze for a while (Enterprise
Gateway did, 21 s to minutes, on a blackholed node) must not cost its healthy nodes' sessions
their state. While it is silent, ``/readyz`` says so.

ipykernel answers control in a thread of its own, so a kernel busy with a cell answers too; only
C code that holds the GIL for longer than ``probe_timeout × probe_misses`` looks frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..config import Settings
from ..errors import KernelmodeError
from ..models import DeathCause
from .kernels import Kernel, KernelState
from .live import LiveSession, LiveView
from .pool import WarmPool

log = logging.getLogger("kernelmode.sessions")


class Liveness:
    """Probes the kernels of ``live`` sessions and of ``pool``; ``on_lost`` is told of a session
    whose kernel was given up (to record its new status)."""

    def __init__(self, settings: Settings, live: LiveView, pool: WarmPool,
                 on_lost: Callable[[LiveSession], None]) -> None:
        self.settings = settings
        self.live = live
        self.pool = pool
        self.on_lost = on_lost
        self.probes = 0  # probes sent (a figure for tests and benchmarks)
        self.lost = 0  # kernels given up
        self._task: asyncio.Task[None] | None = None
        self._gateway_silent_since: float | None = None
        # kernel id -> (probes missed in a row, loop time of the first of them); a replaced
        # kernel has a new id, and so starts afresh.
        self._silence: dict[str, tuple[int, float]] = {}
        self._closing: set[asyncio.Task[None]] = set()  # probe websockets being closed

    @property
    def interval(self) -> float:
        return self.settings.gateway.probe_interval_seconds

    @property
    def timeout(self) -> float:
        return self.settings.gateway.probe_timeout_seconds

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="liveness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for closing in list(self._closing):
            closing.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad sweep
                log.exception("liveness sweep failed")

    async def sweep(self) -> None:
        """One probe of every kernel, all at once (each bounded by the probe timeout)."""
        due: list[tuple[Kernel, LiveSession | None]] = [(s.kernel, s) for s in self.live
                                                         if self._due(s.kernel, s)]
        due += [(k, None) for k in self.pool.waiting() if self._due(k, None)]
        ids = [k.kernel_id for k, _ in due]
        answers = await asyncio.gather(*(self.probe(k) for k, _ in due))
        known = {s.kernel.kernel_id for s in self.live} | {k.kernel_id for k in self.pool.waiting()}
        self._silence = {i: v for i, v in self._silence.items() if i in known}
        if not all(answers) and not await self._gateway_answers():
            return  # the gateway itself is silent: its kernels are not judged by it (yet)
        for (k, s), kernel_id, answered in zip(due, ids, answers, strict=True):
            if k.kernel_id == kernel_id and not k.needs_new and not k.closed:  # else: replaced meanwhile
                self._judge(k, s, answered)

    def misses(self, kernel_id: str) -> int:
        """Probes the kernel missed in a row."""
        return self._silence.get(kernel_id, (0, 0.0))[0]

    async def _gateway_answers(self) -> bool:
        """Whether misses count: the gateway answers (so its kernels do not), or it has been
        silent longer than a kernel launch may take (then it is as good as gone). A gateway
        that froze for a while (Enterprise Gateway did, on a blackholed node) must not cost the
        sessions of its healthy nodes their state."""
        loop = asyncio.get_running_loop()
        if await self.pool.kernels.gateway.ping(self.timeout):
            self._gateway_silent_since = None
            return True
        if self._gateway_silent_since is None:
            self._gateway_silent_since = loop.time()
            log.warning("the gateway does not answer either: kernels are not judged lost for up to %g s",
                        self.pool.kernels.start_timeout)
        return loop.time() - self._gateway_silent_since >= self.pool.kernels.start_timeout

    @staticmethod
    def _due(k: Kernel, s: LiveSession | None) -> bool:
        if k.closed or k.needs_new or k.conn is None:
            return False  # torn down, given up or asleep (replaced at its next run), or starting
        # A run is (re)connecting it: that connect has a deadline of its own.
        return not (s is not None and k.needs_ready and s.lock.locked())

    def _judge(self, k: Kernel, s: LiveSession | None, answered: bool) -> None:
        now = asyncio.get_running_loop().time()
        if answered:
            self._silence.pop(k.kernel_id, None)
            return
        misses, since = self._silence.get(k.kernel_id, (0, now))
        misses += 1
        self._silence[k.kernel_id] = (misses, since)
        allowed = self.settings.gateway.probe_misses
        # A kernel being restarted may take a launch's time to answer again.
        restarting = k.state is KernelState.RESTARTING and now - since < k.env.start_timeout
        log.info("kernel %s did not answer a liveness probe (%d in a row; lost at %d%s)", k.kernel_id, misses,
                 allowed, f" once its restart has had {k.env.start_timeout:g} s" if restarting else "")
        if misses < allowed or restarting:
            return
        self.lost += 1
        del self._silence[k.kernel_id]
        k.lose(DeathCause(kind="lost", detail=(
            f"no answer to kernel_info within {self.timeout:g} s, {misses} times in a row "
            "(its node, its network or the kernel itself stopped answering)")))
        if s is not None:
            self.on_lost(s)
        else:
            self.pool.evict(k)

    async def probe(self, k: Kernel) -> bool:
        """Whether ``k`` answers within the probe timeout: over its own websocket when that is
        up, else over a fresh one (after a restart or a closed websocket: the old one may be
        silently dead)."""
        self.probes += 1
        conn = k.conn
        if conn is not None and conn.is_open and not k.needs_ready:
            return await conn.ping(self.timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        probe_conn = None
        try:
            probe_conn = await asyncio.wait_for(k.env.gateway.connect(k.kernel_id, lambda _state: None),
                                                self.timeout)
            return await probe_conn.ping(max(deadline - loop.time(), 0.001))
        except (KernelmodeError, asyncio.TimeoutError):
            return False
        finally:
            if probe_conn is not None:
                # Not awaited: a gateway restarting the kernel may not answer the websocket's
                # closing handshake, and its 10 s wait would hold up every other probe.
                closing = asyncio.create_task(probe_conn.close(), name=f"probe-close-{k.kernel_id}")
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
