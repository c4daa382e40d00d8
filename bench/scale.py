"""Scale: session creation, throughput, memory per idle session, and growth to hundreds of sessions.

Run:  .venv/bin/python bench/scale.py [--quick] [--no-write]

Everything is measured in one run against real `kernelmode serve` processes (Kernel Gateway +
bubblewrap-sandboxed ipykernels, started with tests.support.server.start_server) and, as the floor,
unsandboxed ipykernels (the kernel-venv's python) driven with jupyter_client:

  1. create   session create until the first execute has run: from the warm pool (waits until
              /readyz shows the pool full, asserts from_pool) and cold (limits.pids=127, which
              bypasses the pool); against the warm execute round trip of `1+1` and a bare
              jupyter_client kernel start until its first execute. Interleaved round-robin.
  2. thruput  N sessions (1, 5, 20) executing `1+1` in a closed loop for a fixed time, aggregate
              executes/s, against N bare ipykernels under the same load; CPU per execute of the
              client, the manager, the gateway and the kernels from /proc.
  3. memory   RSS and PSS (/proc/<pid>/smaps_rollup) of each idle session's process tree (the
              processes of its host uid under the gateway: bwrap x2 + ipykernel) plus the
              gateway's and the manager's growth per kernel, against bare ipykernels alive at
              the same moment (so that shared pages are split alike).
  4. growth   with 1, 50 and 200 live idle sessions (--quick: 1, 10, 25): warm execute latency
              (a few sessions, round-robin), pool and cold create latency, and an execute in
              every live session.
  5. chart    bench/growth.png (matplotlib, run with the kernel-venv's python).

The REST client is a minimal keep-alive HTTP/1.1 client on asyncio streams (one connection per
concurrent caller), so that the client's own CPU, which shares the machine's cores with the
server, stays small. Results go to bench/SCALE.md (unless --no-write); the very last line printed
is a one-line SUMMARY. Everything started is stopped at the end, also on failure or Ctrl-C.
"""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from direct_kernels import BareKernels
from harness import (
    BENCH,
    CONCURRENCY,
    KERNEL_PYTHON,
    Stats,
    loadavg,
    ms_since,
    require_kernel_venv,
    run_stoppable,
    server_machine_info,
    verdict,
)
from servers import KmServer

from tests.support.procfs import (
    CLK_TCK,
    cpu_ticks,
    descendants,
    machine_busy,
    mem_available_mb,
    mem_kb,
    ptable,
    tree_mem,
    uid_of,
)

GOAL_POOL = 3.0  # pool create + first execute <= 3x the warm execute round trip
GOAL_MEM = 1.15  # memory per idle session <= 1.15x a bare ipykernel
GOAL_GROWTH = 1.5  # execute latency with the most sessions <= 1.5x with 1


# -- the server's sessions and processes --------------------------------------------------------------


async def create_many(srv: KmServer, n: int, body: dict[str, Any] | None = None,
                      errors: list[str] | None = None) -> tuple[list[str], Stats]:
    """n sessions, CONCURRENCY at a time, each with its first execute; their create+exec times.

    With ``errors``, a failed create (or first execute) is recorded there instead of raised
    (the session, if created, is deleted) and the others go on."""
    sids: list[str] = []
    lat = Stats("bulk create")
    todo = iter(range(n))

    async def worker() -> None:
        conn = srv.http()
        for _ in todo:
            t0 = time.perf_counter_ns()
            sid = None
            try:
                sid = (await srv.create(body or {}, conn))["session_id"]
                await conn.execute(sid)
            except (RuntimeError, ConnectionError) as e:
                if errors is None:
                    raise
                errors.append(str(e))
                if sid is not None:
                    with contextlib.suppress(RuntimeError, ConnectionError):
                        await srv.delete(sid, conn)
                continue
            sids.append(sid)
            lat.samples.append(ms_since(t0))

    await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, n))))
    return sids, lat


async def timed_create(srv: KmServer, pool: bool, wait: bool = True) -> tuple[float, float, float]:
    """(create + first execute, create, first execute) in ms; the session is deleted after."""
    if wait:
        await srv.wait_pool_full()
    assert srv.ctl is not None
    body: dict[str, Any] = {} if pool else {"limits": {"pids": 127}}  # non-default: no pool
    t0 = time.perf_counter_ns()
    info = await srv.create(body)
    t_create = ms_since(t0)
    await srv.ctl.execute(info["session_id"])
    total = ms_since(t0)
    if bool(info.get("from_pool")) != pool:
        raise RuntimeError(f"expected from_pool={pool}, got {info.get('from_pool')!r}")
    await srv.delete(info["session_id"])
    return total, t_create, total - t_create


def workspace_uid(srv: KmServer, sid: str) -> int:
    assert srv.srv is not None
    db = sqlite3.connect(f"file:{srv.srv.data_dir / 'sessions.sqlite3'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT workspace FROM sessions WHERE session_id=?", (sid,)).fetchone()
    finally:
        db.close()
    if row is None:
        raise RuntimeError(f"session {sid} not in the store")
    return Path(row[0]).stat().st_uid


