"""The probes of two `kernelmode serve` measured side by side (bench/external_gateway.py,
bench/cluster.py; started by servers.KmServer): ``embedded`` with its own gateway, and one
driving another gateway. Both with a warm pool of one and a live session ``warm``; the same
probes time each, interleaved by the harness (``execute`` serves bench/manager_ab.py too)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import httpx
from harness import Stats, interleave

from tests.support.server import Server

POOL = {"KERNELMODE_SESSIONS__POOL_SIZE": "1"}
Probe = Callable[[], Awaitable[float]]


async def pool_ready(c: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 120
    while (await c.get("/readyz")).json()["checks"]["pool"]["ready"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not refill in 120 s")
        await asyncio.sleep(0.05)


async def clients_with_warm_session(servers: Mapping[str, Server]) -> dict[str, httpx.AsyncClient]:
    """A keep-alive client per server, each with the live session ``warm`` made."""
    clients = {name: httpx.AsyncClient(base_url=srv.url, timeout=120,
                                       headers={"Authorization": f"Bearer {srv.token}"})
               for name, srv in servers.items()}
    for c in clients.values():
        assert (await c.post("/v1/sessions", json={"session_id": "warm"})).status_code == 201
    return clients


def execute(c: httpx.AsyncClient) -> Probe:
    """POST execute of `1+1` on the live session ``warm``."""
    async def one() -> float:
        t0 = time.perf_counter_ns()
        r = await c.post("/v1/sessions/warm/execute", json={"code": "1+1"})
        ms = (time.perf_counter_ns() - t0) / 1e6
        assert r.json()["result"] == "2", r.text
        return ms
    return one


def create(c: httpx.AsyncClient) -> Probe:
    """POST /v1/sessions taken from the warm pool (refilled, untimed, before each; deleted after)."""
    async def one() -> float:
        await pool_ready(c)
        t0 = time.perf_counter_ns()
        r = await c.post("/v1/sessions", json={})
        ms = (time.perf_counter_ns() - t0) / 1e6
        assert r.status_code == 201, r.text
        await c.delete(f"/v1/sessions/{r.json()['session_id']}")
        return ms
    return one


async def execute_and_create(clients: Mapping[str, httpx.AsyncClient], names: tuple[str, ...],
                             samples: int, batch: int, warmup: int) -> dict[str, Stats]:
    """``execute/NAME`` and ``create/NAME`` for each server, interleaved round-robin."""
    ex = {f"execute/{n}": Stats(f"execute/{n}") for n in names}
    await interleave({f"execute/{n}": execute(clients[n]) for n in names}, ex, samples, batch, warmup)
    cr = {f"create/{n}": Stats(f"create/{n}") for n in names}
    await interleave({f"create/{n}": create(clients[n]) for n in names}, cr, max(10, samples // 10), 5, 2)
    return {**ex, **cr}
