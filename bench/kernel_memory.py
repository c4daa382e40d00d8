"""Memory of one kernel, idle and after `import pandas, numpy`: the figure docs/scaling.md sizes
kernel pods and nodes from (issue 19). Measured on a real `kernelmode serve` (bwrap sandbox), via
/proc of the kernels' processes.

Run:  .venv/bin/python bench/kernel_memory.py [--kernels N] [--no-write]

N sessions are created (pool size 0, so that only they run kernels), each runs `1+1` and idles;
then RSS and PSS (/proc/<pid>/smaps_rollup) of each session's ipykernel and of its whole process
tree (two bwrap processes + the ipykernel) are read with all N alive at once, so that shared pages
(the Python binary, the kernel-venv's libraries) are split across the same N kernels in PSS. Then
each session runs `import pandas, numpy` and the same is read again.

On Kubernetes each kernel is a pod with its own page cache accounting: its working set there is
close to the RSS (nothing is shared between pods' cgroups the way PSS splits it), so RSS is the
figure to size a pod's memory request from; PSS says what one more kernel costs on one host.
Results go to a section of bench/RESULTS.md (unless --no-write); the last line is a SUMMARY.

``--vs-bare N`` (issue 33's memory goal): instead, the PSS per session of N idle sessions that
each ran ``import pandas as pd; 1+1`` (taken from a warm pool of N that preimported pandas, as
the defaults do; ``--cold``: no pool), each session's whole sandbox counted, vs N bare
ipykernels tuned like kernelmode's that did the same, measured in the same run (one group alive
at a time). Writes the "kernel_memory_pandas" section.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from direct_kernels import BareKernels
from harness import (
    BENCH,
    Stats,
    loadavg,
    machine_info,
    require_kernel_venv,
    run_stoppable,
    write_section,
)
from scale import session_trees
from servers import AS_DEPLOYED, KmServer

from tests.support.procfs import descendants, mem_kb, ptable, tree_mem, uid_of

SECTION = "kernel_memory"
PHASES = (("idle", "1+1"), ("pandas", "import pandas, numpy"))


async def measure(km: KmServer, sids: list[str]) -> dict[str, Stats]:
    """RSS and PSS (MB) of each session's ipykernel and of its process tree, all alive now."""
    rows = {k: Stats(k) for k in ("kernel_rss", "kernel_pss", "tree_rss", "tree_pss")}
    for pids in session_trees(km, sids).values():
        kernel = max(pids, key=lambda p: mem_kb(p)[0])  # the ipykernel; the rest is bwrap
        krss, kpss = mem_kb(kernel)
        rss, pss = tree_mem(pids)
        for name, kb in (("kernel_rss", krss), ("kernel_pss", kpss), ("tree_rss", rss), ("tree_pss", pss)):
            rows[name].samples.append(kb / 1024)
    return rows


async def run(args: argparse.Namespace) -> int:
    km = KmServer("kernel-memory", {"KERNELMODE_SESSIONS__POOL_SIZE": "0"}, backend="bwrap")
    km.start()
    assert km.ctl is not None
    results: dict[str, dict[str, Stats]] = {}
    sids: list[str] = []
    try:
        for _ in range(args.kernels):
            sids.append((await km.create({}))["session_id"])
        for phase, code in PHASES:
            for sid in sids:
                status, body = await km.ctl.json("POST", f"/v1/sessions/{sid}/execute", {"code": code})
                if status != 200 or body.get("status") != "ok":
                    raise RuntimeError(f"{sid}: {code!r} answered {status} {body}")
            await asyncio.sleep(1.0)  # let the kernels settle back to idle
            results[phase] = await measure(km, sids)
    finally:
        for sid in sids:
            await km.delete(sid)
        await km.stop(timeout=60)
    report(args, results)
    return 0