def session_trees(srv: KmServer, sids: list[str]) -> dict[str, list[int]]:
    """The processes of each session: the gateway's descendants owned by its workspace's uid."""
    table = ptable()
    under = descendants(srv.gateway_pid, table)
    by_uid: dict[int, list[int]] = {}
    for pid in under:
        uid = uid_of(pid)
        if uid is not None:
            by_uid.setdefault(uid, []).append(pid)
    out = {}
    for sid in sids:
        pids = by_uid.get(workspace_uid(srv, sid), [])
        if not pids:
            raise RuntimeError(f"no process found for session {sid}")
        out[sid] = pids
    return out


def gateway_errors(srv: KmServer) -> dict[str, int]:
    """Exception lines in the gateway's log ("zmq.error.ZMQError: ..."), counted."""
    out: dict[str, int] = {}
    if srv.srv is None:
        return out
    with contextlib.suppress(OSError):
        for line in (srv.srv.data_dir / "gateway" / "gateway.log").read_text(errors="replace").splitlines():
            line = line.strip()
            head = line.split(":", 1)[0]
            if head.endswith(("Error", "Exception")) and " " not in head and ":" in line:
                out[line[:200]] = out.get(line[:200], 0) + 1
    return out



# -- 1. create -----------------------------------------------------------------------------------------


async def step_create(a: KmServer, bare: BareKernels, args: argparse.Namespace) -> dict[str, Any]:
    print("\n[1] session create until the first execute can run", flush=True)
    info = await a.create({})
    warm_sid = info["session_id"]
    conn = a.http()
    for _ in range(20):
        await conn.execute(warm_sid)
    names = ("pool", "cold", "bare", "exec")
    st = {n: Stats(n) for n in ("pool", "pool_create", "pool_first", "cold", "cold_create",
                                "cold_first", "bare", "bare_ready", "bare_first", "exec")}

    async def sample(kind: str) -> None:
        if kind in ("pool", "cold"):
            total, create, first = await timed_create(a, kind == "pool")
        elif kind == "bare":
            total, create, first = await bare.cold_start()
        else:
            await a.wait_pool_full()
            for _ in range(args.exec_per_round):
                st["exec"].samples.append(await conn.execute(warm_sid))
            return
        st[kind].samples.append(total)
        st["bare_ready" if kind == "bare" else f"{kind}_create"].samples.append(create)
        st[f"{kind}_first"].samples.append(first)

    for kind in ("pool", "cold", "bare"):  # one warm-up sample each
        await sample(kind)
    for key in st:
        st[key].samples.clear()
    for rnd in range(args.create_rounds):
        k = rnd % len(names)
        for kind in names[k:] + names[:k]:
            await sample(kind)
        print(f"  round {rnd + 1}/{args.create_rounds}: medians pool={st['pool'].median:.1f} "
              f"cold={st['cold'].median:.1f} bare={st['bare'].median:.1f} "
              f"exec={st['exec'].median:.2f} ms", flush=True)
    return {"stats": st, "warm_sid": warm_sid}


# -- 2. throughput -------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    path: str
    n: int
    duration: float
    lat: Stats
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU ms per execute, by process group
    busy: float = 0.0  # machine CPU utilisation in the window (fraction of all CPUs)

    @property
    def rate(self) -> float:
        return self.lat.n / self.duration


async def closed_loop(fns: list[Callable[[], Awaitable[float]]], warmup: float, duration: float,
                      groups: Callable[[], dict[str, list[int]]]) -> tuple[Stats, dict[str, float], float]:
    """Run every fn in its own loop; count what completes inside [warmup, warmup + duration]."""
    lat = Stats("latency")
    loop_start = time.perf_counter()
    t_from, t_to = loop_start + warmup, loop_start + warmup + duration
    snaps: list[tuple[float, dict[str, int], tuple[int, int]]] = []

    def snap() -> None:
        pids = groups()
        ticks = {g: cpu_ticks(p) for g, p in pids.items()}
        t = os.times()
        ticks["client"] = round((t.user + t.system) * CLK_TCK)
        snaps.append((time.perf_counter(), ticks, machine_busy()))

    async def sampler() -> None:
        await asyncio.sleep(max(t_from - time.perf_counter(), 0))
        snap()
        await asyncio.sleep(max(t_to - time.perf_counter(), 0))
        snap()

    async def worker(fn: Callable[[], Awaitable[float]]) -> None:
        while time.perf_counter() < t_to:
            ms = await fn()
            if t_from <= time.perf_counter() <= t_to:
                lat.samples.append(ms)

    await asyncio.gather(sampler(), *(worker(fn) for fn in fns))
    (_, c0, b0), (_, c1, b1) = snaps
    n = max(lat.n, 1)
    cpu = {g: (c1[g] - c0[g]) * 1000 / CLK_TCK / n for g in c0}
    busy = (b1[0] - b0[0]) / max(b1[1] - b0[1], 1)
    return lat, cpu, busy


