"""MCP fast calls A/B: the same MCP ``run_python`` through kernelmode's direct route
(``mcp.fast_calls: true``, the default) and through the MCP SDK (``false``), with REST and a
direct ipykernel as references; latency and the manager's CPU per call, all in one run.

Run:  .venv/bin/python bench/mcp_ab.py [--samples N] [--quick] [--no-write]

Two `kernelmode serve` (bwrap), one per setting, and one direct ipykernel; paths interleaved
round-robin in batches of 10 after warm-up runs. CPU per call: on-CPU time of every thread of
the serving manager (and its gateway) over each batch, divided by the calls (the other server
idles meanwhile). Writes the "mcp-fast-calls" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from harness import (
    REPO,
    DirectKernel,
    RestSession,
    Stats,
    interleave,
    loadavg,
    small_bench_main,
    write_section,
)
from procfs import cpu_ns
from roundtrip import McpSession

BATCH = 10
PATHS = ("direct", "rest", "mcp_fast", "mcp_sdk")
LABELS = {
    "direct": "direct (jupyter_client -> ipykernel, unsandboxed)",
    "rest": "REST execute (http.client keep-alive)",
    "mcp_fast": "MCP run_python, direct route (`mcp.fast_calls: true`)",
    "mcp_sdk": "MCP run_python through the SDK (`mcp.fast_calls: false`)",
}


async def start_rest(fast: bool) -> RestSession:
    """A RestSession whose server runs with ``mcp.fast_calls`` as given (the server inherits
    this process's environment when it starts)."""
    os.environ["KERNELMODE_MCP__FAST_CALLS"] = "true" if fast else "false"
    try:
        rest = RestSession()
        await rest.start()
        return rest
    finally:
        os.environ.pop("KERNELMODE_MCP__FAST_CALLS", None)


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-", dir="/tmp"))
    (tmp / "direct").mkdir()
    direct = DirectKernel(tmp / "direct")
    stats = {p: Stats(p) for p in PATHS}
    cpu: dict[str, list[int]] = {p: [0, 0, 0, 0] for p in PATHS}  # manager ns, gateway ns, calls, client ns
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(direct.stop)
        print("starting: direct kernel, two kernelmode serve (fast_calls true / false) ...", flush=True)
        await direct.start()
        fast = await start_rest(True)
        stack.push_async_callback(fast.stop)
        sdk = await start_rest(False)
        stack.push_async_callback(sdk.stop)
        mcp_fast, mcp_sdk = McpSession(fast), McpSession(sdk)
        await stack.enter_async_context(mcp_fast.connect())
        await stack.enter_async_context(mcp_sdk.connect())
        server_of = {"rest": fast, "mcp_fast": fast, "mcp_sdk": sdk}
        fns: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip, "rest": fast.roundtrip,
            "mcp_fast": mcp_fast.roundtrip, "mcp_sdk": mcp_sdk.roundtrip}

        @contextlib.contextmanager
        def account(name: str) -> Iterator[None]:
            rest = server_of.get(name)
            pids = () if rest is None or rest.km is None else (rest.km.manager_pid, rest.km.gateway_pid)
            before = [cpu_ns(p) for p in pids]
            n0, c0 = stats[name].n, time.process_time_ns()
            yield
            cpu[name][3] += time.process_time_ns() - c0  # this process: the client's side
            after = [cpu_ns(p) for p in pids]
            for i, (a, b) in enumerate(zip(after, before, strict=True)):
                cpu[name][i] += a - b
            cpu[name][2] += stats[name].n - n0

        print(f"measuring: {args.samples} samples per path ...", flush=True)
        await interleave(fns, stats, args.samples, BATCH, args.warmup, around=account)
    wall = time.monotonic() - started
    text = report(stats, cpu, args, wall, load_start, loadavg())
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", "mcp-fast-calls", text)
    d = stats["direct"].median
    print(f"SUMMARY mcp_fast/direct={stats['mcp_fast'].median / d:.2f}x mcp_sdk/direct="
          f"{stats['mcp_sdk'].median / d:.2f}x rest/direct={stats['rest'].median / d:.2f}x "
          f"manager_ms_per_call fast={per_call(cpu, 'mcp_fast', 0):.2f} sdk={per_call(cpu, 'mcp_sdk', 0):.2f} "
          f"rest={per_call(cpu, 'rest', 0):.2f}", flush=True)
    return 0


def per_call(cpu: dict[str, list[int]], name: str, i: int) -> float:
    return cpu[name][i] / 1e6 / max(cpu[name][2], 1)


def report(stats: dict[str, Stats], cpu: dict[str, list[int]], args: argparse.Namespace, wall: float,
           load_start: str, load_end: str) -> str:
    d = stats["direct"].median
    rows = []
    for p in PATHS:
        s = stats[p]
        mgr = f"{per_call(cpu, p, 0):.2f}" if cpu[p][0] else ""
        gw = f"{per_call(cpu, p, 1):.2f}" if cpu[p][1] else ""
        rows.append(f"| {LABELS[p]} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} | {s.median / d:.2f}x | "
                    f"{per_call(cpu, p, 3):.2f} | {mgr} | {gw} |")
    return f"""## MCP fast calls: run_python on the direct route vs through the SDK (bench/mcp_ab.py)

Generated by `bench/mcp_ab.py{' --quick' if args.quick else ''}` on
{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC: {args.samples} samples per path, interleaved in
batches of {BATCH} after {args.warmup} warm-ups; wall {wall:.0f} s; load average {load_start} at the
start, {load_end} at the end (a shared 2-CPU machine: the ratios and CPU per call, measured in
this one run, are what count). Warm `1+1`; MCP from the official SDK client over streamable HTTP.

| path | N | median ms | p95 ms | / direct | client CPU ms/call | manager CPU ms/call | gateway CPU ms/call |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

- the direct route: {stats['mcp_fast'].median / d:.2f}x direct against {stats['mcp_sdk'].median / d:.2f}x
  through the SDK; the manager's CPU per call {per_call(cpu, 'mcp_fast', 0):.2f} ms against
  {per_call(cpu, 'mcp_sdk', 0):.2f} ms (REST: {per_call(cpu, 'rest', 0):.2f} ms).
- client CPU: the benchmark process (the MCP SDK client with httpx2, http.client for REST,
  jupyter_client for direct) shares the 2 CPUs with the server, so its work per call is part of
  every latency above.
"""


if __name__ == "__main__":
    sys.exit(small_bench_main(__doc__, run, samples=300, warmup=20, quick_samples=60))
