"""Warm round-trip latency of `1+1`: direct ipykernel vs kernelmode's REST and MCP APIs vs a stock gateway.

Run:  .venv/bin/python bench/roundtrip.py [--samples N] [--quick] [--no-write]

These paths are measured in one run, interleaved round-robin in batches (the order of the paths
rotates every round) so that machine noise hits all of them alike:

  direct    jupyter_client -> ipykernel (the kernel-venv's python, no sandbox, no gateway):
            execute_request until both execute_reply (shell) and status idle (iopub) arrived.
            This is the floor: the cost of the kernel itself plus ZMQ. Tuned like kernelmode's
            kernels (direct_kernels.tuned_kernel_args: history in memory, no 0.5 ms pause before the
            reply), so that rest / direct, the goal ratio, is the cost of the hops.
  stock_direct  the same with IPython's defaults (sqlite history, the pause): for context.
  rest      POST /v1/sessions/{id}/execute {"code": "1+1"} on a real `kernelmode serve`
            (tests.support.server.start_server: Kernel Gateway + bwrap-sandboxed kernel), one
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
from direct_kernels import DirectKernel
from harness import (
    CODE,
    EXPECTED,
    MSG_TIMEOUT,
    REPO,
    Stats,
    WsKernel,
    interleave,
    ms_since,
    sampling_main,
)
from mcp.client.client import Client as McpClient
from mcp.client.streamable_http import streamable_http_client
from roundtrip_report import (
    GOAL,
    MCP_GOAL,
    PATHS,
    roundtrip_machine_info,
    summary_line,
    table,
    write_markdown,
)
from servers import RestSession

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


# -- main --------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-", dir="/tmp"))
    direct = DirectKernel(tmp / "direct", args.direct_transport)
    stock_direct = DirectKernel(tmp / "stock_direct", args.direct_transport, stock=True)
    for d in ("direct", "stock_direct"):
        (tmp / d).mkdir()
    rest = RestSession()
    mcp = McpSession(rest)
    stock = StockGateway(tmp)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(direct.stop)
        stack.push_async_callback(stock_direct.stop)
        stack.push_async_callback(stock.stop)
        stack.push_async_callback(rest.stop)

        print("starting: direct kernels (tuned, stock), stock kernel gateway, kernelmode serve, MCP client ...", flush=True)
        await asyncio.gather(direct.start(), stock_direct.start(), stock.start())
        await rest.start()
        # Entered here, in this task, and left by the exit stack in this task too (before
        # rest.stop, so the MCP client disconnects and closes its session while the server runs).
        await stack.enter_async_context(mcp.connect())
        paths: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip, "stock_direct": stock_direct.roundtrip, "rest": rest.roundtrip, "rest_httpx": rest.roundtrip_httpx,
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
    print(f"goal REST median <= {GOAL}x direct (tuned like kernelmode's kernels): "
          f"{'met' if ratio <= GOAL else 'NOT met'} ({ratio:.2f}x; "
          f"{stats['rest'].median / stats['stock_direct'].median:.2f}x a stock ipykernel)")
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
