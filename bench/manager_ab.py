"""The manager's per-run work A/B: the same REST and MCP ``1+1`` on two `kernelmode serve`, one
from another checkout (``--before``, /work/main by default) and one from this one; latency and
the client's, manager's and gateway's CPU per request, interleaved in one run (issue 18).

Run:  .venv/bin/python bench/manager_ab.py [--before DIR] [--samples N] [--quick] [--no-write]

Each server runs from its own checkout (its cwd, so ``import kernelmode`` is that checkout's)
with the bwrap sandbox and a live session ``warm``; paths: ``execute`` (POST execute),
``get`` (GET /v1/sessions/warm: HTTP, auth and JSON with no kernel) and ``mcp`` (the tool call
``run_python`` from the official mcp SDK client over streamable HTTP, on the connection's own
session) on each, round-robin in batches of 10 after warm-ups. CPU per request: on-CPU time of
every thread of the serving manager and its gateway over each batch (the other server idles
meanwhile), and of this process (the client). Writes the "manager-ab" section of
bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
from harness import (
    REPO,
    Stats,
    add_sampling_args,
    interleave,
    loadavg,
    run_stoppable,
    sampling_args,
    write_section,
)
from procfs import cpu_ns, ptable
from roundtrip import McpSession

BATCH = 10


@dataclass
class Serve:
    """One `kernelmode serve` run from ``checkout``."""

    name: str
    checkout: Path
    proc: subprocess.Popen[str]
    url: str
    token: str
    data_dir: Path

    @classmethod
    def start(cls, name: str, checkout: Path) -> Serve:
        data_dir = Path(tempfile.mkdtemp(prefix=f"kmab-{name}-", dir="/tmp"))
        data_dir.chmod(0o711)
        token = "t" + secrets.token_urlsafe(16)
        env = {**os.environ, "KERNELMODE_TOKEN": token, "KERNELMODE_SESSIONS__TTL_SECONDS": "86400"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
             "--sandbox", "bwrap"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(checkout))
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (http://\S+)", line)
            if m:
                return cls(name, checkout, proc, m.group(1), token, data_dir)
        proc.kill()
        raise RuntimeError(f"{name}: kernelmode serve did not start")

    def gateway_pid(self) -> int:
        kids = [pid for pid, ppid in ptable().items() if ppid == self.proc.pid]
        for pid in kids:
            with contextlib.suppress(OSError):
                if b"kernel_gateway" in Path(f"/proc/{pid}/cmdline").read_bytes() or \
                        b"kg_" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        if len(kids) == 1:
            return kids[0]
        raise RuntimeError(f"{self.name}: no gateway among {kids}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def probes(c: httpx.AsyncClient) -> dict[str, Callable[[], Awaitable[float]]]:
    async def execute() -> float:
        t0 = time.perf_counter_ns()
        r = await c.post("/v1/sessions/warm/execute", json={"code": "1+1"})
        ms = (time.perf_counter_ns() - t0) / 1e6
        assert r.json()["result"] == "2", r.text
        return ms

    async def get() -> float:
        t0 = time.perf_counter_ns()
        r = await c.get("/v1/sessions/warm")
        ms = (time.perf_counter_ns() - t0) / 1e6
        assert r.status_code == 200, r.text
        return ms
    return {"execute": execute, "get": get}


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    servers: dict[str, Serve] = {}
    stats: dict[str, Stats] = {}
    cpu: dict[str, list[int]] = {}  # manager ns, gateway ns, requests
    async with contextlib.AsyncExitStack() as stack:
        for name, checkout in (("before", args.before), ("after", REPO)):
            print(f"starting {name} ({checkout}) ...", flush=True)
            srv = Serve.start(name, checkout)
            stack.callback(srv.stop)
            servers[name] = srv
        fns: dict[str, Callable[[], Awaitable[float]]] = {}
        pids: dict[str, tuple[int, int]] = {}
        for name, srv in servers.items():
            c = httpx.AsyncClient(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {srv.token}"})
            stack.push_async_callback(c.aclose)
            assert (await c.post("/v1/sessions", json={"session_id": "warm"})).status_code == 201
            mcp = McpSession(SimpleNamespace(server=srv))
            await stack.enter_async_context(mcp.connect())
            for probe, fn in {**probes(c), "mcp": mcp.roundtrip}.items():
                fns[f"{probe}_{name}"] = fn
                pids[f"{probe}_{name}"] = (srv.proc.pid, srv.gateway_pid())
        for path in fns:
            stats[path], cpu[path] = Stats(path), [0, 0, 0, 0]

        @contextlib.contextmanager
        def account(path: str) -> Iterator[None]:
            before = [cpu_ns(p) for p in pids[path]]
            client0 = time.process_time_ns()
            n0 = stats[path].n
            yield
            after = [cpu_ns(p) for p in pids[path]]
            cpu[path][0] += after[0] - before[0]
            cpu[path][1] += after[1] - before[1]
            cpu[path][2] += stats[path].n - n0
            cpu[path][3] += time.process_time_ns() - client0

        print(f"measuring: {args.samples} samples per path ...", flush=True)
        await interleave(fns, stats, args.samples, BATCH, args.warmup, around=account)
    text = report(stats, cpu, args, time.monotonic() - started, load_start, loadavg())
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", "manager-ab", text)
    return 0


def per_req(cpu: dict[str, list[int]], path: str, i: int) -> float:
    return cpu[path][i] / 1e6 / max(cpu[path][2], 1)


def report(stats: dict[str, Stats], cpu: dict[str, list[int]], args: argparse.Namespace, wall: float,
           load_start: str, load_end: str) -> str:
    rows = [f"| {p} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} | {per_req(cpu, p, 3):.3f} | "
            f"{per_req(cpu, p, 0):.3f} | {per_req(cpu, p, 1):.3f} |" for p, s in stats.items()]
    ex_b, ex_a = stats["execute_before"].median, stats["execute_after"].median
    mcp_b, mcp_a = stats["mcp_before"].median, stats["mcp_after"].median
    return f"""### REST and MCP A/B, before ({args.before}) vs after (this checkout) (bench/manager_ab.py)

