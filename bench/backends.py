"""Sandbox backends side by side: bubblewrap vs Docker, session creation, warm execute, idle memory.

Run:  .venv/bin/python bench/backends.py [--quick] [--no-write]

In one run, real `kernelmode serve` processes (tests.support.server.start_server) are started two at a
time, one per sandbox backend (env KERNELMODE_SANDBOX__BACKEND=bwrap and =docker, and
`--sandbox`), and the two backends are measured alternately (round-robin, the order rotated every
round) so that noise on the machine hits both alike:

  phase 1  a pair with KERNELMODE_SESSIONS__POOL_SIZE=0, so that every create is cold:
    cold     POST /v1/sessions until the first execute of `1+1` has answered (the session is
             deleted after each sample), beside a bare jupyter_client ipykernel start until its
             first execute (the unsandboxed floor); where the time goes, from process start
             times and the engine's container timestamps;
    exec     the warm execute round trip of `1+1` in one session per backend, beside the direct
             jupyter_client -> ipykernel round trip (bench/harness.py's DirectKernel, the floor);
    memory   k idle sessions per backend alive at the same time: the memory cgroup of each
             sandbox (anon rss, page cache) and the PSS/RSS of its processes, with the host-side
             helpers of a Docker kernel (its launcher and containerd-shim) and the engine
             daemons' growth.
  phase 2  a pair with the default warm pool (2):
    pool     create from the warm pool + first execute; before every sample both servers' pools
             are full again (polled on /readyz) and idle, so no refill runs during a sample.

Needs a usable Docker engine and the kernel image (`make docker-setup`): without them it says so,
prints a SUMMARY line saying docker is unavailable, and exits 0. Everything started is stopped at
the end, also on failure or Ctrl-C/SIGTERM. Results go to bench/BACKENDS.md (unless --no-write);
the very last line printed is a one-line SUMMARY.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from direct_kernels import BareKernels, DirectKernel
from harness import (
    BENCH,
    Stats,
    interleave,
    loadavg,
    machine_info,
    ms_since,
    require_kernel_venv,
    run_stoppable,
    version,
)
from servers import KmServer

from kernelmode.config import SandboxSettings
from kernelmode.sandbox.docker_engine import container_name, engine_status, server_id
from tests.support.procfs import CLK_TCK, mem_kb, ptable, stat, tree_mem

BACKENDS = ("bwrap", "docker")
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")  # cgroup v1; v2 handled below
SETTLE = 0.3  # s of quiet after a delete or a pool refill, before the next sample


def docker_image() -> str:
    return os.environ.get("KERNELMODE_SANDBOX__DOCKER_IMAGE") or str(
        SandboxSettings.model_fields["docker_image"].default)


def boot_seconds_of(pid: int) -> float | None:
    """A process's start time in CLOCK_BOOTTIME seconds (10 ms resolution), None when gone."""
    st = stat(pid)
    return None if st is None else st[1] / CLK_TCK


def docker_ts(s: str) -> float:
    """An engine timestamp ('2026-11-22T12:31:02.123456789Z') as Unix time."""
    s = s.rstrip("Z")
    base, _, frac = s.partition(".")
    t = dt.datetime.fromisoformat(base).replace(tzinfo=dt.timezone.utc).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


class Backend(KmServer):
    """`kernelmode serve` with one sandbox backend, and its kernels' processes and cgroups."""

    def __init__(self, backend: str, pool_size: int) -> None:
        super().__init__(f"{backend} pool={pool_size}", {
            "KERNELMODE_SANDBOX__BACKEND": backend,
            "KERNELMODE_SESSIONS__POOL_SIZE": str(pool_size),
        }, backend=backend)
        self._server_id: str | None = None
        self.docker: Any = None  # the benchmark's own Docker SDK client (inspect only)

    def start(self) -> float:
        took = super().start()
        assert self.srv is not None
        self._server_id = server_id(self.srv.data_dir)
        if self.backend == "docker":
            import docker

            self.docker = docker.from_env(timeout=60)
        return took

    async def stop(self, timeout: float = 180) -> None:
        try:
            await super().stop(timeout)
        finally:
            # Containers of this server the server itself did not remove (it was killed, say).
            if self.docker is not None and self._server_id is not None:
                with contextlib.suppress(Exception):
                    for c in self.docker.containers.list(
                            all=True, filters={"label": f"kernelmode.server={self._server_id}"}):
                        with contextlib.suppress(Exception):
                            c.remove(force=True)
                with contextlib.suppress(Exception):
                    self.docker.close()
                self.docker = None

    # -- one kernel's processes ---------------------------------------------------------------------

    def spawned(self, kernel_id: str) -> int | None:
        """The gateway's child that runs this kernel (bwrap: the launcher exec'd into bwrap;
        docker: the launcher that drives the container)."""
        gw = self.gateway_pid
        for pid, ppid in ptable().items():
            if ppid == gw:
                with contextlib.suppress(OSError):
                    if kernel_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return pid
        return None

    def container(self, kernel_id: str) -> Any:
        return self.docker.containers.get(container_name(kernel_id))

    def cgroup_dir(self, kernel_id: str) -> Path | None:
        """The sandbox's memory cgroup (v1 memory hierarchy or v2)."""
        if self.backend == "bwrap":
            cands = [CGROUP_MEMORY / "kernelmode" / kernel_id, Path("/sys/fs/cgroup/kernelmode") / kernel_id]
        else:
            cid = self.container(kernel_id).id
            cands = [CGROUP_MEMORY / "docker" / cid, Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"),
                     Path(f"/sys/fs/cgroup/docker/{cid}")]
        return next((d for d in cands if (d / "cgroup.procs").exists()), None)