def report(args: argparse.Namespace, r: dict[str, dict[str, Stats]]) -> None:
    info = machine_info("bwrap")
    lines = []
    for phase, code in PHASES:
        s = r[phase]
        lines.append(f"| {phase} (`{code}`) | {s['kernel_rss'].median:.1f} | {s['kernel_pss'].median:.1f} | "
                     f"{s['tree_rss'].median:.1f} | {s['tree_pss'].median:.1f} | "
                     f"{max(s['kernel_rss'].samples):.1f} |")
    idle, pandas = r["idle"]["kernel_rss"].median, r["pandas"]["kernel_rss"].median
    body = f"""## Memory of one kernel, idle and with pandas (bench/kernel_memory.py)

{info['date']}; {args.kernels} sessions alive at once on `kernelmode serve` (bwrap sandbox, pool
size 0); medians over the {args.kernels} kernels, MB. PSS splits pages shared between the
{args.kernels} kernels; RSS counts them in full. The machine is shared by five engineers (2 cores):
memory figures are not timing figures and vary little with load.

| phase | ipykernel RSS | ipykernel PSS | tree RSS (bwrap x2 + kernel) | tree PSS | max ipykernel RSS |
|---|---|---|---|---|---|
{chr(10).join(lines)}

`import pandas, numpy` adds **{pandas - idle:.0f} MB** of RSS to a kernel ({idle:.0f} -> {pandas:.0f} MB).
A kernel pod has no bwrap; its container's working set is close to the ipykernel's RSS plus what
its /tmp emptyDir holds (docs/scaling.md sizes requests and nodes from these figures).

Machine: {', '.join(f'{k}: {v}' for k, v in info.items() if k != 'date')}.
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SECTION, body)
    print(f"SUMMARY idle_rss={idle:.1f}MB idle_pss={r['idle']['kernel_pss'].median:.1f}MB "
          f"pandas_rss={pandas:.1f}MB pandas_pss={r['pandas']['kernel_pss'].median:.1f}MB")


# -- N idle sessions with pandas vs N bare kernels (issue 33's memory goal) ----------------------

SHARED_SECTION = "kernel_memory_pandas"
PANDAS_CELL = "import pandas as pd; 1+1"
SMAPS_KEYS = ("Pss", "Pss_Anon", "Pss_File", "Private_Dirty", "Rss", "Pss of the ipykernel alone")


def smaps(pids: list[int]) -> dict[str, float]:
    """Fields of /proc/<pid>/smaps_rollup summed over ``pids`` (MB); a process gone counts 0."""
    out = dict.fromkeys(SMAPS_KEYS, 0.0)
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] += int(rest.split()[0]) / 1024
    out["Pss of the ipykernel alone"] = mem_kb(max(pids, key=lambda p: mem_kb(p)[0]))[1] / 1024 if pids else 0.0
    return out


def with_ancestors(pids: list[int], gateway: int, table: dict[int, int]) -> list[int]:
    """``pids`` (a sandbox's processes of the kernel's uid) and their ancestors below the gateway:
    the bwrap processes, which run as another uid."""
    out = set(pids)
    for pid in pids:
        while (pid := table.get(pid, 0)) > 1 and pid != gateway:
            out.add(pid)
    return sorted(out)


def by_process(pids: set[int], n: int) -> str:
    """Mean PSS per session of each kind of process (bwrap, ipykernel, egress bridge), MB."""
    by: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm.startswith("python"):  # the ipykernel, or the egress bridge it forked
                comm = "egress bridge" if b"egress" in Path(f"/proc/{pid}/cmdline").read_bytes() else "ipykernel"
            by[comm] = by.get(comm, 0.0) + mem_kb(pid)[1] / 1024 / n
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def mean_rows(per: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in per) for k in SMAPS_KEYS}


async def sessions_pss(n: int, env: dict[str, str], from_pool: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """Per-session mean of the smaps fields of each session's whole sandbox (bwrap, the egress
    bridge, the ipykernel), all ``n`` idle at once after ``PANDAS_CELL``; no other kernel alive
    (checked: ``other_sandbox_processes``)."""
    pool = {"KERNELMODE_SESSIONS__POOL_SIZE": str(n if from_pool else 0),
            "KERNELMODE_SESSIONS__POOL_MAX": str(n if from_pool else 0),
            # no refill while measuring: pool kernels alive would split the shared pages further
            "KERNELMODE_SESSIONS__POOL_REFILL_DELAY_SECONDS": "86400"}
    km = KmServer("kernel-memory-pandas", {**AS_DEPLOYED, **pool, **env}, backend="bwrap")
    km.start()
    assert km.ctl is not None
    sids: list[str] = []
    note: dict[str, Any] = {}
    try:
        if from_pool:
            await km.wait_pool_full(settle=1.0, timeout=60 + 10 * n)
        for _ in range(n):
            info = await km.create({})
            sids.append(info["session_id"])
            note["from_pool"] = note.get("from_pool", 0) + bool(info.get("from_pool"))
        for sid in sids:
            status, body = await km.ctl.json("POST", f"/v1/sessions/{sid}/execute", {"code": PANDAS_CELL})
            if status != 200 or body.get("result") != "2":
                raise RuntimeError(f"{sid}: {PANDAS_CELL!r} answered {status} {body}")
        await asyncio.sleep(2.0)  # idle
        table = ptable()
        trees = {sid: with_ancestors(pids, km.gateway_pid, table) for sid, pids in session_trees(km, sids).items()}
        ours = {p for pids in trees.values() for p in pids}
        others = [p for p in descendants(km.gateway_pid, table) if p not in ours and uid_of(p) != os.getuid()]
        note["other_sandbox_processes"] = len(others)
        note["by_process"] = by_process(ours, n)
        return mean_rows([smaps(pids) for pids in trees.values()]), note
    finally:
        for sid in sids:
            await km.delete(sid)
        await km.stop(timeout=60)


async def bare_pss(n: int) -> dict[str, float]:
    """The same for ``n`` bare ipykernels tuned like kernelmode's (bench/direct_kernels.py)."""
    with tempfile.TemporaryDirectory(prefix="km-mem-bare-") as tmp:
        bare = BareKernels(Path(tmp))
        try:
            kernels = await bare.start_many(n)
            for dk in kernels:
                _, result, _ = await dk.run_cell(PANDAS_CELL)
                if result != "2":
                    raise RuntimeError(f"bare kernel answered {result!r}")
            await asyncio.sleep(2.0)
            return mean_rows([smaps([dk.pid, *descendants(dk.pid, ptable())]) for dk in kernels])
        finally:
            await bare.stop()


