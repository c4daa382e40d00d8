"""The drain (sessions/drain.py) in-process, with real asyncio tasks for runs: it refuses new work
with 503 server_busy and a Retry-After, waits for every run in flight (queued ones too), and stops
waiting at its deadline or at a second signal. No timing is measured: the deadline used is 0 or
far away, and the runs end when the test lets them."""

from __future__ import annotations

import asyncio

import pytest

from kernelmode.errors import ServerBusy
from kernelmode.gateway.execution import OutputCollector
from kernelmode.sessions.drain import Drain
from kernelmode.sessions.runs import LiveRun, RunRegistry


def _run(registry: RunRegistry, release: asyncio.Event, n: int) -> LiveRun:
    run = LiveRun(run_id=f"r{n}", session_id="s", collector=OutputCollector(0))

    async def body() -> None:
        await release.wait()
        registry.finished(run)

    run.task = asyncio.create_task(body())  # type: ignore[assignment]
    registry.add(run)
    return run


def test_draining_refuses_new_work_with_when_to_come_back() -> None:
    drain = Drain(RunRegistry(60))
    drain.check("a new run")  # not draining: nothing
    drain.begin()
    with pytest.raises(ServerBusy) as e:
        drain.check("a new run")
    assert e.value.http_status == 503 and e.value.details == {"retry_after_seconds": 1}
    assert "stopping" in e.value.message and "a new run" in e.value.message


def test_the_drain_waits_for_every_run_in_flight() -> None:
    async def scenario() -> int:
        registry, release = RunRegistry(60), asyncio.Event()
        drain = Drain(registry)
        runs = [_run(registry, release, n) for n in range(2)]  # one running, one queued behind it
        waiting = asyncio.create_task(drain.wait(3600))
        await asyncio.sleep(0)
        assert not waiting.done()
        release.set()
        still = await waiting
        assert all(r.done for r in runs)
        return still

    assert asyncio.run(scenario()) == 0


def test_the_drain_ends_at_its_deadline_or_at_a_second_signal() -> None:
    async def scenario() -> tuple[int, int]:
        registry, never = RunRegistry(60), asyncio.Event()
        drain = Drain(registry)
        _run(registry, never, 1)
        at_deadline = await drain.wait(0)
        cut = asyncio.Event()
        waiting = asyncio.create_task(drain.wait(3600, cut))
        await asyncio.sleep(0)
        cut.set()
        cut_short = await waiting
        never.set()
        return at_deadline, cut_short

    assert asyncio.run(scenario()) == (1, 1)


def test_a_cell_on_an_open_kernel_websocket_is_refused_while_draining() -> None:
    """A console's or a Jupyter client's cell is no run the drain waits for: refused, with what to do."""
    drain = Drain(RunRegistry(60))
    assert drain.cell_refusal() is None
    drain.begin()
    reason = drain.cell_refusal()
    assert reason is not None and "stopping" in reason and "reconnect" in reason
