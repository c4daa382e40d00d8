"""Warm round-trip latency of `1+1`: direct ipykernel vs kernelmode's REST and MCP APIs vs a stock gateway.

Run:  .venv/bin/python bench/roundtrip.py [--samples N] [--quick] [--no-write]

These paths are measured in one run, interleaved round-robin in batches (the order of the paths
rotates every round) so that machine noise hits all of them alike:

  direct    jupyter_client -> ipykernel (the kernel-venv's python, no sandbox, no gateway):
            execute_request until both execute_reply (shell) and status idle (iopub) arrived.
            This is the floor: the cost of the kernel itself plus ZMQ.
  rest      POST /v1/sessions/{id}/execute {"code": "1+1"} on a real `kernelmode serve`
            (tests.conftest.start_server: Kernel Gateway + bwrap-sandboxed kernel), one
            keep-alive http.client.HTTPConnection. The server answers after execute_reply + idle, so this is
            the same round trip plus HTTP, the manager, the gateway websocket and the sandbox.
  rest_httpx  the same POST through a keep-alive httpx.Client.
  mcp       the MCP tool call run_python {"code": "1+1"} on the same `kernelmode serve`, from the
            official mcp SDK's Client over streamable HTTP (<url>/mcp, httpx2, SSE responses),
            timed until call_tool returns; the connection's own session (made by the warm-up).
  stock_kg  a stock `python -m kernel_gateway` (default settings: Nagle left on for kernel
            websockets) and its default python3 kernel, driven over the kernel websocket with
            the `websockets` library until execute_reply + idle. For context only.

Everything started is stopped at the end, also on failure or Ctrl-C/SIGTERM. The results are
printed as a table, written as markdown to bench/RESULTS.md (unless --no-write), and the very
last line printed is a one-line SUMMARY.
"""


from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
from harness import (
    CODE,
    EXPECTED,
    MSG_TIMEOUT,
    REPO,
    DirectKernel,
    Stats,
    WsKernel,
    interleave,
    loadavg,
    machine_info,
    ms_since,
    sampling_main,
    verdict,
    version,
    write_page,
)
from mcp.client.client import Client as McpClient
from mcp.client.streamable_http import streamable_http_client
from servers import RestSession

GOAL = 1.2  # the project's goal (issue 18): REST median <= 1.2x the direct round trip
MCP_GOAL = 1.6  # and MCP run_python over streamable HTTP <= 1.6x direct
PATHS = ("direct", "rest", "rest_httpx", "mcp", "stock_kg")


# -- the paths ------------------------------------------------------------------------------------


async def tool_calls(rest: RestSession, n: int) -> list[float]:
    """Per-call latency (ms) of ``n`` calls of a trivial host tool, timed inside the kernel."""
    assert rest.client is not None
    code = (
        "import json as _j, time as _t\n_ts = []\n"
        f"for _i in range({n}):\n"
        "    _s = _t.perf_counter(); tools.add(_i, 1); _ts.append((_t.perf_counter() - _s) * 1000)\n"
        "_j.dumps(_ts)"
    )
    r = rest.client.post(f"/v1/sessions/{rest.sid}/execute", json={"code": code, "timeout_seconds": 600})
    body = r.json()
    if body.get("status") != "ok":
        raise RuntimeError(f"tool-call cell failed: {body!r}"[:2000])
    return [float(x) for x in json.loads(ast.literal_eval(body["result"]))]


def _lone_exception(e: BaseException) -> BaseException:
    """The single exception inside (nested) exception groups of one member each, else ``e``."""
    while True:
        inner = getattr(e, "exceptions", None)  # a BaseExceptionGroup (3.11+ or the backport)
        if not (isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException)):
            return e
        e = inner[0]