def cgroup_memory(d: Path | None) -> dict[str, float]:
    """MB: anon (rss), page cache incl. tmpfs (cache), and what the cgroup is charged (usage)."""
    out: dict[str, float] = {}
    if d is None:
        return out
    with contextlib.suppress(OSError, ValueError):
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        if (d / "memory.usage_in_bytes").exists():  # v1
            out["rss"] = int(stat["total_rss"]) / 2**20
            out["cache"] = int(stat["total_cache"]) / 2**20
            out["usage"] = int((d / "memory.usage_in_bytes").read_text()) / 2**20
        else:  # v2
            out["rss"] = int(stat["anon"]) / 2**20
            out["cache"] = int(stat["file"]) / 2**20
            out["usage"] = int((d / "memory.current").read_text()) / 2**20
    return out


def cgroup_pids(d: Path | None) -> list[int]:
    if d is None:
        return []
    with contextlib.suppress(OSError):
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    return []


def daemons_kb() -> tuple[int, int]:
    """(RSS, PSS) kB of dockerd + containerd together."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{d}/comm").read_text().strip() in ("dockerd", "containerd"):
                    pids.append(int(d))
    return tree_mem(pids)


# -- measurements ---------------------------------------------------------------------------------------


async def timed_create(b: Backend, pool: bool, st: dict[str, Stats],
                       breakdown: dict[str, Stats] | None = None) -> None:
    """One session create + first execute; the session is deleted after (and a short settle)."""
    assert b.ctl is not None
    t_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    t_wall = time.time()
    t0 = time.perf_counter_ns()
    info = await b.create({})
    t_create = ms_since(t0)
    await b.ctl.execute(info["session_id"])
    total = ms_since(t0)
    if bool(info.get("from_pool")) != pool:
        raise RuntimeError(f"{b.name}: expected from_pool={pool}, got {info.get('from_pool')!r}")
    if info.get("sandbox") != b.backend:
        raise RuntimeError(f"{b.name}: the session's sandbox is {info.get('sandbox')!r}")
    key = f"{'pool' if pool else 'cold'}_{b.backend}"
    st[key].samples.append(total)
    st[key + "_create"].samples.append(t_create)
    st[key + "_first"].samples.append(total - t_create)
    if breakdown is not None:  # where a cold create's time goes (outside the timed interval)
        kid = info["kernel_id"]
        pid = b.spawned(kid)
        spawn = boot_seconds_of(pid) if pid is not None else None
        if spawn is not None:
            to_spawn = (spawn - t_boot) * 1000
            breakdown[f"{b.backend}_to_spawn"].samples.append(to_spawn)
            if b.backend == "bwrap":
                breakdown["bwrap_spawn_to_ready"].samples.append(t_create - to_spawn)
            else:
                attrs = (await asyncio.to_thread(b.container, kid)).attrs
                created = (docker_ts(attrs["Created"]) - t_wall) * 1000
                started = (docker_ts(attrs["State"]["StartedAt"]) - t_wall) * 1000
                breakdown["docker_spawn_to_created"].samples.append(created - to_spawn)
                breakdown["docker_created_to_started"].samples.append(started - created)
                breakdown["docker_started_to_ready"].samples.append(t_create - started)
    await b.delete(info["session_id"])
    await asyncio.sleep(SETTLE)


async def step_cold(servers: dict[str, Backend], bare: BareKernels, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n[1] cold create + first execute: {args.creates} samples each (pool_size 0)", flush=True)
    keys = [f"cold_{b}{s}" for b in BACKENDS for s in ("", "_create", "_first")]
    st = {k: Stats(k) for k in keys + ["bare", "bare_ready", "bare_first"]}
    bd = {k: Stats(k) for k in ("bwrap_to_spawn", "bwrap_spawn_to_ready", "docker_to_spawn",
                                "docker_spawn_to_created", "docker_created_to_started",
                                "docker_started_to_ready")}
    kinds = (*BACKENDS, "bare")

    async def sample(kind: str) -> None:
        if kind == "bare":
            total, ready, first = await bare.cold_start()
            st["bare"].samples.append(total)
            st["bare_ready"].samples.append(ready)
            st["bare_first"].samples.append(first)
            await asyncio.sleep(SETTLE)
        else:
            await timed_create(servers[kind], False, st, bd)

    for kind in kinds:  # one warm-up sample each (first container of the image, page cache)
        await sample(kind)
    for s in (*st.values(), *bd.values()):
        s.samples.clear()
    for rnd in range(args.creates):
        k = rnd % len(kinds)
        for kind in kinds[k:] + kinds[:k]:
            await sample(kind)
        if (rnd + 1) % 5 == 0 or rnd + 1 == args.creates:
            print(f"  round {rnd + 1}/{args.creates}: medians bwrap={st['cold_bwrap'].median:.0f} "
                  f"docker={st['cold_docker'].median:.0f} bare={st['bare'].median:.0f} ms", flush=True)
    return {"stats": st, "breakdown": bd}


async def step_exec(servers: dict[str, Backend], tmp: Path, args: argparse.Namespace) -> dict[str, Stats]:
    print(f"\n[2] warm execute round trip of `1+1`: {args.samples} samples each", flush=True)
    direct = DirectKernel(tmp / "direct", "ipc")
    (tmp / "direct").mkdir()
    try:
        await direct.start()
        fns = {"direct": direct.roundtrip}
        for name, b in servers.items():
            sid = (await b.create({}))["session_id"]
            conn = b.http()
            fns[name] = lambda c=conn, s=sid: c.execute(s)
        paths = (*BACKENDS, "direct")
        st = {p: Stats(p) for p in paths}

        def progress(rnd: int, rounds: int) -> None:
            print(f"  round {rnd}/{rounds}: medians "
                  + ", ".join(f"{p}={st[p].median:.2f}" for p in paths) + " ms", flush=True)

        await interleave({p: fns[p] for p in paths}, st, args.samples, args.batch, args.warmup,
                         progress=progress)
        return st
    finally:
        await direct.stop()


async def step_memory(servers: dict[str, Backend], args: argparse.Namespace) -> dict[str, Any]:
    k = args.mem_k
    print(f"\n[3] idle memory: {k} sessions per backend alive at the same time", flush=True)
    d0 = daemons_kb()
    sessions: dict[str, list[dict[str, Any]]] = {}
    for name, b in servers.items():
        sessions[name] = []
        for _ in range(k):
            info = await b.create({})
            assert b.ctl is not None
            await b.ctl.execute(info["session_id"])
            sessions[name].append(info)
    await asyncio.sleep(2.0)  # idle: let the kernels settle (history writer, GC)
    d1 = daemons_kb()
    res: dict[str, Any] = {"k": k, "daemons_rss_mb": (d1[0] - d0[0]) / 1024 / k,
                           "daemons_pss_mb": (d1[1] - d0[1]) / 1024 / k}
    for name, b in servers.items():
        rows = {x: Stats(x) for x in ("cg_rss", "cg_cache", "cg_usage", "sb_rss", "sb_pss", "helper_rss",
                                      "helper_pss", "launcher_pss", "shim_pss", "total_rss", "total_pss",
                                      "procs")}
        for info in sessions[name]:
            kid = info["kernel_id"]
            cg = await asyncio.to_thread(b.cgroup_dir, kid)
            mem = cgroup_memory(cg)
            pids = cgroup_pids(cg)
            if not pids:
                raise RuntimeError(f"{name}: no processes found in the cgroup of kernel {kid} ({cg})")
            helpers: list[int] = []
            if b.backend == "docker":  # on the host, outside the container's cgroup
                launcher = b.spawned(kid)
                if launcher is not None:
                    helpers.append(launcher)
                    rows["launcher_pss"].samples.append(mem_kb(launcher)[1] / 1024)
                init = (await asyncio.to_thread(b.container, kid)).attrs["State"]["Pid"]
                st = stat(int(init))
                if st is not None:
                    helpers.append(st[0])  # containerd-shim-runc-v2, one per container
                    rows["shim_pss"].samples.append(mem_kb(st[0])[1] / 1024)
            srss, spss = tree_mem(pids)
            hrss, hpss = tree_mem(helpers)
            for key, val in (("cg_rss", mem.get("rss")), ("cg_cache", mem.get("cache")),
                             ("cg_usage", mem.get("usage"))):
                if val is not None:
                    rows[key].samples.append(val)
            rows["sb_rss"].samples.append(srss / 1024)
            rows["sb_pss"].samples.append(spss / 1024)
            rows["helper_rss"].samples.append(hrss / 1024)
            rows["helper_pss"].samples.append(hpss / 1024)
            rows["total_rss"].samples.append((srss + hrss) / 1024)
            rows["total_pss"].samples.append((spss + hpss) / 1024)
            rows["procs"].samples.append(len(pids) + len(helpers))
        res[name] = rows
        print(f"  {name}: PSS {rows['total_pss'].median:.1f} MB per session (sandbox "
              f"{rows['sb_pss'].median:.1f} + host helpers {rows['helper_pss'].median:.1f}), "
              f"cgroup anon {rows['cg_rss'].median if rows['cg_rss'].n else float('nan'):.1f} MB", flush=True)
    print(f"  dockerd + containerd growth: {res['daemons_rss_mb']:.2f} MB RSS per container", flush=True)
    for name, b in servers.items():
        for info in sessions[name]:
            await b.delete(info["session_id"])
    return res


async def step_pool(servers: dict[str, Backend], args: argparse.Namespace) -> dict[str, Stats]:
    print(f"\n[4] create from the warm pool + first execute: {args.creates} samples each", flush=True)
    st = {f"pool_{b}{s}": Stats(f"pool_{b}{s}") for b in BACKENDS for s in ("", "_create", "_first")}

    async def sample(kind: str) -> None:
        for b in servers.values():  # both pools full and quiet: no refill runs during a sample
            await b.wait_pool_full(settle=0)
        await asyncio.sleep(SETTLE)
        await timed_create(servers[kind], True, st)

    for kind in BACKENDS:
        await sample(kind)
    for s in st.values():
        s.samples.clear()
    for rnd in range(args.creates):
        k = rnd % len(BACKENDS)
        for kind in BACKENDS[k:] + BACKENDS[:k]:
            await sample(kind)
        if (rnd + 1) % 5 == 0 or rnd + 1 == args.creates:
            print(f"  round {rnd + 1}/{args.creates}: medians bwrap={st['pool_bwrap'].median:.1f} "
                  f"docker={st['pool_docker'].median:.1f} ms", flush=True)
    return st


# -- reporting -------------------------------------------------------------------------------------------


def backends_machine_info(ready: dict[str, dict[str, Any]], docker_info: dict[str, Any],
                          load_start: str) -> dict[str, str]:
    bwrap = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    out = {
        **machine_info("bwrap and bare kernels"),
        "jupyter_client / jupyter_kernel_gateway": (f"{version('jupyter_client')} / "
                                                   f"{version('jupyter_kernel_gateway')}"),
        "bubblewrap": bwrap,
        "docker engine": docker_info.get("engine", "?"),
        "kernel image": docker_info.get("image", "?"),
        "docker SDK (launcher, benchmark)": version("docker"),
    }
    for name in BACKENDS:
        sb = ready.get(name, {}).get("sandbox", {})
        out[f"sandbox {name} (/readyz)"] = f"{sb.get('detail', '?')}; limits: {sb.get('limits', '?')}"
    out["load average (1, 5, 15 min) at the start"] = load_start
    out["load average (1, 5, 15 min) at the end"] = loadavg()
    return out


def ratios(res: dict[str, Any]) -> dict[str, float]:
    c, p, e = res["cold"]["stats"], res["pool"], res["exec"]
    out = {
        "cold_create": c["cold_docker"].median / c["cold_bwrap"].median,
        "pool_create": p["pool_docker"].median / p["pool_bwrap"].median,
        "warm_exec": e["docker"].median / e["bwrap"].median,
    }
    m = res["memory"]
    out["idle_pss"] = m["docker"]["total_pss"].median / m["bwrap"]["total_pss"].median
    if m["docker"]["cg_rss"].n and m["bwrap"]["cg_rss"].n:
        out["idle_cgroup_anon"] = m["docker"]["cg_rss"].median / m["bwrap"]["cg_rss"].median
    return out


def summary_line(res: dict[str, Any]) -> str:
    r = ratios(res)
    c, p, e = res["cold"]["stats"], res["pool"], res["exec"]
    m = res["memory"]
    return ("SUMMARY docker/bwrap " + " ".join(f"{k}={v:.2f}x" for k, v in r.items())
            + f" (median ms: cold bwrap={c['cold_bwrap'].median:.0f} docker={c['cold_docker'].median:.0f}"
            f" bare={c['bare'].median:.0f}; pool bwrap={p['pool_bwrap'].median:.1f}"
            f" docker={p['pool_docker'].median:.1f}; exec bwrap={e['bwrap'].median:.2f}"
            f" docker={e['docker'].median:.2f} direct={e['direct'].median:.2f};"
            f" idle PSS MB bwrap={m['bwrap']['total_pss'].median:.1f} docker={m['docker']['total_pss'].median:.1f})")


def _row(label: str, s: Stats, ref: Stats | None = None, fmt: str = ".1f") -> str:
    ratio = f"{s.median / ref.median:.2f}x" if ref is not None and ref.n and s.n else ""
    if not s.n:
        return f"| {label} | – | – | – | – | 0 | {ratio} |"
    return (f"| {label} | {s.median:{fmt}} | {s.pct(95):{fmt}} | {s.pct(99):{fmt}} | {min(s.samples):{fmt}} "
            f"| {s.n} | {ratio} |")


def report_text(res: dict[str, Any], args: argparse.Namespace, markdown: bool) -> str:
    c, bd, p, e, m = (res["cold"]["stats"], res["cold"]["breakdown"], res["pool"], res["exec"], res["memory"])
    head = "| what | median | p95 | p99 | min | N | docker / bwrap |\n|---|---|---|---|---|---|---|"
    ind = "&nbsp;&nbsp;" if markdown else "  "
    lat = [head]
    for kind, title in (("cold", "**cold** (pool_size 0): POST /v1/sessions + first execute"),
                        ("pool", "**pool** (pool_size 2): POST /v1/sessions + first execute")):
        src = c if kind == "cold" else p
        lat.append(f"| {title} | | | | | | |")
        for b in BACKENDS:
            ref = src[f"{kind}_bwrap"] if b == "docker" else None
            lat.append(_row(f"{ind}{b}", src[f"{kind}_{b}"], ref))
        for b in BACKENDS:
            ref = src[f"{kind}_bwrap_create"] if b == "docker" else None
            lat.append(_row(f"{ind}{ind}{b}: POST /v1/sessions alone", src[f"{kind}_{b}_create"], ref))
        for b in BACKENDS:
            ref = src[f"{kind}_bwrap_first"] if b == "docker" else None
            lat.append(_row(f"{ind}{ind}{b}: the first execute", src[f"{kind}_{b}_first"], ref, ".2f"))
        if kind == "cold":
            lat.append(_row(f"{ind}bare jupyter_client ipykernel start + first execute (unsandboxed floor)",
                            c["bare"]))
    lat.append("| **warm execute** round trip of `1+1` in one session | | | | | | |")
    lat.append(_row(f"{ind}bwrap", e["bwrap"], None, ".3f"))
    lat.append(_row(f"{ind}docker", e["docker"], e["bwrap"], ".3f"))
    lat.append(_row(f"{ind}direct jupyter_client -> ipykernel (no sandbox, no gateway)", e["direct"], None, ".3f"))

    bdt = ["| stage, ms: median (p95) | bwrap | docker |", "|---|---|---|"]

    def md(key: str) -> str:
        s = bd[key] if key in bd else c[key]
        return f"{s.median:.0f} ({s.pct(95):.0f})" if s.n else "–"

    bdt += [
        f"| POST until the gateway spawns the kernel's process (manager, gateway, provisioner: "
        f"uid, workspace volume, cgroup / spec) | {md('bwrap_to_spawn')} | {md('docker_to_spawn')} |",
        f"| bwrap: launcher + bwrap + ipykernel boot until the kernel answers and the POST returns "
        f"| {md('bwrap_spawn_to_ready')} | |",
        f"| docker: launcher start (python -I, import docker SDK) + `containers.create` "
        f"| | {md('docker_spawn_to_created')} |",
        f"| docker: container created -> started (engine: rootfs, mounts, runc, init) "
        f"| | {md('docker_created_to_started')} |",
        f"| docker: started -> kernel answers and the POST returns (ipykernel boot in the container, "
        f"gateway ready check, manager) | | {md('docker_started_to_ready')} |",
        f"| total (POST /v1/sessions alone) | {md('cold_bwrap_create')} | {md('cold_docker_create')} |",
    ]

    def slow(s: Stats) -> str:  # samples far above the median: the cold creates' second mode
        return f"{sum(x > 1.5 * s.median for x in s.samples)}/{s.n}"

    notes = []
    if all(bd[k].n for k in ("docker_spawn_to_created", "docker_created_to_started", "bwrap_spawn_to_ready",
                              "docker_started_to_ready")):
        extra = bd["docker_spawn_to_created"].median + bd["docker_created_to_started"].median
        notes.append(
            f"- Docker's cold create costs {c['cold_docker_create'].median - c['cold_bwrap_create'].median:.0f} ms "
            f"more (median): before its kernel starts booting, {extra:.0f} ms go to the launcher (a Python "
            f"process importing the Docker SDK, then the create API call: "
            f"{bd['docker_spawn_to_created'].median:.0f} ms) and the engine's start of the container "
            f"({bd['docker_created_to_started'].median:.0f} ms); the boot inside the container until the "
            f"kernel answers ({bd['docker_started_to_ready'].median:.0f} ms) is "
            f"{'no slower than' if bd['docker_started_to_ready'].median <= bd['bwrap_spawn_to_ready'].median * 1.05 else 'slower than'}"
            f" bwrap's launcher + "
            f"sandbox + boot ({bd['bwrap_spawn_to_ready'].median:.0f} ms).")
    notes.append(
        f"- Cold creates are bimodal on both backends: {slow(c['cold_bwrap'])} bwrap and "
        f"{slow(c['cold_docker'])} docker samples took more than 1.5x the median (the bare ipykernel start: "
        f"{slow(c['bare'])}). The extra time (about half a second) is in the last stage, between the kernel's "
        f"boot and the POST's answer, on both backends alike (see the p95s above) — the 0.5 s period of "
        f"jupyter_server's kernel_info \"nudge\" on a new channels websocket would fit, if the first nudge "
        f"reaches a kernel still booting.")
    r = ratios(res)
    if all(0.9 <= r[k] <= 1.1 for k in ("pool_create", "warm_exec")):
        notes.append(
            f"- Once a kernel runs, the backend makes no difference: the first execute, the pool create and "
            f"the warm round trip are equal within noise ({r['pool_create']:.2f}x pool, {r['warm_exec']:.2f}x "
            f"warm). With the warm pool (the default), Docker's slower cold start is hidden from the client "
            f"as long as the pool keeps up.")
    if m["docker"]["launcher_pss"].n:
        notes.append(
            f"- Memory: the kernels themselves use the same (cgroup anon memory "
            f"{m['bwrap']['cg_rss'].median if m['bwrap']['cg_rss'].n else float('nan'):.1f} vs "
            f"{m['docker']['cg_rss'].median if m['docker']['cg_rss'].n else float('nan'):.1f} MB); Docker's "
            f"extra per session is on the host, outside the container and its memory limit: the "
            f"`docker_launcher.py` process ({m['docker']['launcher_pss'].median:.1f} MB PSS, a Python "
            f"interpreter with the Docker SDK, alive as long as the kernel) and the containerd shim "
            f"({m['docker']['shim_pss'].median:.1f} MB).")

    def mm(b: str, key: str) -> str:
        s = m[b][key]
        return f"{s.median:.1f}" if s.n else "–"

    memt = [f"| per idle session, MB (median of {m['k']}) | bwrap | docker | docker / bwrap |",
            "|---|---|---|---|"]
    for key, label in (("total_pss", "**PSS, all of the session's processes**"),
                       ("sb_pss", f"{ind}PSS inside the sandbox (the cgroup's processes)"),
                       ("helper_pss", f"{ind}PSS of host-side helpers outside it (docker: launcher + "
                                      "containerd-shim)"),
                       ("launcher_pss", f"{ind}{ind}docker_launcher.py (Python + Docker SDK)"),
                       ("shim_pss", f"{ind}{ind}containerd-shim-runc-v2"),
                       ("total_rss", "RSS, all of the session's processes"),
                       ("cg_rss", "memory cgroup: anon (rss)"),
                       ("cg_cache", "memory cgroup: page cache incl. tmpfs (cache)"),
                       ("cg_usage", "memory cgroup: usage (what the limit counts)"),
                       ("procs", "processes")):
        bs, ds = m["bwrap"][key], m["docker"][key]
        ratio = f"{ds.median / bs.median:.2f}x" if bs.n and ds.n and bs.median >= 1 else ""
        val = (lambda b, k=key: f"{m[b][k].median:.0f}") if key == "procs" else (lambda b, k=key: mm(b, k))
        memt.append(f"| {label} | {val('bwrap')} | {val('docker')} | {ratio} |")
    memt.append(f"| dockerd + containerd growth per container (RSS; PSS) | | "
                f"{res['memory']['daemons_rss_mb']:.2f}; {res['memory']['daemons_pss_mb']:.2f} | |")

    rat = "\n".join(f"- {k}: **{v:.2f}x**" for k, v in r.items())
    summ = summary_line(res)
    if not markdown:
        return "\n".join(["\n".join(lat), "", "\n".join(bdt), "", "\n".join(memt), "", rat, "",
                          "\n".join(notes)])
    wall = res["wall"]
    return f"""# Sandbox backends: bubblewrap vs Docker

