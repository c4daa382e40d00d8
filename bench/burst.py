"""Bursts of sessions (issue 33): N agents create a session at once and run their first cell.

Run:  .venv/bin/python bench/burst.py [--n 20] [--rounds 2] [--before REF | --no-before]
                                      [--stages] [--no-write]

Two `kernelmode serve` started with the defaults (bwrap): one from ``--before`` (a git ref,
default the merge base with main: the code before this branch; exported to a scratch folder)
and one from this checkout. Round by round, alternating which goes first, each gets one burst
while the other idles: both servers' warm pools are left to settle (no kernel starting), then N
concurrent ``POST /v1/sessions`` each followed at once by ``import pandas as pd; 1+1`` in that
session (each session also stores a marker of its own and checks that it sees no other's). A
503 with ``Retry-After`` is honoured (the create is retried after it); any other failure counts
as an error. Reported per burst: the first, median and last answer (ms from the burst's start),
errors, 503s retried, sessions served from the pool. The sessions are deleted after each burst.

Beside the bursts, on each server once the pool has settled after the last burst:
  pool import   a create from the pool, then the time of its first ``import pandas`` alone;
  cold          a create the pool cannot serve (``limits.pids`` not the default) + ``1+1``.

``--stages``: where a cold start's time goes, measured in isolation with the kernel
environment's python (the same binaries the sandbox runs): interpreter start, ipykernel's
import, pandas' import, and bwrap's namespaces around an interpreter start (user, pid, mount,
net, ipc, uts). The gateway, manager, connection and preamble are the rest of a cold create.

A shared 2-core machine is noisy: compare the two servers of one run, not runs of other days.
Writes the "burst" section of bench/RESULTS.md ("burst-N" for another --n) unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import (
    REAL_KERNEL_PYTHON,
    REPO,
    Stats,
    loadavg,
    ms_since,
    require_kernel_venv,
    run_stoppable,
    write_section,
)
from servers import AS_DEPLOYED, KmServer, before_checkout, git

SECTION = "burst"
FIRST_CELL = "import pandas as pd; 1+1"
MAX_RETRIES = 20


async def one_agent(c: httpx.AsyncClient, t0: int, i: int, tag: str, out: dict[str, Any]) -> None:
    """Create a session (retrying after a 503's Retry-After), run the first cell, check isolation."""
    for _ in range(MAX_RETRIES):
        r = await c.post("/v1/sessions", json={})
        if r.status_code == 503 and "retry-after" in r.headers:
            out["retried"] += 1
            await asyncio.sleep(float(r.headers["retry-after"]))
            continue
        break
    if r.status_code != 201:
        out["errors"].append(f"create: {r.status_code} {r.text[:200]}")
        return
    info = r.json()
    sid = info["session_id"]
    out["sids"].append(sid)
    out["from_pool"] += bool(info.get("from_pool"))
    code = (f"{FIRST_CELL.rsplit(';', 1)[0]}\n__burst_marks = [k for k in globals() if k.startswith('burst_')]\n"
            f"burst_{tag}_{i} = {i}\nlen(__burst_marks) + 2")
    x = await c.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    took = ms_since(t0)
    body = x.json() if x.status_code == 200 else {}
    if body.get("result") != "2":  # 2 + the number of other sessions' markers it sees (none)
        out["errors"].append(f"execute: {x.status_code} {x.text[:300]}")
        return
    out["answers"].append(took)


async def settle(km: KmServer, timeout: float = 300) -> dict[str, Any]:
    """Until the server's pool holds what it aims at (its target after a burst, else its floor)
    and nothing starts (/readyz), then 1 s more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, checks = await km.ready_check()
        pool = checks.get("pool", {})
        want = int(pool.get("target", pool.get("size", 0)))  # the adaptive pool's size now, else the floor
        if int(pool.get("ready", -1)) >= want and pool.get("state") != "refilling":
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    return (await km.readyz()).get("pool", {})


async def burst(c: httpx.AsyncClient, n: int, tag: str) -> dict[str, Any]:
    out: dict[str, Any] = {"answers": [], "errors": [], "sids": [], "retried": 0, "from_pool": 0}
    t0 = time.perf_counter_ns()
    await asyncio.gather(*(one_agent(c, t0, i, tag, out) for i in range(n)))
    out["wall"] = ms_since(t0)
    await asyncio.gather(*(c.delete(f"/v1/sessions/{sid}") for sid in out["sids"]))
    return out


async def pool_import(c: httpx.AsyncClient) -> tuple[float, bool]:
    """(ms of the first `import pandas` in a session from the pool, whether it came from the pool)."""
    r = await c.post("/v1/sessions", json={})
    r.raise_for_status()
    sid = r.json()["session_id"]
    t0 = time.perf_counter_ns()
    x = await c.post(f"/v1/sessions/{sid}/execute", json={"code": "import pandas as pd"})
    took = ms_since(t0)
    assert x.json().get("status") == "ok", x.text
    await c.delete(f"/v1/sessions/{sid}")
    return took, bool(r.json().get("from_pool"))


async def cold(c: httpx.AsyncClient) -> float:
    t0 = time.perf_counter_ns()
    r = await c.post("/v1/sessions", json={"limits": {"pids": 127}})
    r.raise_for_status()
    sid = r.json()["session_id"]
    x = await c.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"})
    took = ms_since(t0)
    assert x.json().get("result") == "2" and not r.json().get("from_pool"), x.text
    await c.delete(f"/v1/sessions/{sid}")
    return took


def _time(cmd: list[str], runs: int) -> float:
    """Median ms of ``cmd`` run to its end."""
    xs = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        subprocess.run(cmd, check=True, capture_output=True)
        xs.append(ms_since(t0))
    return statistics.median(xs)


def stages(runs: int = 5) -> list[tuple[str, float]]:
    """Parts of a cold start measured in isolation (medians, ms)."""
    py = str(REAL_KERNEL_PYTHON)
    base = _time([py, "-I", "-c", "pass"], runs)
    kernel = _time([py, "-I", "-c", "import ipykernel.kernelapp, ipykernel.ipkernel"], runs)
    pandas = _time([py, "-I", "-c", "import pandas"], runs)
    rows = [("python -I start (kernel env)", base),
            ("ipykernel import (kernelapp, ipkernel)", kernel - base),
            ("pandas import (not part of a kernel start; the first cell's)", pandas - base)]
    bwrap = shutil.which("bwrap")
    if bwrap:
        sandboxed = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
                     "--die-with-parent", "--new-session", py, "-I", "-c", "pass"]
        with contextlib.suppress(subprocess.CalledProcessError):
            rows.append(("bwrap namespaces around it (user, pid, mount, net, ipc, uts)",
                         _time(sandboxed, runs) - base))
    return rows


async def run(args: argparse.Namespace) -> int:
    started, load_start = time.monotonic(), loadavg()
    tmp: Path | None = None
    servers: dict[str, KmServer] = {}
    labels = {"after": git("rev-parse", "--short", "HEAD")}
    if not args.no_before:
        tmp, labels["before"], _ = before_checkout(args.before, "km-burst-")
        servers["before"] = KmServer("before", AS_DEPLOYED, checkout=tmp / "before")
    servers["after"] = KmServer("after", {**AS_DEPLOYED, **dict(kv.split("=", 1) for kv in args.env)})
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    extra: dict[str, dict[str, Stats]] = {name: {"pool_import": Stats("pool_import"), "cold": Stats("cold")}
                                          for name in servers}
    pools: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    clients: dict[str, httpx.AsyncClient] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            for name, km in servers.items():
                stack.push_async_callback(km.stop)
                print(f"starting {name} ...", flush=True)
                await asyncio.to_thread(km.start)
                assert km.srv is not None
                clients[name] = await stack.enter_async_context(httpx.AsyncClient(
                    base_url=km.srv.url, timeout=300, limits=httpx.Limits(max_connections=args.n + 8),
                    headers={"Authorization": f"Bearer {km.srv.token}"}))
            names = list(servers)
            for rnd in range(args.rounds):
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    # Every server settled, not only this one: the other's pool, refilling after
                    # its own burst (20 kernels importing pandas), would take the cores from this one.
                    for other in names:
                        if other != name:
                            await settle(servers[other])
                    pools[name].append(await settle(servers[name]))
                    res = await burst(clients[name], args.n, f"r{rnd}")
                    results[name].append(res)
                    a = sorted(res["answers"]) or [float("nan")]
                    print(f"  round {rnd + 1} {name}: first {a[0]:.0f} ms, median {statistics.median(a):.0f}, "
                          f"last {a[-1]:.0f}; errors {len(res['errors'])}, 503s retried {res['retried']}, "
                          f"from pool {res['from_pool']}", flush=True)
                    for e in res["errors"][:3]:
                        print(f"    {e}", flush=True)
            for name in names:
                await settle(servers[name])
                for _ in range(args.singles):
                    took, from_pool = await pool_import(clients[name])
                    extra[name]["pool_import"].samples.append(took)
                    extra[name]["pool_import"].name = "pool_import" + ("" if from_pool else " (not from pool!)")
                    await settle(servers[name])
                    extra[name]["cold"].samples.append(await cold(clients[name]))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = stages() if args.stages else []
    text = report(args, results, extra, pools, labels, rows, time.monotonic() - started, load_start)
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", SECTION if args.n == 20 else f"{SECTION}-{args.n}", text)
    return 0


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]],
           extra: dict[str, dict[str, Stats]], pools: dict[str, list[dict[str, Any]]],
           labels: dict[str, str], stage_rows: list[tuple[str, float]], wall: float, load_start: str) -> str:
    lines = ["| server | round | pool before (ready/floor) | first ms | median ms | last ms | errors | "
             "503 retried | from pool |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, rounds in results.items():
        for i, res in enumerate(rounds):
            a = sorted(res["answers"]) or [float("nan")]
            p = pools[name][i]
            lines.append(f"| {name} ({labels[name]}) | {i + 1} | {p.get('ready')}/{p.get('size')} | {a[0]:.0f} | "
                         f"{statistics.median(a):.0f} | {a[-1]:.0f} | {len(res['errors'])} | {res['retried']} | "
                         f"{res['from_pool']} |")
    singles = [f"| {name} | {s['pool_import'].median:.0f} | {s['cold'].median:.0f} |"
               for name, s in extra.items() if s["cold"].samples]
    text = f"""## Bursts of sessions: {args.n} at once (bench/burst.py)

`.venv/bin/python bench/burst.py --n {args.n} --rounds {args.rounds}`, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}
UTC, wall {wall:.0f} s, load average {load_start} at the start ({loadavg()} at the end): a 2-core
machine shared with other work, so single figures are noisy; the two servers of this run are
what compare. Both servers run with the defaults (bwrap). Each burst: {args.n} concurrent
`POST /v1/sessions` each followed by `{FIRST_CELL}`; ms from the burst's start to each answer.
Round 1 meets each server's pool as it fills after start; later rounds come after a burst.

{chr(10).join(lines)}

| server | first `import pandas` in a session from the pool, ms (median of {args.singles}) | cold create + `1+1` (no pool: pids 127), ms |
|---|---:|---:|
{chr(10).join(singles)}
"""
    if stage_rows:
        text += "\nWhere a cold start's time goes (each part in isolation, median of 5, ms):\n\n| part | ms |\n|---|---:|\n"
        text += "\n".join(f"| {what} | {ms:.0f} |" for what, ms in stage_rows) + "\n"
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="sessions per burst (20, 50)")
    p.add_argument("--rounds", type=int, default=2, help="bursts per server")
    p.add_argument("--singles", type=int, default=3, help="pool-import and cold samples per server")
    p.add_argument("--before", default=None, help="git ref to compare with (default: merge base with main)")
    p.add_argument("--no-before", action="store_true", help="this checkout only")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of this checkout's server only (an experiment; not for the record)")
    p.add_argument("--stages", action="store_true", help="also time a cold start's parts in isolation")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args()
    require_kernel_venv(p)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