async def step_throughput(a: KmServer, bare: BareKernels, warm_sid: str,
                          args: argparse.Namespace) -> dict[int, dict[str, LoadResult]]:
    nmax = max(args.load_n)
    print(f"\n[2] throughput: {nmax} sessions and {nmax} bare kernels ...", flush=True)
    more, _ = await create_many(a, nmax - 1)
    sids = [warm_sid, *more]
    conns = [a.http() for _ in sids]
    kernels = await bare.start_many(nmax)
    bare_pids = [dk.pid for dk in kernels]
    mgr, gw = a.manager_pid, a.gateway_pid

    def rest_groups() -> dict[str, list[int]]:
        return {"manager": [mgr], "gateway": [gw], "kernels": descendants(gw)}

    def direct_groups() -> dict[str, list[int]]:
        return {"manager": [], "gateway": [], "kernels": bare_pids}

    results: dict[int, dict[str, LoadResult]] = {}
    half = args.load_seconds / 2
    for n in args.load_n:
        fns: dict[str, list[Callable[[], Awaitable[float]]]] = {
            "rest": [(lambda c=conns[i], s=sids[i]: c.execute(s)) for i in range(n)],
            "direct": [kernels[i].roundtrip for i in range(n)],
        }
        groups = {"rest": rest_groups, "direct": direct_groups}
        acc = {p: LoadResult(p, n, 0.0, Stats(f"{p}{n}")) for p in fns}
        cpu_sum: dict[str, dict[str, float]] = {p: {} for p in fns}
        for h, order in enumerate((("rest", "direct"), ("direct", "rest"))):
            for p in order:
                lat, cpu, busy = await closed_loop(fns[p], args.load_warmup if h == 0 else 0.2,
                                                   half, groups[p])
                r = acc[p]
                r.lat.samples += lat.samples
                r.duration += half
                r.busy += busy / 2
                for g, v in cpu.items():  # weighted by executes
                    cpu_sum[p][g] = cpu_sum[p].get(g, 0.0) + v * lat.n
        for p in fns:
            acc[p].cpu_ms = {g: v / max(acc[p].lat.n, 1) for g, v in cpu_sum[p].items()}
        results[n] = acc
        r, d = acc["rest"], acc["direct"]
        print(f"  N={n:>2}: rest {r.rate:7.1f}/s (median {r.lat.median:.2f} ms)   "
              f"direct {d.rate:7.1f}/s (median {d.lat.median:.2f} ms)   "
              f"rest/direct {r.rate / d.rate:.2f}x", flush=True)
    await bare.stop(kernels)
    return results


# -- 3 + 4. memory and growth --------------------------------------------------------------------------


@dataclass
class Level:
    live: int
    exec: Stats
    pool: Stats
    cold: Stats
    answered: int
    gateway_rss_kb: int
    manager_rss_kb: int
    gateway_pss_kb: int
    manager_pss_kb: int
    mem_available_mb: float
    requested: int = 0
    fill: Stats | None = None
    fill_seconds: float = 0.0
    fill_errors: list[str] = field(default_factory=list)
    create_errors: list[str] = field(default_factory=list)
    pool_full: bool = True
    gateway_kernels: int = 0  # kernel process trees under the gateway (children of its pid)
    pool_ready: int = 0


def proc_mem(b: KmServer) -> dict[str, tuple[int, int]]:
    return {"gateway": mem_kb(b.gateway_pid), "manager": mem_kb(b.manager_pid)}


async def measure_memory(b: KmServer, bare: BareKernels, sids: list[str], base: dict[str, tuple[int, int]],
                         k: int) -> dict[str, Any]:
    print(f"  memory: {k} idle sessions against {k} bare ipykernels alive at the same time", flush=True)
    kernels = await bare.start_many(k)
    try:
        await b.wait_pool_full(settle=1.0)
        trees = session_trees(b, sids[:k])
        rows = {"rss": Stats("session rss"), "pss": Stats("session pss"),
                "bwrap_rss": Stats("bwrap rss"), "bwrap_pss": Stats("bwrap pss"),
                "bare_rss": Stats("bare rss"), "bare_pss": Stats("bare pss"), "procs": Stats("procs")}
        for pids in trees.values():
            rss, pss = tree_mem(pids)
            kernel_pid = max(pids, key=lambda p: mem_kb(p)[0])  # the ipykernel, the rest is bwrap
            krss, kpss = mem_kb(kernel_pid)
            rows["rss"].samples.append(rss / 1024)
            rows["pss"].samples.append(pss / 1024)
            rows["bwrap_rss"].samples.append((rss - krss) / 1024)
            rows["bwrap_pss"].samples.append((pss - kpss) / 1024)
            rows["procs"].samples.append(len(pids))
        for dk in kernels:
            rss, pss = mem_kb(dk.pid)
            rows["bare_rss"].samples.append(rss / 1024)
            rows["bare_pss"].samples.append(pss / 1024)
        now = proc_mem(b)
    finally:
        await bare.stop(kernels)
    growth = {name: (now[name][0] - base[name][0]) / 1024 / k for name in now}
    return {"k": k, "rows": rows, "growth": growth}