async def run_pandas(args: argparse.Namespace) -> int:
    load_start = loadavg()
    env = dict(kv.split("=", 1) for kv in args.env)
    km, note = await sessions_pss(args.vs_bare, env, not args.cold)
    bare = await bare_pss(args.vs_bare)
    report_pandas(args, km, bare, note, load_start)
    return 0


def report_pandas(args: argparse.Namespace, km: dict[str, float], bare: dict[str, float],
                  note: dict[str, Any], load_start: str) -> None:
    n = args.vs_bare
    how = ("cold sessions (pool size 0) that imported pandas in that cell" if args.cold else
           f"sessions taken from a warm pool of {n} (`pool_preimport` imported pandas; no refill while measured)")
    env = f"; server settings {', '.join(args.env)}" if args.env else ""
    rows = "\n".join(f"| {k} | {km[k]:.1f} | {bare[k]:.1f} | {km[k] / bare[k]:.2f} |" if bare[k] else
                     f"| {k} | {km[k]:.1f} | {bare[k]:.1f} | - |" for k in SMAPS_KEYS)
    body = f"""## {n} idle sessions with pandas vs {n} bare kernels, per session (bench/kernel_memory.py --vs-bare {n})

`.venv/bin/python bench/kernel_memory.py --vs-bare {n}{' --cold' if args.cold else ''}{''.join(' --env ' + e for e in args.env)}`,
{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load average {load_start} at the start. Kernelmode: {n} {how}{env},
each ran `{PANDAS_CELL}` and idles; each session's whole sandbox counted (bwrap, the egress
bridge, the ipykernel: /proc/PID/smaps_rollup of each, found by the workspace's uid under the
gateway; {note.get('other_sandbox_processes')} other sandbox processes alive, {note.get('from_pool', 0)} sessions from the
pool). Bare: {n} unsandboxed ipykernels tuned like kernelmode's (bench/direct_kernels.py) that ran
the same, all alive at once, measured after the sessions were gone (PSS splits a shared page
among the processes that map it: the two groups are never alive together). MB per session (mean).

| smaps_rollup field | kernelmode session | bare kernel | kernelmode / bare |
|---|---:|---:|---:|
{rows}

PSS per session by process name (kernelmode), MB: {note.get('by_process')}.

Goal (issue 33): PSS per session <= 0.6x the bare kernel's. **{km['Pss'] / bare['Pss']:.2f}x** in this run.
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SHARED_SECTION if n == 20 else f"{SHARED_SECTION}-{n}", body)
    print(f"SUMMARY n={n} km_pss={km['Pss']:.1f}MB bare_pss={bare['Pss']:.1f}MB ratio={km['Pss'] / bare['Pss']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=8, help="sessions alive at once (default 8)")
    p.add_argument("--vs-bare", type=int, default=0, metavar="N",
                   help="instead: N idle sessions that imported pandas vs N bare kernels, PSS per session")
    p.add_argument("--cold", action="store_true", help="with --vs-bare: sessions without a pool")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="with --vs-bare: a setting of the server (an experiment)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.kernels < 1:
        p.error("--kernels must be >= 1")
    require_kernel_venv(p)
    return run_stoppable(run_pandas if args.vs_bare else run, args)


if __name__ == "__main__":
    sys.exit(main())