class McpSession:
    """The mcp SDK's Client over streamable HTTP to the `kernelmode serve` of a RestSession.

    ``connect()`` is an async context manager: the SDK's Client runs anyio task groups, which
    must be entered and left in the same task, so the caller enters it in its own task (the
    benchmark's exit stack) rather than in a helper task.
    """

    def __init__(self, rest: RestSession | Any) -> None:
        """``rest``: anything with a started ``server`` (``url``, ``token``), e.g. a RestSession."""
        self.rest = rest
        self.client: McpClient | None = None
        self.session_id: str | None = None
        self._args = {"code": CODE}

    @contextlib.asynccontextmanager
    async def connect(self) -> Any:
        srv = self.rest.server
        assert srv is not None
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {srv.token}"},
                                  timeout=httpx2.Timeout(30, read=300))
        try:
            async with McpClient(streamable_http_client(srv.url + "/mcp", http_client=http),
                                 read_timeout_seconds=MSG_TIMEOUT) as client:
                self.client = client
                try:
                    yield self
                finally:
                    self.client = None
                    if self.session_id is not None:  # this connection's own kernel session
                        with contextlib.suppress(Exception):
                            with anyio.fail_after(15):
                                await client.call_tool("close_session", {})
        except BaseException as e:
            # The SDK's task groups wrap whatever the benchmark raised inside them (any path's
            # failure, a cancellation) in exception groups: hand a lone exception on as itself.
            lone = _lone_exception(e)
            if lone is not e:
                raise lone from None
            raise
        finally:
            await http.aclose()

    async def roundtrip(self) -> float:
        client = self.client
        assert client is not None
        t0 = time.perf_counter_ns()
        r = await client.call_tool("run_python", self._args)
        elapsed = ms_since(t0)
        sc = r.structured_content or {}
        if r.is_error or sc.get("status") != "ok" or sc.get("result") != EXPECTED:
            text = " ".join(getattr(c, "text", "") for c in r.content)
            raise RuntimeError(f"MCP run_python answered is_error={r.is_error} {sc!r} {text!r}"[:2000])
        self.session_id = sc.get("session_id", self.session_id) or "?"
        return elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StockGateway:
    """`python -m kernel_gateway` with default settings and its default python3 kernel."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.token = secrets.token_urlsafe(24)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.kernel_id: str | None = None
        self.ws: WsKernel | None = None
        self.log_path = tmp / "stock-kg.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    async def start(self) -> None:
        home = self.tmp / "home"
        home.mkdir(mode=0o700)
        env = {  # minimal: no secret of ours reaches the gateway or its kernel
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_PLATFORM_DIRS": "1",
        }
        self.port = _free_port()
        self.proc = self._spawn(env, home)
        async with httpx.AsyncClient(base_url=self.url, headers=self._headers(), timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"stock kernel gateway exited:\n{self.log_tail()}")
                try:
                    r = await c.get("/api/kernelspecs")
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stock kernel gateway not ready:\n{self.log_tail()}")
                await asyncio.sleep(0.1)
            r = await c.post("/api/kernels", json={"name": "python3"}, timeout=60)
            if r.status_code != 201:
                raise RuntimeError(f"stock gateway POST /api/kernels: {r.status_code} {r.text}")
            self.kernel_id = r.json()["id"]
        self.ws = await WsKernel.open(self.url, self.token, self.kernel_id)

    def _spawn(self, env: dict[str, str], home: Path) -> subprocess.Popen[bytes]:
        with open(self.log_path, "wb") as logf:
            return subprocess.Popen(
                [sys.executable, "-m", "kernel_gateway",
                 "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={self.port}",
                 "--KernelGatewayApp.port_retries=0", f"--KernelGatewayApp.auth_token={self.token}"],
                env=env, cwd=str(home), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                start_new_session=True,
            )

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    async def roundtrip(self) -> float:
        assert self.ws is not None
        return await self.ws.roundtrip()

    async def stop(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.proc is None:
            return
        if self.kernel_id is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                async with httpx.AsyncClient(base_url=self.url, headers=self._headers()) as c:
                    await c.delete(f"/api/kernels/{self.kernel_id}", timeout=15)
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the gateway shuts its kernels down
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in its process group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


# -- reporting ------------------------------------------------------------------------------------------


LABELS = {
    "direct": "direct (jupyter_client -> ipykernel, unsandboxed)",
    "rest": "rest (kernelmode REST API, bwrap sandbox)",
    "rest_httpx": "rest_httpx (the same through httpx)",
    "mcp": "mcp (MCP run_python over streamable HTTP, mcp SDK client)",
    "stock_kg": "stock_kg (stock Kernel Gateway websocket, Nagle on)",
}


def table(stats: dict[str, Stats], markdown: bool) -> str:
    direct = stats["direct"].median
    head = ["path", "N", "median ms", "p95 ms", "p99 ms", "min ms", "mean ms", "median / direct"]
    rows = []
    for name in PATHS:
        s = stats[name]
        rows.append([LABELS[name] if markdown else name, str(s.n), f"{s.median:.3f}",
                     f"{s.pct(95):.3f}", f"{s.pct(99):.3f}", f"{min(s.samples):.3f}",
                     f"{s.mean:.3f}", f"{s.median / direct:.2f}x"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out)


def roundtrip_machine_info(rest: RestSession) -> dict[str, str]:
    sandbox = rest.ready.get("sandbox", {}) if isinstance(rest.ready.get("sandbox"), dict) else {}
    return {
        **machine_info("direct and kernelmode kernels", "python (manager, gateways, stock kernel)"),
        "jupyter_client": version("jupyter_client"),
        "ipykernel (venv)": version("ipykernel"),
        "jupyter_kernel_gateway": version("jupyter_kernel_gateway"),
        "jupyter_server": version("jupyter_server"),
        "tornado": version("tornado"),
        "websockets": version("websockets"),
        "httpx": version("httpx"),
        "mcp (SDK: server in kernelmode, client here) / httpx2": f"{version('mcp')} / {version('httpx2')}",
        "pyzmq": version("pyzmq"),
        "load average (1, 5, 15 min) at the end": loadavg(),
        "kernelmode sandbox backend": (
            f"{rest.session_sandbox or sandbox.get('backend', '?')}"
            + (f" ({sandbox.get('detail')}; limits: {sandbox.get('limits')})" if sandbox.get("detail") else "")
        ),
    }


def _tool_table(s: Stats) -> str:
    return ("| N | median ms | p95 ms | p99 ms | min ms | mean ms |\n|---|---|---|---|---|---|\n"
            f"| {s.n} | {s.median:.3f} | {s.pct(95):.3f} | {s.pct(99):.3f} | {min(s.samples):.3f} | "
            f"{s.mean:.3f} |")


def summary_line(stats: dict[str, Stats]) -> str:
    d, r, h, m, k = (stats[p].median for p in PATHS)
    return (f"SUMMARY rest/direct={r / d:.2f}x rest_httpx/direct={h / d:.2f}x "
            f"mcp/direct={m / d:.2f}x stock_kg/direct={k / d:.1f}x "
            f"tool_call={stats['tool_call'].median:.3f}ms "
            f"(median ms: direct={d:.3f} rest={r:.3f} rest_httpx={h:.3f} mcp={m:.3f} stock_kg={k:.3f})")


# Other benchmarks keep sections of their own in RESULTS.md between a line starting with
# SECTION_BEGIN and the matching SECTION_END line (bench/load.py): rewriting the file keeps them.
def write_markdown(path: Path, stats: dict[str, Stats], info: dict[str, str],
                   args: argparse.Namespace, wall_s: float) -> None:
    d, r, h, m, k = (stats[p].median for p in PATHS)
    ratio = r / d
    machine = "\n".join(f"| {key} | {val} |" for key, val in info.items())
    info_mcp = version("mcp")
    text = f"""# Round-trip latency: kernelmode REST and MCP vs direct ipykernel