async def measure_level(b: KmServer, sids: list[str], args: argparse.Namespace) -> Level:
    live = len(sids)
    print(f"  {live} live sessions: checking all, then execute and create latency ...", flush=True)
    pool_full = await b.wait_pool_full(settle=1.0, timeout=30, strict=False)
    if not pool_full:
        print("    the warm pool does not fill up: pool create samples are skipped", flush=True)
    mem = proc_mem(b)
    avail = mem_available_mb()
    table = ptable()
    gw = b.gateway_pid
    gateway_kernels = sum(1 for ppid in table.values() if ppid == gw)
    pool_ready = int(b.ready.get("pool", {}).get("ready", 0))
    # every live session answers an execute
    todo = iter(sids)
    answered = 0

    async def check() -> None:
        nonlocal answered
        conn = b.http()
        for sid in todo:
            with contextlib.suppress(RuntimeError, ConnectionError):
                await conn.execute(sid)
                answered += 1

    await asyncio.gather(*(check() for _ in range(CONCURRENCY)))
    probes = sids[:min(args.probes, live)]
    conns = {sid: b.http() for sid in probes}
    for sid in probes:
        for _ in range(5):
            await conns[sid].execute(sid)
    exec_st, pool_st, cold_st = Stats("exec"), Stats("pool"), Stats("cold")
    create_errors: list[str] = []
    rounds = 2 * args.growth_creates
    per_batch = -(-args.growth_execs // (rounds + 1))
    i = 0
    for rnd in range(rounds + 1):
        if pool_full:
            await b.wait_pool_full()
        for _ in range(per_batch):
            sid = probes[i % len(probes)]
            i += 1
            exec_st.samples.append(await conns[sid].execute(sid))
        if rnd < rounds:
            pool = rnd % 2 == 0
            if pool and not pool_full:
                continue
            try:
                (pool_st if pool else cold_st).samples.append((await timed_create(b, pool, pool_full))[0])
            except (RuntimeError, ConnectionError) as e:
                create_errors.append(str(e))
                # a kernel launched by the failed request may still be booting: let it settle
                # before the next execute batch
                await asyncio.sleep(3)
    lvl = Level(live=live, exec=exec_st, pool=pool_st, cold=cold_st, answered=answered,
                gateway_rss_kb=mem["gateway"][0], manager_rss_kb=mem["manager"][0],
                gateway_pss_kb=mem["gateway"][1], manager_pss_kb=mem["manager"][1],
                mem_available_mb=avail, create_errors=create_errors, pool_full=pool_full,
                gateway_kernels=gateway_kernels, pool_ready=pool_ready)
    print(f"    answered {answered}/{live}; exec median {exec_st.median:.2f} ms p95 "
          f"{exec_st.pct(95):.2f}; create pool {med(pool_st, 1)} ms, cold {med(cold_st, 1)} ms "
          f"({len(create_errors)} failed); "
          f"gateway {mem['gateway'][0] / 1024:.0f} MB, manager {mem['manager'][0] / 1024:.0f} MB; "
          f"{gateway_kernels} kernels under the gateway ({live} sessions + {pool_ready} pool)",
          flush=True)
    return lvl


async def step_growth(b: KmServer, bare: BareKernels, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n[3+4] memory per idle session; growth to {max(args.levels)} live sessions", flush=True)
    await b.wait_pool_full()
    # warm-up: the first session's one-off costs (lazy imports, caches) are not per kernel
    info = await b.create({})
    await b.ctl.execute(info["session_id"])  # type: ignore[union-attr]
    await b.delete(info["session_id"])
    await b.wait_pool_full(settle=1.0)
    base = proc_mem(b)
    sids: list[str] = []
    levels: list[Level] = []
    memory: dict[str, Any] = {}
    for target in sorted({*args.levels, args.mem_k}):
        t0 = time.monotonic()
        errors: list[str] = []
        more, fill = await create_many(b, target - len(sids), errors=errors)
        sids += more
        fill_s = time.monotonic() - t0
        print(f"  {len(sids)} live sessions ({len(more)} created in {fill_s:.1f} s, {CONCURRENCY} at a time"
              + (f"; {len(errors)} creates FAILED, e.g. {errors[0][:300]}" if errors else "") + ")",
              flush=True)
        b.remember_processes()
        if target == args.mem_k:
            memory = await measure_memory(b, bare, sids, base, len(sids))
        if target in args.levels:
            lvl = await measure_level(b, sids, args)
            lvl.requested, lvl.fill, lvl.fill_seconds, lvl.fill_errors = target, fill, fill_s, errors
            levels.append(lvl)
    return {"base": base, "levels": levels, "memory": memory, "gateway_errors": gateway_errors(b)}


# -- reporting -----------------------------------------------------------------------------------------


def fmt(s: Stats, d: int = 2) -> str:
    if not s.n:
        return "- | - | - | 0"
    return f"{s.median:.{d}f} | {s.pct(95):.{d}f} | {s.pct(99):.{d}f} | {s.n}"


def med(s: Stats, d: int = 2) -> str:
    return f"{s.median:.{d}f}" if s.n else "-"


def ratios(res: dict[str, Any]) -> dict[str, float]:
    st = res["create"]["stats"]
    nmax = max(res["load"])
    lv = res["growth"]["levels"]
    return {
        "pool_create/exec": st["pool"].median / st["exec"].median,
        "cold_create/exec": st["cold"].median / st["exec"].median,
        f"throughput{nmax}/direct": res["load"][nmax]["rest"].rate / res["load"][nmax]["direct"].rate,
        "idle_mem/bare": res["mem_total_pss"] / res["memory"]["rows"]["bare_pss"].median,
        "idle_rss/bare": res["mem_total_rss"] / res["memory"]["rows"]["bare_rss"].median,
        f"exec{lv[-1].live}/exec{lv[0].live}": lv[-1].exec.median / lv[0].exec.median,
    }


def summary_line(res: dict[str, Any]) -> str:
    r = ratios(res)
    keys = ("pool_create/exec", next(k for k in r if k.startswith("throughput")), "idle_mem/bare",
            next(k for k in r if k.startswith("exec")))
    return "SUMMARY " + " ".join(f"{k}={r[k]:.2f}x" for k in keys) + \
        f" (idle_rss/bare={r['idle_rss/bare']:.2f}x cold_create/exec={r['cold_create/exec']:.1f}x)"


def compute_memory_totals(res: dict[str, Any]) -> None:
    """Per-session totals: the session's tree plus the gateway's and manager's growth per kernel,
    taken at the largest level (K sessions vs 0, divided by K)."""
    top = res["growth"]["levels"][-1]
    base = res["growth"]["base"]
    res["growth_per_kernel"] = {
        "gateway": (top.gateway_rss_kb - base["gateway"][0]) / 1024 / top.live,
        "manager": (top.manager_rss_kb - base["manager"][0]) / 1024 / top.live,
    }
    rows = res["memory"]["rows"]
    extra = sum(res["growth_per_kernel"].values())
    res["mem_total_rss"] = rows["rss"].median + extra
    res["mem_total_pss"] = rows["pss"].median + extra


def report_text(res: dict[str, Any], args: argparse.Namespace, markdown: bool) -> str:
    st = res["create"]["stats"]
    r = ratios(res)
    head = "| what | median | p95 | p99 | N |\n|---|---|---|---|---|"
    create_rows = [
        ("warm execute round trip of `1+1` (REST)", "exec"),
        ("**pool**: POST /v1/sessions + first execute", "pool"),
        ("&nbsp;&nbsp;pool: POST /v1/sessions alone", "pool_create"),
        ("&nbsp;&nbsp;pool: the first execute", "pool_first"),
        ("**cold** (limits.pids=127: no pool): create + first execute", "cold"),
        ("&nbsp;&nbsp;cold: POST /v1/sessions alone", "cold_create"),
        ("&nbsp;&nbsp;cold: the first execute", "cold_first"),
        ("**bare** jupyter_client kernel: start + first execute (unsandboxed floor)", "bare"),
        ("&nbsp;&nbsp;bare: start until kernel_info answers", "bare_ready"),
        ("&nbsp;&nbsp;bare: the first execute", "bare_first"),
    ]
    t1 = "\n".join(f"| {label} | {fmt(st[key])} |" for label, key in create_rows)
    load_rows = []
    for n, pr in res["load"].items():
        for p in ("direct", "rest"):
            x = pr[p]
            cpu = x.cpu_ms
            load_rows.append(
                f"| {n} | {p} | **{x.rate:.0f}** | {fmt(x.lat)} | {cpu['client']:.2f} | "
                + (f"{cpu['manager']:.2f} | {cpu['gateway']:.2f} | " if p == "rest" else "- | - | ")
                + f"{cpu['kernels']:.2f} | {x.busy * 100:.0f}% |")
        load_rows.append(f"| {n} | rest/direct | **{pr['rest'].rate / pr['direct'].rate:.2f}x** "
                         "| | | | | | | | | |")
    t2 = "\n".join(load_rows)
    mem = res["memory"]
    rows = mem["rows"]
    g = res["growth_per_kernel"]
    gk = mem["growth"]
    t3 = "\n".join([
        f"| session process tree (bwrap x2 + ipykernel) | {rows['rss'].median:.1f} | {rows['pss'].median:.1f} | "
        f"p95 {rows['rss'].pct(95):.1f} / {rows['pss'].pct(95):.1f}, N={rows['rss'].n} |",
        f"| &nbsp;&nbsp;of which the two bwrap processes | {rows['bwrap_rss'].median:.1f} | "
        f"{rows['bwrap_pss'].median:.1f} | |",
        f"| gateway growth per kernel ({res['growth']['levels'][-1].live} sessions vs 0) | {g['gateway']:.2f} | "
        f"{g['gateway']:.2f} | at {mem['k']} sessions: {gk['gateway']:.2f} |",
        f"| manager growth per kernel ({res['growth']['levels'][-1].live} sessions vs 0) | {g['manager']:.2f} | "
        f"{g['manager']:.2f} | at {mem['k']} sessions: {gk['manager']:.2f} |",
        f"| **total per idle session** | **{res['mem_total_rss']:.1f}** | **{res['mem_total_pss']:.1f}** | |",
        f"| bare ipykernel (jupyter_client, unsandboxed) | {rows['bare_rss'].median:.1f} | "
        f"{rows['bare_pss'].median:.1f} | p95 {rows['bare_rss'].pct(95):.1f} / {rows['bare_pss'].pct(95):.1f}, "
        f"N={rows['bare_rss'].n} |",
        f"| **session / bare** | **{r['idle_rss/bare']:.2f}x** | **{r['idle_mem/bare']:.2f}x** | |",
    ])
    lv = res["growth"]["levels"]
    t4 = "\n".join(
        f"| {x.requested} | **{x.live}** | {fmt(x.exec)} | {x.exec.median / lv[0].exec.median:.2f}x | "
        f"{med(x.pool, 1)} ({x.pool.n}) | {med(x.cold, 1)} ({x.cold.n}) | "
        f"{len(x.fill_errors) + len(x.create_errors)} | {x.gateway_kernels} ({x.live} + {x.pool_ready}) | "
        f"{x.answered}/{x.live} | "
        f"{x.gateway_rss_kb / 1024:.0f} | {x.manager_rss_kb / 1024:.0f} | {x.mem_available_mb / 1024:.1f} |"
        for x in lv)
    fill = "; ".join(f"to {x.live}: {len(x.fill.samples) if x.fill else 0} in {x.fill_seconds:.1f} s "
                     f"(median {med(x.fill, 0) if x.fill else '-'} ms each)" for x in lv)
    failures = [e for x in lv for e in x.fill_errors + x.create_errors]
    gw_errors = res["growth"].get("gateway_errors", {})
    fail_text = ""
    if failures:
        kinds: dict[str, int] = {}
        for e in failures:
            kinds[e[:160]] = kinds.get(e[:160], 0) + 1
        fail_text = ("\n\n**Failed creates: " + str(len(failures)) + "**, by message (first 160 characters):\n\n"
                     + "\n".join(f"- {n} x `{m}`" for m, n in sorted(kinds.items(), key=lambda kv: -kv[1])))
        if gw_errors:
            fail_text += ("\n\nExceptions in the gateway's log:\n\n"
                          + "\n".join(f"- {n} x `{m}`" for m, n in sorted(gw_errors.items(), key=lambda kv: -kv[1])))
        if any("ZMQError: Too many open files" in m for m in gw_errors):
            fail_text += (
                "\n\nWhat limits it: `Too many open files` from `zmq` is libzmq's per-context socket "
                "limit (`ZMQ_MAX_SOCKETS`, 1023 by default), not the process's file limit. The gateway's "
                "`MultiKernelManager` shares one ZMQ context among all kernels (`shared_context = True`) "
                "and holds about 6 sockets per kernel (shell, iopub, stdin, control for the websocket, "
                "plus its own control socket and the like), so it runs out near 1023 / 6 = 170 kernels, "
                "pool included; the pool refill and every later create then fail. Raising the context's "
                "`zmq.MAX_SOCKETS` before the gateway creates its first socket, or "
                "`c.MultiKernelManager.shared_context = False` (one context, and one ZMQ I/O thread, per "
                "kernel), lifts it.")
    nmax = max(res["load"])
    pool_ok = r["pool_create/exec"] <= GOAL_POOL
    mem_ok = r["idle_mem/bare"] <= GOAL_MEM
    grow_key = f"exec{lv[-1].live}/exec{lv[0].live}"
    grow_ok = r[grow_key] <= GOAL_GROWTH
    all_answered = all(x.answered == x.live for x in lv)
    reached = all(x.live == x.requested for x in lv)
    goals = "\n".join([
        f"- pool create + first execute <= {GOAL_POOL:g}x the warm execute round trip: "
        f"{verdict(pool_ok)} ({r['pool_create/exec']:.2f}x: {st['pool'].median:.1f} ms vs "
        f"{st['exec'].median:.2f} ms; cold: {r['cold_create/exec']:.1f}x, bare kernel start: "
        f"{st['bare'].median / st['exec'].median:.1f}x)",
        f"- throughput with {nmax} sessions vs {nmax} bare kernels (no goal set): "
        f"{r[f'throughput{nmax}/direct']:.2f}x",
        f"- memory per idle session <= {GOAL_MEM:g}x a bare ipykernel: {verdict(mem_ok)} "
        f"(PSS {r['idle_mem/bare']:.2f}x, RSS {r['idle_rss/bare']:.2f}x)",
        f"- execute latency with {lv[-1].live} live sessions <= {GOAL_GROWTH:g}x with 1: "
        f"{verdict(grow_ok)} ({r[grow_key]:.2f}x: {lv[-1].exec.median:.2f} ms vs {lv[0].exec.median:.2f} ms)",
        f"- every requested session is created: {verdict(reached)} "
        f"({', '.join(f'{x.live}/{x.requested}' for x in lv)})",
        f"- every live session answers an execute: {verdict(all_answered)} "
        f"({', '.join(f'{x.answered}/{x.live}' for x in lv)})",
    ])
    if not markdown:
        return goals.replace("**", "")
    machine = "\n".join(f"| {k} | {v} |" for k, v in res["machine"].items())
    return f"""# Scale: session creation, throughput, memory, growth

Generated by `{' '.join(['bench/scale.py', *sys.argv[1:]])}` on {res['machine']['date']}; wall time
{res['wall']:.0f} s. All latencies in ms, memory in MB (MiB); percentiles are linear interpolation
between closest ranks. Companion of [RESULTS.md](RESULTS.md) (the warm round trip in detail).

## Goals

{goals}

`{summary_line(res)}`

## 1. Session create until the first execute can run

{head}
{t1}

Server: `kernelmode serve --sandbox bwrap`, warm pool of {res['pool_size']} (the default). Each
sample is `POST /v1/sessions` followed by `POST /v1/sessions/{{id}}/execute {{"code": "1+1"}}`
on the same keep-alive connection, timed from before the create request until the execute's
response (`result == '2'`) is read; the session is then deleted (not timed). Before every
create sample the benchmark waits until `/readyz` shows the pool full (`checks.pool.ready ==
size`) plus 0.3 s, so no kernel is starting in the background when the sample begins (the
refill that taking a pool kernel triggers does run during the first execute, as it would in
production). **pool** sessions use the default limits and must say `from_pool: true`; **cold**
sessions ask for `limits.pids = 127`, which a pool kernel cannot serve, so a sandboxed kernel is
started, connected and given its tools preamble inside the request (`from_pool: false`).
**exec** is the warm round trip of `1+1` in an already used session, through the same client.
**bare** is the floor for a cold start: `AsyncKernelManager.start_kernel()` of an unsandboxed
ipykernel (kernel-venv python, ipc transport, HOME on tmpfs), `wait_for_ready()`, then one
execute until execute_reply + idle; no gateway, no sandbox, no HTTP. The four kinds run
interleaved round-robin, {args.create_rounds} rounds (order rotated each round,
{args.exec_per_round} exec samples per round, one warm-up sample of each kind first).

## 2. Throughput: N sessions executing `1+1` in a closed loop

| N | path | executes/s | latency median | p95 | p99 | N executes | CPU ms/exec client | manager | gateway | kernels | machine busy |
|---|---|---|---|---|---|---|---|---|---|---|---|
{t2}

Each of N callers loops: send `1+1`, wait for the complete answer, send again. **rest**: N
sessions of one server, one keep-alive connection each (the lean asyncio HTTP client of this
script). **direct**: N bare ipykernels, one jupyter_client `AsyncKernelClient` each, until
execute_reply + idle. Both run in this benchmark process on the same event loop. Executes that
complete inside the window count; {args.load_seconds:g} s per path and N, split in two halves
(rest then direct, then direct then rest), after {args.load_warmup:g} s of warm-up. CPU ms per
execute comes from `/proc/<pid>/stat` (utime + stime, {CLK_TCK} Hz ticks) of the benchmark
process (client), the manager, the gateway and the kernels' process trees during the window;
"machine busy" is the share of all {os.cpu_count()} CPUs in use (/proc/stat). On this machine the
client, the manager, the gateway and the kernels share 2 cores, so throughput is bounded by the
total CPU per execute: executes/s ~= {os.cpu_count()} x 1000 / (sum of the CPU columns).

## 3. Memory per idle session

| | RSS MB | PSS MB | |
|---|---|---|---|
{t3}

{mem['k']} sessions (each created and given one `1+1`, then idle) and {mem['k']} bare ipykernels
(jupyter_client, each given one `1+1`) alive at the same moment, so that pages shared between
kernels (the Python binary, libraries, the kernel-venv's files) are split across the same set of
processes in PSS. A session's processes are the gateway's descendants owned by its host uid (the
owner of its workspace `data_dir/workspaces/<kernel_id>`, found through the session store): the
outer bwrap (launcher after exec), the inner bwrap (the sandbox's pid 1) and the ipykernel. RSS
and PSS are summed from `/proc/<pid>/smaps_rollup`. The gateway's and the manager's growth per
kernel is their RSS with {res['growth']['levels'][-1].live} live sessions minus their RSS with 0
(after one warm-up session, the {res['pool_size']} pool kernels present in both), divided by
{res['growth']['levels'][-1].live}; it is private heap, so it is added as is to both RSS and
PSS. The bare kernel's jupyter_client (in this process) is not counted, as the manager's growth
is. The sandbox's /tmp is a tmpfs: files written there (IPython's history database) are memory
too, charged to the session's cgroup but not in RSS; likewise the bare kernel's HOME is on
/dev/shm.

## 4. Growth: live idle sessions

| requested | live sessions | exec median | p95 | p99 | N | exec / exec at first level | pool create + exec (N) | cold create + exec (N) | failed creates | kernels under the gateway (sessions + pool) | answered | gateway RSS MB | manager RSS MB | MemAvailable GiB |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{t4}{fail_text}

![latency against live sessions](growth.png)

One server with `max_sessions` raised ({args.max_sessions}) and the default pool of
{res['pool_size']}. Sessions are created {CONCURRENCY} at a time, each given one `1+1` ({fill}),
and then left idle. At each level: wait until the pool is full and 1 s more; record the gateway's
and manager's memory; execute `1+1` in **every** live session ({CONCURRENCY} at a time; "answered"
counts the correct answers); then {args.growth_execs} warm executes round-robin over the first
{args.probes} sessions (or fewer), in batches interleaved with {args.growth_creates} pool and
{args.growth_creates} cold create samples (create + first execute, deleted after, each after the
pool is full again; after a failed create, 3 s of rest). The create figures are with the pool
full (**pool**) and with a non-default limit (**cold**: a kernel started inside the request).
"Kernels under the gateway" counts the gateway's child processes (one outer bwrap per kernel)
against the live sessions plus the pool kernels ready: more means kernels that belong to neither.

## Machine

| | |
|---|---|
{machine}
"""


def write_chart(res: dict[str, Any], tmp: Path, out: Path) -> bool:
    data = {
        "live": [x.live for x in res["growth"]["levels"]],
        "exec_median": [x.exec.median for x in res["growth"]["levels"]],
        "exec_p95": [x.exec.pct(95) for x in res["growth"]["levels"]],
        "create_pool_median": [x.pool.median if x.pool.n else None for x in res["growth"]["levels"]],
        "create_cold_median": [x.cold.median if x.cold.n else None for x in res["growth"]["levels"]],
        "title": f"kernelmode on {os.cpu_count()} CPUs: latency against live idle sessions",
    }
    src = tmp / "growth.json"
    src.write_text(json.dumps(data))
    mpl = tmp / "mpl"
    mpl.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MPLCONFIGDIR": str(mpl),
           "HOME": str(mpl), "MPLBACKEND": "Agg"}
    p = subprocess.run([str(KERNEL_PYTHON), str(BENCH / "plot_growth.py"), str(src), str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        print(f"chart failed: {p.stderr[-2000:]}", file=sys.stderr)
        return False
    return True


# -- main ----------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kmscale-", dir="/tmp"))
    bare = BareKernels(tmp)
    res: dict[str, Any] = {}
    steps: dict[str, float] = {}
    res["steps"] = steps
    mark = started

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        steps[name] = now - mark
        mark = now

    nmax = max(args.load_n)
    a = KmServer("create+load", {"KERNELMODE_SESSIONS__MAX_SESSIONS": str(nmax + 10)})
    b = KmServer("growth", {"KERNELMODE_SESSIONS__MAX_SESSIONS": str(args.max_sessions)})
    chart_ok = False
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(bare.stop)
        stack.push_async_callback(a.stop)
        stack.push_async_callback(b.stop)
        try:
            print("starting kernelmode serve (create + throughput) ...", flush=True)
            a.start()
            await a.wait_pool_full()
            res["pool_size"] = a.pool_size
            ready = dict(a.ready)
            lap("start")
            res["create"] = await step_create(a, bare, args)
            lap("create")
            res["load"] = await step_throughput(a, bare, res["create"]["warm_sid"], args)
            lap("throughput")
            print("stopping it ...", flush=True)
            await a.stop()
            print("starting kernelmode serve (memory + growth) ...", flush=True)
            b.start()
            lap("stop + start")
            g = await step_growth(b, bare, args)
            lap("memory + growth")
            res["growth"] = g
            res["memory"] = g["memory"]
            print(f"stopping it ({len(b.remember_processes())} processes) ...", flush=True)
            await b.stop()
            lap("stop")
        except Exception:  # an error, not Ctrl-C: keep the servers' logs for a look
            a.keep_logs = b.keep_logs = True
            raise
        compute_memory_totals(res)
        res["machine"] = server_machine_info(ready, load_start)
        res["wall"] = time.monotonic() - started
        if not args.no_write:
            chart_ok = write_chart(res, tmp, BENCH / "growth.png")
    print()
    print(report_text(res, args, markdown=False))
    if not args.no_write:
        (BENCH / "SCALE.md").write_text(report_text(res, args, markdown=True))
        print(f"\nwrote bench/SCALE.md{' and bench/growth.png' if chart_ok else ''}")
    print(f"wall time {res['wall']:.0f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in steps.items()) + ")")
    print(summary_line(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer samples, 2 s load windows, growth to 25 sessions (about a minute)")
    p.add_argument("--no-write", action="store_true", help="do not write bench/SCALE.md and growth.png")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="live-session levels of the growth step (default 1,50,200; --quick 1,10,25)")
    args = p.parse_args()
    q = args.quick
    args.levels = sorted(set(args.levels or ([1, 10, 25] if q else [1, 50, 200])))
    args.create_rounds = 4 if q else 20
    args.exec_per_round = 10
    args.load_n = [1, 5, 20]
    args.load_seconds = 2.0 if q else 5.0
    args.load_warmup = 0.3 if q else 0.5
    args.mem_k = 5 if q else 10
    args.probes = 5
    args.growth_execs = 40 if q else 200
    args.growth_creates = 1 if q else 5
    args.max_sessions = max(args.levels) + 20
    if args.levels[0] < 1:
        p.error("--levels must be >= 1")
    require_kernel_venv(p)

    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
