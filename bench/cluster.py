"""Kernels on remote nodes through Enterprise Gateway vs the embedded gateway (issue 19).

Run (as root, after `make setup-cluster`):
  .venv/bin/python bench/cluster.py [--samples N] [--quick] [--no-write]

In one run: the rig of tests/cluster (two node namespaces, sshd + nftables each), EG 3.3.0 with
the rig's patches launching sandboxed kernels on the nodes over SSH, and two `kernelmode serve`
(bwrap, pool_size 1): ``embedded`` (its own Kernel Gateway, kernels on this host) and ``eg``
(gateway.url = that EG). Measured, interleaved round-robin in batches (harness ``interleave``):

  execute   POST /v1/sessions/{id}/execute of `1+1` on a live session (keep-alive client);
  create    POST /v1/sessions taken from the warm pool (refilled, untimed, before each);
  cold      POST /api/kernels straight to EG (SSH to a node, setpriv + bwrap + launcher, the
            kernel's connection info back) until EG answers 201, then DELETE (untimed).

Results go to a section of bench/RESULTS.md (unless --no-write); the last line is a SUMMARY.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import (
    BENCH,
    Stats,
    add_sampling_args,
    interleave,
    loadavg,
    run_stoppable,
    sampling_args,
    write_section,
)

from tests.cluster import eg as eg_mod
from tests.cluster import rig as rig_mod
from tests.conftest import Server, start_server
from tests.integration.test_lifecycle import _unmount_under

SECTION = "cluster"
POOL = {"KERNELMODE_SESSIONS__POOL_SIZE": "1"}


async def _pool_ready(c: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 120
    while (await c.get("/readyz")).json()["checks"]["pool"]["ready"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not refill in 120 s")
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> int:
    why = rig_mod.missing() or eg_mod.missing()
    if why:
        print(f"bench/cluster.py: {why}", file=sys.stderr)
        return 2
    started, load = time.monotonic(), loadavg()
    rig = rig_mod.claim()
    gw: eg_mod.EnterpriseGateway | None = None
    dirs = [Path(tempfile.mkdtemp(prefix=f"kmbench-{n}-", dir="/tmp")) for n in ("emb", "eg")]
    servers: dict[str, Server] = {}
    clients: dict[str, httpx.AsyncClient] = {}
    try:
        gw = eg_mod.start(rig)
        for d in dirs:
            d.chmod(0o711)
        servers["embedded"] = start_server(POOL, data_dir=dirs[0])
        servers["eg"] = start_server({**POOL, **gw.env()}, data_dir=dirs[1])
        clients = {name: httpx.AsyncClient(base_url=srv.url, timeout=120,
                                           headers={"Authorization": f"Bearer {srv.token}"})
                   for name, srv in servers.items()}
        for c in clients.values():
            assert (await c.post("/v1/sessions", json={"session_id": "warm"})).status_code == 201
        egc = httpx.AsyncClient(base_url=gw.url, timeout=120, headers={"Authorization": f"token {gw.token}"})
        clients["_eg"] = egc

        def execute(c: httpx.AsyncClient):  # noqa: ANN202
            async def one() -> float:
                t0 = time.perf_counter_ns()
                r = await c.post("/v1/sessions/warm/execute", json={"code": "1+1"})
                ms = (time.perf_counter_ns() - t0) / 1e6
                assert r.json()["result"] == "2", r.text
                return ms
            return one

        def create(c: httpx.AsyncClient):  # noqa: ANN202
            async def one() -> float:
                await _pool_ready(c)
                t0 = time.perf_counter_ns()
                r = await c.post("/v1/sessions", json={})
                ms = (time.perf_counter_ns() - t0) / 1e6
                assert r.status_code == 201, r.text
                await c.delete(f"/v1/sessions/{r.json()['session_id']}")
                return ms
            return one

        async def cold() -> float:
            t0 = time.perf_counter_ns()
            r = await egc.post("/api/kernels", json={"name": eg_mod.KERNEL_NAME,
                                                     "env": {"KERNEL_USERNAME": "bench"}})
            ms = (time.perf_counter_ns() - t0) / 1e6
            assert r.status_code == 201, r.text
            await egc.delete(f"/api/kernels/{r.json()['id']}")
            return ms

        names = ("embedded", "eg")
        ex = {f"execute/{n}": Stats(f"execute/{n}") for n in names}
        await interleave({k: execute(clients[k.split("/")[1]]) for k in ex}, ex, args.samples, args.batch, args.warmup)
        n_small = max(10, args.samples // 10)
        cr = {f"create/{n}": Stats(f"create/{n}") for n in names}
        await interleave({k: create(clients[k.split("/")[1]]) for k in cr}, cr, n_small, 5, 2)
        cl = {"cold launch/eg": Stats("cold launch/eg")}
        await interleave({"cold launch/eg": cold}, cl, n_small, 5, 1)
        stats = {**ex, **cr, **cl}
    finally:
        for c in clients.values():
            await c.aclose()
        for srv in servers.values():
            srv.stop()
        if gw is not None:
            gw.stop()
        rig.down()
        for d in dirs:
            _unmount_under(d)
            shutil.rmtree(d, ignore_errors=True)
    ratio_ex = stats["execute/eg"].median / stats["execute/embedded"].median
    ratio_cr = stats["create/eg"].median / stats["execute/eg"].median
    rows = "\n".join(f"| {k} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} |" for k, s in stats.items())
    body = f"""## Kernels on remote nodes through Enterprise Gateway (issue 19; bench/cluster.py)

Generated by `bench/cluster.py {' '.join(sys.argv[1:])}`; wall time {time.monotonic() - started:.0f} s;
load average at the start {load}. The machine is shared and busy (other engineers' test runs):
absolute figures move, the ratios of the same run count. ``embedded``: `serve` with its own Kernel
Gateway (bwrap kernels on this host). ``eg``: `serve` with gateway.url = EG 3.3.0 (patched, see
tests/cluster/eg_patches.py) launching setpriv + bwrap kernels over SSH on two network-namespace
nodes (tests/cluster/rig.py); the kernels' traffic crosses a veth bridge and the nodes' nftables.

| path | samples | median ms | p95 ms |
|---|---|---|---|
{rows}

- warm execute, EG on a node / embedded: **{ratio_ex:.2f}x** (goal: <= 1.2x).
- session create from the warm pool through EG / a warm execute there: **{ratio_cr:.2f}x** (goal: <= 3x).
- cold kernel launch through EG (SSH + sandbox + launcher + connection info), median
  **{stats['cold launch/eg'].median:.0f} ms**: what the warm pool hides.
"""
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SECTION, body)
    print(body)
    print(f"SUMMARY execute_ratio={ratio_ex:.2f} create_over_execute={ratio_cr:.2f} "
          f"cold_ms={stats['cold launch/eg'].median:.0f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sampling_args(p)
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args()
    sampling_args(p, args)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