Generated by `bench/manager_ab.py{' --quick' if args.quick else ''}` on
{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC: {args.samples} samples per path, interleaved in
batches of {BATCH} after {args.warmup} warm-ups; wall {wall:.0f} s; load average {load_start} at the
start, {load_end} at the end (a shared 2-CPU machine: the ratios and CPU per request, measured in
this one run, are what count). Warm `1+1`, bwrap; REST through httpx keep-alive, MCP from the mcp
SDK's client (httpx2).

| path | N | median ms | p95 ms | client CPU ms/req | manager CPU ms/req | gateway CPU ms/req |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

- execute: after/before median {ex_a / ex_b:.3f}; manager CPU per run {per_req(cpu, 'execute_before', 0):.3f} ->
  {per_req(cpu, 'execute_after', 0):.3f} ms; GET: {per_req(cpu, 'get_before', 0):.3f} ->
  {per_req(cpu, 'get_after', 0):.3f} ms.
- MCP run_python: after/before median {mcp_a / mcp_b:.3f} ({mcp_b:.2f} -> {mcp_a:.2f} ms); client CPU per
  call {per_req(cpu, 'mcp_before', 3):.3f} -> {per_req(cpu, 'mcp_after', 3):.3f} ms; manager CPU per call
  {per_req(cpu, 'mcp_before', 0):.3f} -> {per_req(cpu, 'mcp_after', 0):.3f} ms.
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p)
    p.add_argument("--before", type=Path, default=Path("/work/main"), help="the checkout to compare with")
    p.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS.md")
    args = p.parse_args()
    sampling_args(p, args)
    if not (args.before / "kernelmode" / "__init__.py").is_file():
        p.error(f"{args.before} is not a kernelmode checkout")
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
