"""A cold start (issue 33): create + first run of a session the pool cannot serve, before vs after.

Run:  .venv/bin/python bench/cold_start.py [--n 20] [--before REF] [--no-write]

Two `kernelmode serve` with ``sessions.pool_size`` 0 (every create starts a kernel in a new bwrap
sandbox): one from ``--before`` (a git ref, default the merge base with main, exported to a scratch
folder) and one from this checkout. Sample by sample, alternating which server goes first:
``POST /v1/sessions {}`` until its answer, then ``POST .../execute {"code": "print('hi'); 1+1"}``
until its answer (checked: ``2`` and its output); the session is deleted and 0.3 s pass before
the next sample. One warm-up sample per server is discarded. Reported: median, p25/p75, min of
the create, the first run, and both. A shared 2-core machine is noisy: compare the two servers
of one run. Writes the "cold-start" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import time

import httpx
from harness import REPO, loadavg, ms_since, require_kernel_venv, run_stoppable, write_section
from servers import KmServer, before_checkout

SECTION = "cold-start"
COLD = {"KERNELMODE_SESSIONS__POOL_SIZE": "0"}


async def sample(c: httpx.AsyncClient) -> tuple[float, float]:
    """(create ms, first run ms) of one cold session."""
    t0 = time.perf_counter_ns()
    r = await c.post("/v1/sessions", json={})
    r.raise_for_status()
    created = ms_since(t0)
    sid = r.json()["session_id"]
    t1 = time.perf_counter_ns()
    x = (await c.post(f"/v1/sessions/{sid}/execute", json={"code": "print('hi'); 1+1"})).json()
    ran = ms_since(t1)
    assert x.get("result") == "2" and x.get("stdout") == "hi\n" and not r.json().get("from_pool"), x
    await c.delete(f"/v1/sessions/{sid}")
    return created, ran


def quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.0f} ({q[0]:.0f}–{q[2]:.0f}, min {min(xs):.0f})"


async def run(args: argparse.Namespace) -> int:
    load_start, started = loadavg(), time.monotonic()
    tmp, before, after = before_checkout(args.before, "km-cold-")
    servers = {"before": KmServer("before", COLD, checkout=tmp / "before"), "after": KmServer("after", COLD)}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {}
            for name, km in servers.items():
                stack.push_async_callback(km.stop)
                await asyncio.to_thread(km.start)
                assert km.srv is not None
                clients[name] = await stack.enter_async_context(httpx.AsyncClient(
                    base_url=km.srv.url, timeout=120, headers={"Authorization": f"Bearer {km.srv.token}"}))
            names = list(servers)
            for i in range(args.n + 1):
                for name in (names if i % 2 else names[::-1]):
                    s = await sample(clients[name])
                    if i:
                        got[name].append(s)
                    await asyncio.sleep(0.3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    labels = {"before": before, "after": after}
    rows = []
    for name, xs in got.items():
        rows.append(f"| {name} ({labels[name]}) | {quartiles([a + b for a, b in xs])} | "
                    f"{quartiles([a for a, _ in xs])} | {quartiles([b for _, b in xs])} |")
    text = f"""## A cold start: create + first run, no pool (bench/cold_start.py)

`.venv/bin/python bench/cold_start.py --n {args.n}`, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC,
wall {time.monotonic() - started:.0f} s, load average {load_start} at the start ({loadavg()} at the end):
a 2-core machine shared with other work; the two servers of this run, sampled alternately, are
what compare. Each sample: `POST /v1/sessions {{}}` on a server with `pool_size` 0 (a new kernel
in a new bwrap sandbox), then `print('hi'); 1+1` in it. ms: median (p25–p75, min), N = {args.n}.

| server | create + first run | create | first run |
|---|---|---|---|
{chr(10).join(rows)}
"""
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", SECTION, text)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="samples per server")
    p.add_argument("--before", default=None, help="git ref to compare with (default: merge base with main)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    require_kernel_venv(p)
    return run_stoppable(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