Generated by `{' '.join(['bench/backends.py', *sys.argv[1:]])}` on {res['machine']['date']}; wall time
{wall:.0f} s. All latencies in ms, memory in MB (MiB); percentiles are linear interpolation between
closest ranks (with N = {args.creates}, p99 is close to the maximum). Companion of
[RESULTS.md](RESULTS.md) (warm round trip, bwrap) and [SCALE.md](SCALE.md) (scale, bwrap).

## Result

{rat}

`{summ}`

{chr(10).join(lat)}

{chr(10).join(notes)}

### Where a cold create's time goes

{chr(10).join(bdt)}

From the start time of the kernel's process on the host (the gateway's child; `/proc/<pid>/stat`,
10 ms resolution) and, for Docker, the engine's `Created` and `State.StartedAt` timestamps of the
container, against the moment the benchmark sent the POST (medians of the same {args.creates}
samples; the stages are medians each, so they need not add up exactly). The p95 of a
stage shows where the slow samples lose their time.

### Idle memory per session

{chr(10).join(memt)}

## Method

Four `kernelmode serve` processes, each started with `tests.support.server.start_server` and
`KERNELMODE_SANDBOX__BACKEND=<backend>` + `--sandbox <backend>`, two at a time (one per backend);
the REST client is the lean keep-alive HTTP/1.1 client of `bench/harness.py` (asyncio streams).
The two backends are sampled alternately, round-robin with the order rotated every round, so that
the machine's noise (other work, CPU frequency) falls on both alike.

