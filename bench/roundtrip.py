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
import datetime as dt
import http.client
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import httpx2
import websockets
from jupyter_client.jsonutil import json_default
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.session import Session as JupyterSession
from mcp.client.client import Client as McpClient
from mcp.client.streamable_http import streamable_http_client

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.conftest import Server, start_server  # noqa: E402  (needs the repo root on sys.path)

KERNEL_PYTHON = REPO / ".kernel-venv" / "bin" / "python"
CODE = "1+1"
EXPECTED = "2"
GOAL = 1.3  # the project's goal: REST median <= 1.3x the direct round trip
PATHS = ("direct", "rest", "rest_httpx", "mcp", "stock_kg")
MSG_TIMEOUT = 30.0


def now_ms(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e6


# -- the paths ------------------------------------------------------------------------------------


def _tmpfs_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class DirectKernel:
    """An unsandboxed ipykernel (kernel-venv python) driven with jupyter_client."""

    def __init__(self, tmp: Path, transport: str) -> None:
        self.tmp = tmp
        self.transport = transport
        self.km: AsyncKernelManager | None = None
        self.kc: Any = None
        self.log_path = tmp / "direct-kernel.log"
        self.home: Path | None = None

    async def start(self) -> None:
        spec_dir = self.tmp / "kernels" / "kmbench-direct"
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "display_name": "kmbench direct (kernel-venv)",
            "language": "python",
            "argv": [str(KERNEL_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        }))
        ksm = KernelSpecManager(kernel_dirs=[str(self.tmp / "kernels")], ensure_native_kernel=False)
        runtime = self.tmp / "runtime"
        runtime.mkdir()
        self.km = AsyncKernelManager(
            kernel_name="kmbench-direct", kernel_spec_manager=ksm,
            connection_file=str(runtime / "kernel-direct.json"), transport=self.transport,
        )
        if self.transport == "ipc":  # like kernelmode's gateway; the default tcp is on loopback
            self.km.ip = str(runtime / "kernel-ipc")
        # HOME (and so IPython's history database) on tmpfs when there is one, like the
        # sandbox's /tmp: on disk, the history writes of every execution cost ~0.3 ms here.
        self.home = Path(tempfile.mkdtemp(prefix="kmbench-home-", dir=_tmpfs_dir()))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "HOME": str(self.home), "IPYTHONDIR": str(self.home / ".ipython"),
               "JUPYTER_RUNTIME_DIR": str(runtime)}
        logf = self.log_path.open("wb")
        try:
            await self.km.start_kernel(env=env, stdout=logf, stderr=logf)
        finally:
            logf.close()  # the kernel has its own copy
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)

    async def run_cell(self, code: str) -> tuple[float, str | None, str]:
        """(ms until execute_reply and idle, text result, stdout) of one cell."""
        kc = self.kc
        t0 = time.perf_counter_ns()
        msg_id = kc.execute(code)
        result, out = None, []
        while True:
            msg = await kc.get_shell_msg(timeout=MSG_TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
                break
        while True:
            msg = await kc.get_iopub_msg(timeout=MSG_TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "execute_result":
                result = msg["content"]["data"].get("text/plain")
            elif kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        return now_ms(t0), result, "".join(out)

    async def roundtrip(self) -> float:
        elapsed, result, _ = await self.run_cell(CODE)
        if result != EXPECTED:
            raise RuntimeError(f"direct kernel answered {result!r}, not {EXPECTED!r}")
        return elapsed

    async def stop(self) -> None:
        if self.kc is not None:
            with contextlib.suppress(Exception):
                self.kc.stop_channels()
        if self.km is not None and self.km.has_kernel:
            try:
                await asyncio.wait_for(self.km.shutdown_kernel(now=False), 15)
            except Exception:
                with contextlib.suppress(Exception):
                    await self.km.shutdown_kernel(now=True)
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)


class RestSession:
    """A real `kernelmode serve` (bwrap sandbox), one session, one keep-alive httpx.Client."""

    def __init__(self) -> None:
        self.server: Server | None = None
        self.client: httpx.Client | None = None
        self.conn: http.client.HTTPConnection | None = None
        self.sid: str | None = None
        self.ready: dict[str, Any] = {}
        self.session_sandbox = ""
        self._path = ""
        self._body = json.dumps({"code": CODE}).encode()

    async def start(self) -> None:
        # start_server blocks (reads the child's stdout); nothing else runs yet.
        # One trivial host tool, for the tool-call round trip from kernel code.
        self._config = Path(tempfile.mkstemp(prefix="kmbench-", suffix=".yaml")[1])
        self._config.write_text('tools:\n  - {name: add, function: "tests.integration.host_tools:add"}\n'
                                'tool_calls: {rate_per_second: 1000000, rate_burst: 1000000}\n')
        self.server = start_server(args=["--sandbox", "bwrap", "--config", str(self._config)])
        self.client = self.server.client(timeout=60)
        r = self.client.get("/readyz")
        self.ready = r.json().get("checks", {})
        r = self.client.post("/v1/sessions", json={})
        if r.status_code != 201:
            raise RuntimeError(f"POST /v1/sessions: {r.status_code} {r.text}")
        info = r.json()
        self.sid = info["session_id"]
        self.session_sandbox = info.get("sandbox", "")
        self._path = f"/v1/sessions/{self.sid}/execute"

    async def roundtrip(self) -> float:
        """The REST call through a lean keep-alive client (the standard library's http.client)."""
        if self.conn is None:
            assert self.server is not None
            u = urlsplit(self.server.url)
            self.conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
        assert self.server is not None
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.server.token}"}
        t0 = time.perf_counter_ns()
        self.conn.request("POST", self._path, body=self._body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = now_ms(t0)
        if resp.status != 200:
            raise RuntimeError(f"POST {self._path}: {resp.status} {data[:500]!r}")
        body = json.loads(data)
        if body.get("status") != "ok" or body.get("result") != EXPECTED:
            raise RuntimeError(f"kernelmode answered {body!r}")
        return elapsed

    async def tool_calls(self, n: int) -> list[float]:
        """Per-call latency (ms) of ``n`` calls of a trivial host tool, timed inside the kernel."""
        assert self.client is not None
        code = (
            "import json as _j, time as _t\n_ts = []\n"
            f"for _i in range({n}):\n"
            "    _s = _t.perf_counter(); tools.add(_i, 1); _ts.append((_t.perf_counter() - _s) * 1000)\n"
            "_j.dumps(_ts)"
        )
        r = self.client.post(f"/v1/sessions/{self.sid}/execute", json={"code": code, "timeout_seconds": 600})
        body = r.json()
        if body.get("status") != "ok":
            raise RuntimeError(f"tool-call cell failed: {body!r}"[:2000])
        return [float(x) for x in json.loads(ast.literal_eval(body["result"]))]

    async def roundtrip_httpx(self) -> float:
        # A blocking call on purpose: nothing else needs the event loop while it runs.
        assert self.client is not None
        t0 = time.perf_counter_ns()
        r = self.client.post(self._path, content=self._body,
                             headers={"Content-Type": "application/json"})
        elapsed = now_ms(t0)
        if r.status_code != 200:
            raise RuntimeError(f"POST {self._path}: {r.status_code} {r.text[:500]}")
        body = r.json()
        if body.get("status") != "ok" or body.get("result") != EXPECTED:
            raise RuntimeError(f"kernelmode answered {body!r}")
        return elapsed

    async def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.client is not None:
            if self.sid is not None:
                with contextlib.suppress(Exception):
                    self.client.delete(f"/v1/sessions/{self.sid}")
            self.client.close()
        if self.server is not None:
            try:
                self.server.stop(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.proc.kill()
                self.server.proc.wait(10)
            if self.server.proc.stdout is not None:
                self.server.proc.stdout.close()
            shutil.rmtree(self.server.data_dir, ignore_errors=True)
        if getattr(self, "_config", None) is not None:
            self._config.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.server.log_path.unlink()


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

    def __init__(self, rest: RestSession) -> None:
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
        elapsed = now_ms(t0)
        sc = r.structured_content or {}
        if r.is_error or sc.get("status") != "ok" or sc.get("result") != EXPECTED:
            text = " ".join(getattr(c, "text", "") for c in r.content)
            raise RuntimeError(f"MCP run_python answered is_error={r.is_error} {sc!r} {text!r}"[:2000])
        self.session_id = sc.get("session_id", self.session_id) or "?"
        return elapsed


class WsKernel:
    """A kernel driven over a Kernel Gateway's kernel websocket with the `websockets` library."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._session = JupyterSession(key=b"", username="kmbench")

    @classmethod
    async def open(cls, http_url: str, token: str, kernel_id: str) -> WsKernel:
        url = (f"ws{http_url[len('http'):]}/api/kernels/{kernel_id}/channels"
               f"?session_id={uuid.uuid4().hex}")
        ws = await websockets.connect(url, additional_headers={"Authorization": f"token {token}"},
                                      compression=None, ping_interval=None, open_timeout=30,
                                      max_size=None)
        self = cls(ws)
        try:  # wait until the kernel answers (kernel_info round trip)
            msg = self._session.msg("kernel_info_request", {})
            msg["channel"] = "shell"
            await ws.send(json.dumps(msg, default=json_default))
            while True:
                reply = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if reply.get("msg_type") == "kernel_info_reply" and \
                        reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    return self
        except BaseException:
            await self.close()
            raise

    async def roundtrip(self) -> float:
        t0 = time.perf_counter_ns()
        msg = self._session.msg("execute_request", {
            "code": CODE, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True,
        })
        msg["channel"] = "shell"
        await self.ws.send(json.dumps(msg, default=json_default))
        result = await asyncio.wait_for(self._collect(msg["header"]["msg_id"]), MSG_TIMEOUT)
        elapsed = now_ms(t0)
        if result != EXPECTED:
            raise RuntimeError(f"kernel behind the websocket answered {result!r}, not {EXPECTED!r}")
        return elapsed

    async def _collect(self, msg_id: str) -> str | None:
        """Read until the execute_reply and the idle status of ``msg_id``; the text result."""
        got_reply = got_idle = False
        result = None
        while not (got_reply and got_idle):
            m = json.loads(await self.ws.recv())
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            kind = m["msg_type"]
            if kind == "execute_reply":
                got_reply = True
            elif kind == "execute_result":
                result = m["content"]["data"].get("text/plain")
            elif kind == "status" and m["content"]["execution_state"] == "idle":
                got_idle = True
        return result

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 5)


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


# -- statistics and reporting ------------------------------------------------------------------------


@dataclass
class Stats:
    name: str
    samples: list[float] = field(default_factory=list)

    def pct(self, p: float) -> float:
        xs = sorted(self.samples)
        if len(xs) == 1:
            return xs[0]
        # linear interpolation between closest ranks (numpy's default)
        k = (len(xs) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)


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


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info(rest: RestSession) -> dict[str, str]:
    mem = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                kb = int(line.split()[1])
                mem = f"{kb / 1024 / 1024:.1f} GiB ({kb} kB MemTotal)"
                break
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    kpy = subprocess.run([str(KERNEL_PYTHON), "-c",
                          "import sys, ipykernel; print(sys.version.split()[0], ipykernel.__version__)"],
                         capture_output=True, text=True, timeout=30).stdout.split()
    sandbox = rest.ready.get("sandbox", {}) if isinstance(rest.ready.get("sandbox"), dict) else {}
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": str(os.cpu_count()),
        "memory": mem,
        "cpu": cpu,
        "kernel": f"{platform.system()} {platform.release()}",
        "python (manager, gateways, stock kernel)": platform.python_version(),
        "python / ipykernel (kernel-venv: direct and kernelmode kernels)":
            " / ".join(kpy) if kpy else "?",
        "jupyter_client": _version("jupyter_client"),
        "ipykernel (venv)": _version("ipykernel"),
        "jupyter_kernel_gateway": _version("jupyter_kernel_gateway"),
        "jupyter_server": _version("jupyter_server"),
        "tornado": _version("tornado"),
        "websockets": _version("websockets"),
        "httpx": _version("httpx"),
        "mcp (SDK: server in kernelmode, client here) / httpx2": f"{_version('mcp')} / {_version('httpx2')}",
        "pyzmq": _version("pyzmq"),
        "load average (1, 5, 15 min) at the end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
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
SECTION_BEGIN = "<!-- BEGIN "
SECTION_END = "<!-- END "


def _section_markers(name: str) -> tuple[str, str]:
    return (f"{SECTION_BEGIN}{name}: generated, replaced when it runs again -->",
            f"{SECTION_END}{name} -->")


def kept_sections(path: Path) -> str:
    """The marked sections of other benchmarks in ``path`` (with their markers), or ''."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except OSError:
        return ""
    out: list[str] = []
    end: str | None = None
    for line in lines:
        if end is None and line.startswith(SECTION_BEGIN):
            name = line[len(SECTION_BEGIN):].split(":", 1)[0].strip()
            end = _section_markers(name)[1]
        if end is not None:
            out.append(line)
            if line.strip() == end:
                end = None
    return "".join(out)


def write_section(path: Path, name: str, body: str) -> None:
    """Put ``body`` in ``path`` as the marked section ``name``: in place of the one there, else
    at the end; the rest of the file is left as it is."""
    begin, end = _section_markers(name)
    block = f"{begin}\n{body.strip()}\n{end}\n"
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{SECTION_BEGIN}{name}:")]
    if starts:
        i = starts[0]
        j = next((k for k in range(i, len(lines)) if lines[k].strip() == end), len(lines) - 1)
        lines[i:j + 1] = [block]
        path.write_text("".join(lines))
    else:
        path.write_text(text + ("\n" if text and not text.endswith("\n\n") else "") + block)


def write_markdown(path: Path, stats: dict[str, Stats], info: dict[str, str],
                   args: argparse.Namespace, wall_s: float) -> None:
    d, r, h, m, k = (stats[p].median for p in PATHS)
    ratio = r / d
    verdict = ("**met**" if ratio <= GOAL else "**not met**")
    machine = "\n".join(f"| {key} | {val} |" for key, val in info.items())
    info_mcp = _version("mcp")
    text = f"""# Round-trip latency: kernelmode REST and MCP vs direct ipykernel

Generated by `{' '.join(['bench/roundtrip.py', *sys.argv[1:]])}` on {info['date']},
{stats['direct'].n} samples per path, interleaved in batches of {args.batch}, after {args.warmup}
warm-up runs per path; wall time {wall_s:.0f} s.

## Result

{table(stats, markdown=True)}

- **REST / direct (median): {ratio:.2f}x** — the project's goal is REST median <= {GOAL}x the direct
  round trip: {verdict} ({r - d:.3f} ms added per call on top of {d:.3f} ms).
- the same REST call through httpx instead of http.client: {h / d:.2f}x (httpx spends ~0.5 ms
  more CPU per request in the client; see bench/PROFILE.md).
- the MCP tool call `run_python` from the mcp SDK's client: {m / d:.2f}x direct, {m / r:.2f}x REST
  ({m - r:.3f} ms more than the REST call per round trip).
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
  (mcp {info_mcp}, HTTP through an `httpx2.AsyncClient`; the server answers each `tools/call` POST
  as an SSE stream so that progress can reach the client mid-call). Timed around
  `await client.call_tool(...)` until the `CallToolResult` is back and parsed
  (`structured_content["result"] == '2'`). The connection's own kernel session is created by the
  first (warm-up) call. On top of the REST path's work: JSON-RPC framing and pydantic validation
  on both ends, the ASGI bridge inside the server, SSE framing of the response, the client SDK's
  task plumbing (anyio memory streams between its tasks), the client's jsonschema check of
  `structured_content` against the tool's output schema, and a new TCP connection per call (the
  SDK client closes the SSE response as soon as the result event has arrived, before the end of
  the chunked body, so httpx2 cannot keep the connection alive).
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
    kept = kept_sections(path)  # e.g. bench/load.py's section, written by another run
    path.write_text(text + ("\n" + kept if kept else ""))


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
        print(f"warming up ({args.warmup} runs each) ...", flush=True)
        for _ in range(args.warmup):
            for name in PATHS:
                await paths[name]()

        stats = {name: Stats(name) for name in PATHS}
        rounds = -(-args.samples // args.batch)
        print(f"measuring: {args.samples} samples each, {rounds} rounds of {args.batch} ...", flush=True)
        for rnd in range(rounds):
            k = rnd % len(PATHS)
            order = PATHS[k:] + PATHS[:k]
            n = min(args.batch, args.samples - rnd * args.batch)
            for name in order:
                fn, out = paths[name], stats[name].samples
                for _ in range(n):
                    out.append(await fn())
            if (rnd + 1) % max(1, rounds // 5) == 0:
                print(f"  round {rnd + 1}/{rounds}: medians so far "
                      + ", ".join(f"{p}={stats[p].median:.3f}" for p in PATHS), flush=True)

        print("tool calls from kernel code ...", flush=True)
        tool = Stats("tool_call")
        for _ in range(3 if args.quick else 5):
            tool.samples += await rest.tool_calls(200 if args.quick else 1000)
        stats["tool_call"] = tool
        info = machine_info(rest)
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
    print(f"goal REST median <= {GOAL}x direct: {'met' if ratio <= GOAL else 'NOT met'} ({ratio:.2f}x)")
    print(summary_line(stats), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=None, help="samples per path (default 300)")
    p.add_argument("--quick", action="store_true", help="60 samples per path, fewer warm-ups")
    p.add_argument("--batch", type=int, default=10, help="samples per path per round (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per path (default 30)")
    p.add_argument("--direct-transport", choices=["ipc", "tcp"], default="ipc",
                   help="ZMQ transport of the direct kernel (default ipc, as kernelmode's gateway uses)")
    p.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS.md")
    args = p.parse_args()
    if args.samples is None:
        args.samples = 60 if args.quick else 300
    if args.warmup is None:
        args.warmup = 10 if args.quick else 30
    if args.samples < 1 or args.batch < 1 or args.warmup < 0:
        p.error("--samples and --batch must be >= 1, --warmup >= 0")
    if not KERNEL_PYTHON.is_file():
        p.error(f"{KERNEL_PYTHON} not found (run `make setup`)")

    return run_stoppable(run, args)


def run_stoppable(run: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace) -> int:
    """asyncio.run(run(args)), cancelled (so that its clean-up runs) by SIGTERM or Ctrl-C."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run(args)

    try:
        return asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