Generated by `{' '.join(['bench/roundtrip.py', *sys.argv[1:]])}` on {info['date']},
{stats['direct'].n} samples per path, interleaved in batches of {args.batch}, after {args.warmup}
warm-up runs per path; wall time {wall_s:.0f} s.

## Result

{table(stats, markdown=True)}

- **REST / direct (median): {ratio:.2f}x** — the project's goal is REST median <= {GOAL}x the direct
  round trip: {verdict(ratio <= GOAL)} ({r - d:.3f} ms added per call on top of {d:.3f} ms).
- the same REST call through httpx instead of http.client: {h / d:.2f}x (httpx spends ~0.5 ms
  more CPU per request in the client; see bench/PROFILE.md).
- the MCP tool call `run_python` from the mcp SDK's client: {m / d:.2f}x direct, {m / r:.2f}x REST
  ({m - r:.3f} ms more than the REST call per round trip); goal <= {MCP_GOAL}x direct:
  {verdict(m / d <= MCP_GOAL)}.
- stock Kernel Gateway / direct (median): {k / d:.1f}x.

### Tool calls from kernel code

{_tool_table(stats['tool_call'])}

Each sample is one call `tools.add(i, 1)` of a trivial Python host tool, timed with
`time.perf_counter()` inside the sandboxed kernel, in cells of consecutive calls: the kernel's
request travels as a stdin `input_request` through the gateway websocket to the manager, which
validates it, runs the tool and answers with an `input_reply`. Goal: median <= 3 ms per call.

