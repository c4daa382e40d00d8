"""The adaptive warm pool's decisions (kernelmode/sessions/starts.py): how big the pool should be
after recent demand, and the start gate's order and admission (503 server_busy)."""

from __future__ import annotations

import asyncio

import pytest

from kernelmode.errors import ServerBusy
from kernelmode.sessions.preimport import preimport_code
from kernelmode.sessions.starts import (
    BURST_SECONDS,
    DEMAND_WINDOW_SECONDS,
    Demand,
    StartGate,
    pool_target,
)


def test_the_pool_follows_demand_between_its_floor_and_its_ceiling() -> None:
    assert pool_target(floor=2, ceiling=20, peak=0, kernel_mb=100, memory_mb=2048, room=50) == 2
    assert pool_target(floor=2, ceiling=20, peak=13, kernel_mb=100, memory_mb=2048, room=50) == 13
    assert pool_target(floor=2, ceiling=20, peak=80, kernel_mb=100, memory_mb=4096, room=50) == 20
    assert pool_target(floor=5, ceiling=3, peak=80, kernel_mb=100, memory_mb=4096, room=50) == 5  # ceiling < floor


def test_the_memory_budget_bounds_the_kernels_above_the_floor() -> None:
    assert pool_target(floor=2, ceiling=20, peak=20, kernel_mb=150, memory_mb=600, room=50) == 6
    assert pool_target(floor=2, ceiling=20, peak=20, kernel_mb=150, memory_mb=0, room=50) == 2


def test_no_more_kernels_than_sessions_the_server_may_still_hold_but_the_floor_stays() -> None:
    assert pool_target(floor=2, ceiling=20, peak=20, kernel_mb=100, memory_mb=4096, room=7) == 7
    assert pool_target(floor=2, ceiling=20, peak=20, kernel_mb=100, memory_mb=4096, room=0) == 2


def test_demand_is_the_largest_burst_of_the_window_and_it_fades() -> None:
    t = [1000.0]
    d = Demand(clock=lambda: t[0])
    for _ in range(3):  # three creates spread out: never more than one at a time
        d.add()
        t[0] += BURST_SECONDS + 1
    assert d.peak() == 1
    for _ in range(12):  # a burst
        d.add()
        t[0] += 0.1
    assert d.peak() == 12
    t[0] += DEMAND_WINDOW_SECONDS + 1
    assert d.peak() == 0


async def test_the_gate_lets_creates_go_before_refills_in_their_order() -> None:
    gate = StartGate(slots=1)
    await gate.acquire(create=False)  # a refill holds the only slot
    order: list[str] = []

    async def start(name: str, create: bool) -> None:
        await gate.acquire(create)
        order.append(name)
        gate.release(0.5)

    tasks = [asyncio.create_task(start(n, c)) for n, c in (("refill", False), ("a", True), ("b", True))]
    await asyncio.sleep(0)
    gate.release(0.5)
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "refill"]
    assert gate.busy == 0


async def test_a_cancelled_waiter_gives_its_turn_on() -> None:
    gate = StartGate(slots=1)
    await gate.acquire(create=True)
    waiter = asyncio.create_task(gate.acquire(create=True))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.release(None)
    assert gate.busy == 0
    await gate.acquire(create=True)  # free again at once
    assert gate.busy == 1


async def test_a_create_that_would_wait_too_long_is_refused_with_when_to_come_back() -> None:
    gate = StartGate(slots=2)
    for _ in range(2):
        await gate.acquire(create=True)
        gate.release(3.0)  # starts lately took 3 s
    gate.admit(budget=1)  # nothing under way: no wait, though a start takes longer than the budget
    for _ in range(2):
        await gate.acquire(create=True)
    waiting = [asyncio.create_task(gate.acquire(create=True)) for _ in range(4)]
    await asyncio.sleep(0)
    assert gate.expected_wait() == 9.0  # 6 ahead, 2 at a time: 3 rounds of 3 s
    gate.admit(budget=9)  # waiting 9 s is within a budget of 9 s
    with pytest.raises(ServerBusy) as e:
        gate.admit(budget=8)
    assert e.value.http_status == 503 and e.value.details == {"retry_after_seconds": 9}
    gate.admit(budget=0)  # 0: never refused
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


def test_the_preimport_cell_takes_the_names_as_data_and_leaves_no_name_behind() -> None:
    ns: dict[str, object] = {}
    exec(preimport_code(["json", "no_such_module_here", "xml.dom"]), ns)  # a missing one is skipped
    assert [k for k in ns if k != "__builtins__"] == []
    code = preimport_code(["json\"); import os; (\""])  # the settings refuse such names; still data here
    exec(code, {})


def test_pool_preimport_takes_module_names_only() -> None:
    from pydantic import ValidationError

    from kernelmode.config import SessionSettings

    assert SessionSettings(pool_preimport=["numpy", "matplotlib.pyplot"]).pool_preimport == ["numpy", "matplotlib.pyplot"]
    with pytest.raises(ValidationError, match="not module names"):
        SessionSettings(pool_preimport=["os; import sys"])
