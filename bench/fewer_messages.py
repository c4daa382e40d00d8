"""Fewer messages per run (issue 18, S1): REST `1+1` on this checkout against another one, A/B.

Run:  .venv/bin/python bench/fewer_messages.py [--before REF] [--samples N] [--quick] [--no-write]

Two `kernelmode serve` (bwrap, pool_size 1) side by side: ``before`` runs the code of git REF
(default: where this branch left ``main``, their merge base; exported with `git archive` into a
scratch folder), ``after`` this checkout;
and a direct ipykernel (jupyter_client, unsandboxed) as the floor. Each server has a live
session ``warm``; its REST `1+1` is timed on one keep-alive connection, the three paths
interleaved round-robin in batches (harness ``interleave``), and the CPU time of the manager,
its gateway and the session's kernel (every thread, /proc schedstat) over each batch is divided
by the runs. Then the file agent's own per-run work (its change note: the workspace walk, the
comparison, the JSON) by workspace size, before and after, in this process (CPU time, best of
15 rounds). Writes the "fewer-messages" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from direct_kernels import DirectKernel
from harness import REPO, Stats, interleave, loadavg, sampling_main, write_section
from servers import CpuMeter, KmServer, before_checkout, kernel_pid

SIDES = ("before", "after")
PATHS = ("direct", *SIDES)
ROLES = ("manager", "gateway", "kernel")
WORKSPACES = (0, 10, 100, 1000)  # files, in 10 folders


def load_agent(path: Path, name: str) -> Any:
    """kernel/file_agent.py of one checkout as a module of its own (stdlib only, as in a kernel)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def agent_file(checkout: Path) -> Path:
    """The file agent of a checkout (kernel/files.py before it was named file_agent.py)."""
    kernel = checkout / "kernelmode" / "kernel"
    return kernel / "file_agent.py" if (kernel / "file_agent.py").is_file() else kernel / "files.py"


def note_costs(before: Path, scratch: Path) -> dict[int, dict[str, float]]:
    """Microseconds of CPU the file agent spends per run on its change note when nothing changed
    (walk, comparison, JSON), by files in the workspace: the best of 15 rounds of 40, interleaved."""
    agents = {"before": load_agent(agent_file(before), "km_files_before"),
              "after": load_agent(agent_file(REPO), "km_files_after")}
    out: dict[int, dict[str, float]] = {}
    for n in WORKSPACES:
        ws = scratch / f"ws{n}"
        ws.mkdir()
        for i in range(n):
            (ws / f"dir{i % 10}").mkdir(exist_ok=True)
            (ws / f"dir{i % 10}" / f"file{i}.csv").touch()
        for agent in agents.values():
            agent.configure({"root": str(ws)})
        best = dict.fromkeys(agents, float("inf"))
        for _ in range(15):
            for side, agent in agents.items():
                t0 = time.process_time_ns()
                for _ in range(40):
                    agent._json_buffer(agent._changes())
                best[side] = min(best[side], (time.process_time_ns() - t0) / 40 / 1000)
        out[n] = best
    return out


async def run(args: argparse.Namespace) -> int:
    started, load_start = time.monotonic(), loadavg()
    tmp, before_commit, after_commit = before_checkout(args.before, "kmbench-fewer-")
    (tmp / "direct").mkdir()
    notes = note_costs(tmp / "before", tmp)
    servers = {side: KmServer(side, {"KERNELMODE_SESSIONS__POOL_SIZE": "1"},
                              checkout=tmp / "before" if side == "before" else None) for side in SIDES}
    direct = DirectKernel(tmp / "direct")
    stats = {p: Stats(p) for p in PATHS}
    cpu = CpuMeter(stats)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(direct.stop)
        print(f"starting: direct kernel, serve from {before_commit} and from this "
              f"checkout ({after_commit}) ...", flush=True)
        await direct.start()
        for km in servers.values():
            stack.push_async_callback(km.stop)
            km.start()
        conns = {side: km.http() for side, km in servers.items()}
        cpu.watch("direct", kernel=direct.pid)
        for side, conn in conns.items():
            status, info = await conn.json("POST", "/v1/sessions", {"session_id": "warm"})
            if status != 201:
                raise RuntimeError(f"{side}: POST /v1/sessions: {status} {info}")
            km = servers[side]
            cpu.watch(side, manager=km.manager_pid, gateway=km.gateway_pid,
                      kernel=kernel_pid(km.gateway_pid, info["kernel_id"]))
        fns: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip,
            **{side: functools.partial(conn.execute, "warm") for side, conn in conns.items()}}
        print(f"measuring: {args.samples} samples per path ...", flush=True)
        await interleave(fns, stats, args.samples, args.batch, args.warmup, around=cpu.around)
        for conn in conns.values():
            await conn.close()
    text = report(stats, cpu, notes, args, before_commit, after_commit, time.monotonic() - started,
                  load_start, loadavg())
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", "fewer-messages", text)
    d = stats["direct"].median
    print(f"SUMMARY before/direct={stats['before'].median / d:.2f}x after/direct={stats['after'].median / d:.2f}x "
          + " ".join(f"{r}_ms_per_run before={cpu.per_run('before', r):.3f} "
                     f"after={cpu.per_run('after', r):.3f}" for r in ROLES), flush=True)
    return 0


