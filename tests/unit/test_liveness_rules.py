"""The liveness probe's rules (sessions/liveness.py) on stand-ins for kernels and the gateway;
the real thing (SIGSTOP'd kernels, a frozen gateway, EG nodes) is in tests/integration/
test_liveness.py and tests/cluster/test_node_failures.py."""

from __future__ import annotations

import asyncio
from typing import Any

from kernelmode.config import Settings
from kernelmode.models import DeathCause
from kernelmode.sessions.kernel_state import NEEDS_NEW, KernelState
from kernelmode.sessions.liveness import Liveness


class FakeConn:
    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.is_open = True

    async def ping(self, timeout: float) -> bool:
        return self.answers


class FakeGateway:
    def __init__(self) -> None:
        self.up = True

    async def ping(self, timeout: float = 5) -> bool:
        return self.up


class FakeEnv:
    def __init__(self, start_timeout: float) -> None:
        self.start_timeout = start_timeout
        self.gateway = FakeGateway()


class FakeKernel:
    def __init__(self, env: FakeEnv, answers: bool) -> None:
        self.env = env
        self.kernel_id = "k1"
        self.conn = FakeConn(answers)
        self.closed = False
        self.state = KernelState.IDLE
        self.needs_ready = False
        self.cause: DeathCause | None = None

    @property
    def needs_new(self) -> bool:
        return self.state in NEEDS_NEW

    def lose(self, cause: DeathCause) -> None:
        self.cause, self.state = cause, KernelState.LOST


class FakeSession:
    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel
        self.lock = asyncio.Lock()


class FakePool:
    def __init__(self, env: FakeEnv) -> None:
        self.kernels = env
        self.evicted: list[Any] = []

    def waiting(self) -> list[Any]:
        return []

    def evict(self, k: Any) -> None:
        self.evicted.append(k)


def _setup(answers: bool, start_timeout: float = 3600.0, misses: int = 3) -> tuple[Liveness, FakeKernel, list[Any]]:
    settings = Settings()
    settings.gateway.probe_misses = misses
    env = FakeEnv(start_timeout)
    k = FakeKernel(env, answers)
    told: list[Any] = []
    live = [FakeSession(k)]
    return Liveness(settings, live, FakePool(env), told.append), k, told  # type: ignore[arg-type]


def test_lost_after_the_configured_misses_in_a_row_with_a_cause_that_guesses_nothing() -> None:
    async def go() -> None:
        liveness, k, told = _setup(answers=False, misses=3)
        for _ in range(2):
            await liveness.sweep()
        assert k.state is KernelState.IDLE and liveness.misses("k1") == 2 and not told
        await liveness.sweep()
        assert k.state is KernelState.LOST and len(told) == 1 and liveness.lost == 1
        assert k.cause is not None and k.cause.kind == "lost" and k.cause.signal is None
        assert "3 times in a row" in (k.cause.detail or "")
        await liveness.sweep()  # given up: no longer probed
        assert liveness.probes == 3

    asyncio.run(go())


def test_an_answer_resets_the_count() -> None:
    async def go() -> None:
        liveness, k, told = _setup(answers=False, misses=2)
        await liveness.sweep()
        k.conn.answers = True
        await liveness.sweep()
        k.conn.answers = False
        await liveness.sweep()
        assert k.state is KernelState.IDLE and liveness.misses("k1") == 1 and not told

    asyncio.run(go())


def test_a_silent_gateway_does_not_cost_its_kernels_until_a_launch_time_has_passed() -> None:
    async def go() -> None:
        liveness, k, told = _setup(answers=False, misses=1)
        k.env.gateway.up = False
        for _ in range(5):
            await liveness.sweep()
        assert k.state is KernelState.IDLE and not told  # the gateway froze: nothing is judged by it
        k.env.start_timeout = 0.0  # silent longer than a launch may take: as good as gone
        await liveness.sweep()
        assert k.state is KernelState.LOST and len(told) == 1

    asyncio.run(go())


def test_a_restarting_kernel_gets_a_launch_time() -> None:
    async def go() -> None:
        liveness, k, told = _setup(answers=False, misses=1)
        k.state = KernelState.RESTARTING
        for _ in range(3):
            await liveness.sweep()
        assert k.state is KernelState.RESTARTING and not told

    asyncio.run(go())


def test_death_cause_leaves_an_empty_detail_out() -> None:
    assert DeathCause(kind="exit", exit_code=3).model_dump() == {"kind": "exit", "exit_code": 3, "signal": None}
    assert DeathCause(kind="lost", detail="x").model_dump()["detail"] == "x"


class UnclosingConn(FakeConn):
    """A fresh probe websocket whose closing handshake the gateway never answers (Enterprise
    Gateway, for a kernel it is restarting on a dead node: websockets then waits 10 s)."""

    def __init__(self) -> None:
        super().__init__(answers=False)
        self.release = asyncio.Event()
        self.closed = False

    async def close(self) -> None:
        await self.release.wait()
        self.closed = True


def test_a_close_the_gateway_never_answers_holds_up_no_sweep() -> None:
    async def go() -> None:
        liveness, k, told = _setup(answers=False, misses=2)
        k.needs_ready = True  # restarted: probed over a fresh websocket
        conn = UnclosingConn()

        async def connect(kernel_id: str, on_status: Any) -> UnclosingConn:
            return conn

        k.env.gateway.connect = connect  # type: ignore[attr-defined]
        # The bound only keeps a broken sweep from hanging the test; each sweep returns at once.
        for _ in range(2):
            await asyncio.wait_for(liveness.sweep(), 60)
        assert k.state is KernelState.LOST and len(told) == 1 and not conn.closed
        conn.release.set()  # the close goes on in the background, and ends
        await asyncio.sleep(0)
        await asyncio.gather(*liveness._closing)
        assert conn.closed

    asyncio.run(go())