`{summary_line(stats)}`

Session creation (warm pool and cold), throughput with 1/5/20 sessions, memory per idle session
and growth to 200 live sessions: [SCALE.md](SCALE.md) (`bench/scale.py`), with
[a chart of latency against live sessions](growth.png). Many sessions executing at once, every
reply checked, and the manager's memory under output floods: the Load section at the end of this
file (`bench/load.py`).

## Method

Every sample is one warm execution of `{CODE}` in an already running kernel, timed with
`time.perf_counter_ns()` in the benchmark process, from just before the request is built/sent to
the moment the last required message has arrived:

- **direct** — the floor. An unsandboxed ipykernel (`.kernel-venv/bin/python -m ipykernel_launcher`,
  the same Python environment the sandboxed kernels use) started with jupyter_client's
  `AsyncKernelManager` (ZMQ transport: {args.direct_transport}, as kernelmode's gateway uses; HOME and
  IPYTHONDIR on tmpfs, as the sandbox's /tmp is), driven by `AsyncKernelClient`: `execute()`
  until the shell `execute_reply` **and** the iopub `status: idle` of that request have both
  arrived (and the `execute_result` is `'2'`). No gateway, no sandbox, no HTTP.
- **rest** — `POST /v1/sessions/{{id}}/execute {{"code": "1+1"}}` on a real `kernelmode serve`
  (started by `tests.conftest.start_server`, sandbox backend bwrap), through one persistent
  keep-alive `http.client.HTTPConnection` (a lean client, so that the figure is the service's
  cost rather than the client library's); `rest_httpx` is the same through a keep-alive
  `httpx.Client`. Timed until the whole JSON response is read (status 200,
  `result == '2'`). The server itself answers only after execute_reply + idle, so this is the direct
  round trip plus: HTTP request parsing/auth/validation, the session manager (lock, output
  collection, the SQLite run record), the manager -> gateway websocket (Nagle disabled by
  `kernelmode/gateway/kg_extensions.py`), the gateway's websocket <-> ZMQ bridge (ipc transport),
  and the bubblewrap sandbox around the kernel.
- **mcp** — the MCP tool call `run_python {{"code": "1+1"}}` to the same `kernelmode serve` (same
  process as `rest`) at `/mcp` over streamable HTTP, from the official mcp SDK's `Client`
  (mcp {info_mcp}, HTTP through an `httpx2.AsyncClient`). The client asks for no progress and
  declares no elicitation, so the server answers each call as one JSON body (`mcp.json_answers`;
  the client keeps its TCP connection) on kernelmode's direct route for `run_python`
  (`mcp.fast_calls`; `bench/mcp_ab.py` compares it with the SDK's route). Timed around
  `await client.call_tool(...)` until the `CallToolResult` is back and parsed
  (`structured_content["result"] == '2'`). The connection's own kernel session is created by the
  first (warm-up) call. On top of the REST path's work: JSON-RPC framing and validation on both
  ends, the client SDK's task plumbing (anyio memory streams between its tasks) and its HTTP
  client, and the client's jsonschema check of `structured_content` against the tool's output
  schema; the client's CPU (about 4 ms per call against 0.5 for REST's http.client) shares the
  machine's CPUs with the server.
- **stock_kg** — for context: a stock `python -m kernel_gateway` with default settings (only ip,
  port, token set; minimal environment) and its default `python3` kernel (the venv's ipykernel),
  driven with the `websockets` library over the kernel websocket until execute_reply + idle. Its
  tornado websocket leaves Nagle's algorithm on, so a request answered by several messages waits
  for the client's delayed ACK (~40 ms on Linux) — the pitfall kernelmode's gateway extension fixes.

The paths run in one process, one after the other, round-robin in batches of {args.batch}
samples with the order of the paths rotated each round, so that load and frequency changes on the
machine fall on all paths alike. Percentiles are linear interpolation between closest ranks.

What the numbers mean: `direct` is what executing code costs at all; `rest - direct` is
kernelmode's own overhead per call (two extra hops — HTTP and the gateway websocket — plus the
manager's bookkeeping); `mcp - rest` is what the MCP protocol layer (SDK on both ends) adds to
the same execution; `stock_kg` shows what an untuned gateway costs for the same exchange.
These are latencies of a mostly CPU-bound chain of Python processes: on a {info['nproc']}-CPU
machine the client, the manager, the gateway and the kernel share the CPUs, so every hop's CPU
time and wake-ups add up. Other work on the machine (load average in the table below) shifts all
numbers; the interleaving keeps the ratios comparable. `bench/profile_rest.py` breaks the
overhead down hop by hop, with CPU time per process (writes bench/PROFILE.md).

## Machine

| | |
|---|---|
{machine}
"""
    write_page(path, text)  # keeps the sections of other benchmarks (bench/load.py's, say)


# -- main --------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-", dir="/tmp"))
    direct = DirectKernel(tmp / "direct", args.direct_transport)
    (tmp / "direct").mkdir()
    rest = RestSession()
    mcp = McpSession(rest)
    stock = StockGateway(tmp)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(direct.stop)
        stack.push_async_callback(stock.stop)
        stack.push_async_callback(rest.stop)

        print("starting: direct kernel, stock kernel gateway, kernelmode serve, MCP client ...", flush=True)
        await asyncio.gather(direct.start(), stock.start())
        await rest.start()
        # Entered here, in this task, and left by the exit stack in this task too (before
        # rest.stop, so the MCP client disconnects and closes its session while the server runs).
        await stack.enter_async_context(mcp.connect())
        paths: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip, "rest": rest.roundtrip, "rest_httpx": rest.roundtrip_httpx,
            "mcp": mcp.roundtrip, "stock_kg": stock.roundtrip,
        }
        stats = {name: Stats(name) for name in PATHS}

        def progress(rnd: int, rounds: int) -> None:
            print(f"  round {rnd}/{rounds}: medians so far "
                  + ", ".join(f"{p}={stats[p].median:.3f}" for p in PATHS), flush=True)

        print(f"warming up ({args.warmup} runs each), then measuring: {args.samples} samples each "
              f"in rounds of {args.batch} ...", flush=True)
        await interleave({p: paths[p] for p in PATHS}, stats, args.samples, args.batch, args.warmup,
                         progress=progress)

        print("tool calls from kernel code ...", flush=True)
        tool = Stats("tool_call")
        for _ in range(3 if args.quick else 5):
            tool.samples += await tool_calls(rest, 200 if args.quick else 1000)
        stats["tool_call"] = tool
        info = roundtrip_machine_info(rest)
    # everything is stopped here
    wall = time.monotonic() - started
    print()
    print(table(stats, markdown=False))
    print()
    for key, val in info.items():
        print(f"  {key}: {val}")
    if not args.no_write:
        results_path = REPO / "bench" / "RESULTS.md"
        write_markdown(results_path, stats, info, args, wall)
        print(f"\nwrote {results_path.relative_to(REPO)}")
    t = stats["tool_call"]
    print(f"tool call from kernel code: median {t.median:.3f} ms, p95 {t.pct(95):.3f}, "
          f"p99 {t.pct(99):.3f} (N={t.n}); goal <= 3 ms: {'met' if t.median <= 3 else 'NOT met'}")
    m = stats["mcp"].median
    print(f"MCP run_python: {m / stats['direct'].median:.2f}x direct, {m / stats['rest'].median:.2f}x REST "
          f"(+{m - stats['rest'].median:.3f} ms per call over REST)")
    ratio = stats["rest"].median / stats["direct"].median
    print(f"goal MCP median <= {MCP_GOAL}x direct: {'met' if m / stats['direct'].median <= MCP_GOAL else 'NOT met'}")
    print(f"goal REST median <= {GOAL}x direct: {'met' if ratio <= GOAL else 'NOT met'} ({ratio:.2f}x)")
    print(summary_line(stats), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direct-transport", choices=["ipc", "tcp"], default="ipc",
                   help="ZMQ transport of the direct kernel (default ipc, as kernelmode's gateway uses)")
    return sampling_main(run, p)


if __name__ == "__main__":
    sys.exit(main())
