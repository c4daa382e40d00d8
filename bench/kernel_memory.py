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
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from harness import BENCH, Stats, machine_info, require_kernel_venv, run_stoppable, write_section
from scale import session_trees
from servers import KmServer

from tests.support.procfs import mem_kb, tree_mem

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=8, help="sessions alive at once (default 8)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.kernels < 1:
        p.error("--kernels must be >= 1")
    require_kernel_venv(p)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