def report(stats: dict[str, Stats], cpu: CpuMeter, notes: dict[int, dict[str, float]],
           args: argparse.Namespace,
           before_commit: str, after_commit: str, wall: float, load_start: str, load_end: str) -> str:
    d = stats["direct"].median
    labels = {"direct": "direct (jupyter_client -> ipykernel, unsandboxed)",
              "before": f"REST execute, before ({before_commit})",
              "after": f"REST execute, after (this branch, {after_commit})"}
    rows = []
    for p in PATHS:
        s = stats[p]
        cells = [f"{cpu.per_run(p, r):.3f}" if cpu.measured(p, r) else "" for r in ROLES]
        rows.append(f"| {labels[p]} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} | {s.median / d:.2f}x | "
                    + " | ".join(cells) + " |")
    delta = {r: cpu.per_run("after", r) - cpu.per_run("before", r) for r in ROLES}
    note_rows = "\n".join(f"| {n} | {c['before']:.0f} | {c['after']:.0f} |" for n, c in notes.items())
    return f"""## Fewer messages per run (issue 18, S1)

Generated by `bench/fewer_messages.py{' --quick' if args.quick else ''}` on
{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC: {args.samples} samples per path, interleaved in
batches of {args.batch} after {args.warmup} warm-ups; wall {wall:.0f} s; load average {load_start} at the
start, {load_end} at the end (a shared 2-CPU machine: the ratios and the CPU per run, measured in
this one run, are what count). Warm `1+1` on a live session; bwrap; one keep-alive connection.

| path | N | median ms | p95 ms | / direct | manager CPU ms/run | gateway CPU ms/run | kernel CPU ms/run |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

- after - before, CPU per run: manager {delta['manager']:+.3f} ms, gateway {delta['gateway']:+.3f} ms,
  kernel {delta['kernel']:+.3f} ms; median {stats['after'].median - stats['before'].median:+.2f} ms
  ({stats['before'].median / d:.2f}x -> {stats['after'].median / d:.2f}x direct).

What changed: the file agent's post-run change note rides in the cell's `execute_reply` (its
metadata) instead of a sixth message (an IOPub comm_msg), so a `1+1` run brings the manager the
five messages of a bare ipykernel (`tests/integration/test_files_channel.py`,
`tests/unit/test_change_note.py` count them); the gateway reads each IOPub message's header
with orjson, in place; and the preamble turns off ipykernel's 0.5 ms sleep before each
`execute_reply` (`Kernel._execute_sleep`, for frontends that stop reading at the reply: every
client of kernelmode reads a cell until its idle status). The preamble adds no other per-cell
work to the kernel: its only per-cell step is that note, whose cost grows with the workspace
(one `stat` per entry, a directory costs an open and a listing), below:

The file agent's change note per run, nothing changed (microseconds of CPU, in this process):

| files in the workspace (10 folders) | before | after |
|---|---|---|
{note_rows}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None,
                   help="git ref of the 'before' code (default: the merge base of HEAD and main)")
    return sampling_main(run, p)


if __name__ == "__main__":
    sys.exit(main())