1. **cold** — a pair with `KERNELMODE_SESSIONS__POOL_SIZE=0`: each sample is `POST /v1/sessions {{}}`
   (a new kernel in a new sandbox) until the response, then the first `POST .../execute {{"code":
   "1+1"}}` until its answer (`'2'`); the session is deleted afterwards and {SETTLE} s pass before the
   next sample. One warm-up sample each is discarded. Beside them, as the floor, a bare
   jupyter_client ipykernel (kernel-venv python, no sandbox, no gateway) started until its first
   execute.
2. **warm execute** — one session per backend on the same pair, {args.warmup} warm-up runs, then
   {args.samples} round trips of `1+1` each in batches of {args.batch}, beside the direct
   jupyter_client -> ipykernel round trip (`bench/roundtrip.py`'s `direct`, `bench/harness.py`'s `DirectKernel`).
3. **memory** — {m['k']} sessions per backend created (each with one execute) on the same pair and
   left idle for 2 s; per session, the sandbox's memory cgroup (bwrap: the project's per-kernel
   cgroup `memory/kernelmode/<kernel_id>`; docker: the engine's `memory/docker/<container id>`;
   `memory.stat` total_rss / total_cache, `memory.usage_in_bytes`), and the RSS and PSS
   (`/proc/<pid>/smaps_rollup`) of the processes in that cgroup (bwrap: bwrap x2 + ipykernel;
   docker: docker-init + ipykernel) plus, for Docker, the host-side processes each kernel needs
   outside its container: the `docker_launcher.py` Python process the gateway watches, and the
   container's `containerd-shim-runc-v2`. The growth of `dockerd` + `containerd` (RSS/PSS before
   and after creating the sessions, divided by their number) is listed apart (noisy: Go heaps).
   PSS splits shared pages among the processes that map them: the two backends' kernels run
   different Python builds (the host's kernel-venv vs the image's), so each backend's kernels
   share only among themselves. The cgroup's page cache counts files the kernel read first
   (for a container: the image's files on first use), so only its anon part compares directly.
   No `docker stats` (slow); the cgroup files are what it reads.
4. **pool** — a second pair with the default warm pool (`pool_size` 2; the first pair is stopped
   first): before every sample, both servers' `/readyz` `checks.pool.ready` is back at the pool's
   size (polled every 50 ms) and {SETTLE} s pass, so that no refill runs during a sample; then
   `POST /v1/sessions {{}}` (asserting `from_pool`) + the first execute, as in 1.

Docker here: the engine's default runtime (runc) with the cgroupfs driver and overlay2; the kernel
image `{docker_image()}` (`scripts/docker-setup.sh`). Every container has `--network none`,
read-only rootfs, tmpfs /tmp and /sys, an init, limits and its own uid
(`kernelmode/sandbox/docker_backend.py`).

## Machine

| | |
|---|---|
{chr(10).join(f"| {k} | {v} |" for k, v in res['machine'].items())}
"""


# -- main --------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kmbackends-", dir="/tmp"))
    res: dict[str, Any] = {}
    steps: dict[str, float] = {}
    lap_t = [time.monotonic()]

    def lap(name: str) -> None:
        now = time.monotonic()
        steps[name] = now - lap_t[0]
        lap_t[0] = now

    ready: dict[str, dict[str, Any]] = {}
    docker_info: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        bare = BareKernels(tmp)
        stack.push_async_callback(bare.stop)
        cold = {b: Backend(b, 0) for b in BACKENDS}
        pool = {b: Backend(b, 2) for b in BACKENDS}
        for srv in (*cold.values(), *pool.values()):
            stack.push_async_callback(srv.stop)
        try:
            print("starting kernelmode serve: bwrap and docker, pool_size 0 ...", flush=True)
            for b in BACKENDS:
                cold[b].start()
                ready[b] = await cold[b].readyz()
            import docker

            with contextlib.closing(docker.from_env(timeout=30)) as client:
                i = client.info()
                docker_info["engine"] = (f"{i.get('ServerVersion', '?')}, storage {i.get('Driver', '?')}, "
                                         f"cgroup {i.get('CgroupVersion', '?')} ({i.get('CgroupDriver', '?')}), "
                                         f"runtime {i.get('DefaultRuntime', '?')}")
                img = client.images.get(docker_image())
                docker_info["image"] = f"{docker_image()} ({img.attrs.get('Size', 0) / 1e6:.0f} MB)"
            lap("start")
            res["cold"] = await step_cold(cold, bare, args)
            lap("cold")
            res["exec"] = await step_exec(cold, tmp, args)
            lap("exec")
            res["memory"] = await step_memory(cold, args)
            lap("memory")
            print("\nstopping them; starting the pair with the warm pool (pool_size 2) ...", flush=True)
            for b in BACKENDS:
                await cold[b].stop()
            for b in BACKENDS:
                pool[b].start()
            lap("restart")
            res["pool"] = await step_pool(pool, args)
            lap("pool")
            for b in BACKENDS:
                await pool[b].stop()
            lap("stop")
        except Exception:  # an error, not Ctrl-C: keep the servers' logs for a look
            for srv in (*cold.values(), *pool.values()):
                srv.keep_logs = True
            raise
        res["machine"] = backends_machine_info(ready, docker_info, load_start)
        res["wall"] = time.monotonic() - started
    print()
    print(report_text(res, args, markdown=False))
    if not args.no_write:
        (BENCH / "BACKENDS.md").write_text(report_text(res, args, markdown=True))
        print("\nwrote bench/BACKENDS.md")
    print(f"wall time {res['wall']:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in steps.items()) + ")")
    print(summary_line(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer samples (about 1.5 minutes instead of 4-5)")
    p.add_argument("--no-write", action="store_true", help="do not write bench/BACKENDS.md")
    args = p.parse_args()
    args.creates = 8 if args.quick else 30
    args.samples = 60 if args.quick else 300
    args.warmup = 10 if args.quick else 30
    args.batch = 10
    args.mem_k = 2 if args.quick else 5
    require_kernel_venv(p)
    image = docker_image()
    ok, why = engine_status(image)
    if not ok:
        print(f"bench/backends.py: the Docker backend is not usable here: {why}. "
              "Nothing measured (make docker-setup installs the engine and builds the image).")
        print(f"SUMMARY docker unavailable ({why}); nothing measured", flush=True)
        return 0
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
