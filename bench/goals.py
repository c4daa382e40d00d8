"""The performance goals of issue 18 in one command: met or not, from the benchmarks' own runs.

Run:  .venv/bin/python bench/goals.py [--quick] [--only roundtrip,scale,load,realistic]

Runs bench/roundtrip.py, bench/scale.py, bench/load.py (its load step's CPU per run) and
bench/realistic.py as subprocesses (with --no-write, and --quick when given), reads the SUMMARY
line each prints last, and prints one table: goal, figure, met / not met. Nothing is written;
each benchmark writes its own section of bench/RESULTS.md when run on its own without
--no-write. Every ratio is measured within one benchmark run (interleaved against its direct
path: ipykernels tuned as kernelmode's are, direct_kernels.tuned_kernel_args, so that a ratio is the cost
of the hops), so it is comparable across machines; the load average at the start and end is printed
because on a shared 2-CPU machine other jobs weigh on the two extra hops more than on the
direct path.

Exit status: 0 when every goal is met, 1 when one is not met or a benchmark gave no figure (so
that `make bench-goals` fails), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHES = ("roundtrip", "scale", "load", "realistic")


# (benchmark, goal, SUMMARY pattern giving the figure, how the figure meets the goal, unit)
GOALS: list[tuple[str, str, str, Callable[[float], bool], str]] = [
    ("roundtrip", "REST warm execute <= 1.2x direct (tuned like kernelmode's kernels)", r"rest/direct=([\d.]+)x", lambda v: v <= 1.2, "x"),
    ("roundtrip", "MCP run_python (SDK client, streamable HTTP) <= 1.6x direct", r"mcp/direct=([\d.]+)x",
     lambda v: v <= 1.6, "x"),
    ("roundtrip", "tool call from kernel code: median <= 3 ms", r"tool_call=([\d.]+)ms", lambda v: v <= 3, " ms"),
    ("scale", "20-session throughput >= 0.85x of 20 bare kernels (tuned)", r"throughput20/direct=([\d.]+)x",
     lambda v: v >= 0.85, "x"),
    ("scale", "pool create + first execute <= 3x a warm execute", r"pool_create/exec=([\d.]+)x",
     lambda v: v <= 3, "x"),
    ("scale", "many live sessions keep latency <= 1.5x of one (200; --quick: 25)", r"exec\d+/exec1=([\d.]+)x",
     lambda v: v <= 1.5, "x"),
    ("load", "manager + gateway CPU per run under load <= 3 ms", r"cpu_ms_per_run manager=([\d.]+) gateway=([\d.]+)",
     lambda v: v <= 3, " ms"),
    ("realistic", "pandas groupby on 1 M rows -> 20-row frame, REST / direct (figure)", r"groupby: .*?= ([\d.]+)x",
     lambda v: True, "x"),
    ("realistic", "matplotlib figure harvested as an artifact, REST / direct (figure)", r"figure: .*?= ([\d.]+)x",
     lambda v: True, "x"),
]


def run_bench(name: str, quick: bool) -> tuple[str, float]:
    cmd = [sys.executable, str(REPO / "bench" / f"{name}.py"), "--no-write", *(["--quick"] if quick else [])]
    print(f"== {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    took = time.monotonic() - t0
    summary = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("SUMMARY")), "")
    print(f"   {took:.0f} s, exit {p.returncode}: {summary or p.stdout[-1500:]}", flush=True)
    return summary, took


def figure(pattern: str, summary: str) -> float | None:
    m = re.search(pattern, summary)
    if m is None:
        return None
    return sum(float(g) for g in m.groups())  # manager + gateway: the two groups add up


def verdicts(summaries: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(goal, figure, verdict, benchmark) for every goal of the benchmarks in ``summaries`` (their
    SUMMARY lines); verdict: met, NOT met, figure (a goal that is a figure only) or no figure."""
    rows = []
    for bench, goal, pattern, ok, unit in GOALS:
        if bench not in summaries:
            continue
        v = figure(pattern, summaries[bench])
        verdict = "no figure" if v is None else ("figure" if "(figure)" in goal else ("met" if ok(v) else "NOT met"))
        rows.append((goal, "-" if v is None else f"{v:.2f}{unit}", verdict, bench))
    return rows


def exit_code(rows: list[tuple[str, str, str, str]]) -> int:
    """0 when every row is met (or a figure only); 1 when a goal is not met or has no figure."""
    return 0 if all(r[2] in ("met", "figure") for r in rows) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each benchmark's --quick (a few minutes in all)")
    p.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    args = p.parse_args()
    only = [b for b in args.only.split(",") if b]
    unknown = set(only) - set(BENCHES)
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    if not os.environ.get("KERNELMODE_SANDBOX__KERNEL_PYTHON") and not (REPO / ".kernel-venv").is_dir():
        p.error("no kernel venv: run `make setup` (or set KERNELMODE_SANDBOX__KERNEL_PYTHON)")
    load_start = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    summaries = {name: run_bench(name, args.quick)[0] for name in only}
    load_end = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = verdicts(summaries)
    w = max(len(r[0]) for r in rows) if rows else 10
    print(f"\nGoals of issue 18 ({'--quick' if args.quick else 'full'} runs; load average {load_start} at the "
          f"start, {load_end} at the end, {os.cpu_count()} CPUs)\n")
    print(f"{'goal':<{w}}  {'figure':>9}  {'verdict':<9}  benchmark")
    for goal, v, verdict, bench in rows:
        print(f"{goal:<{w}}  {v:>9}  {verdict:<9}  bench/{bench}.py")
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
