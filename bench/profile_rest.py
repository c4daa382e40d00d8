"""Where does the REST round trip's overhead over a direct ipykernel go?

Run:  .venv/bin/python bench/profile_rest.py [--samples N] [--quick] [--cprofile] [--no-write]

Measures the warm `1+1` round trip along successively longer paths, interleaved round-robin
like bench/roundtrip.py, and the CPU time each process spends per request (from
/proc/<pid>/task/*/schedstat, so every thread counts):

  direct       jupyter_client -> ipykernel (kernel-venv, unsandboxed, ipc)       [the floor]
  ws_none      websocket -> kernelmode's gateway config (NoDelay, ipc) -> kernel, sandbox none
  ws_bwrap     websocket -> kernelmode's gateway config -> kernel in bwrap         (+ sandbox)
  ws_bwrap_v1  as ws_bwrap, with the binary "v1.kernel.websocket.jupyter.org" subprotocol
               (the gateway then forwards message parts without JSON re-serialization)
  manager      SessionManager.execute() in this process -> its gateway -> bwrap kernel
                                                            (+ the manager's own work)
  rest         POST /v1/sessions/{id}/execute on a `kernelmode serve` subprocess  (+ HTTP)
  rest_stdlib  as rest, with the standard library's http.client instead of httpx
  rest_get     GET /v1/sessions/{id} on the same server: HTTP + auth + JSON, no kernel

The ws_* and manager paths use KernelmodeApp instances started in this process (like
`kernelmode serve` does, logging included), so the gateway's URL and token are at hand; the
bare kernels of ws_* are started through the gateway with the same parameters as a session's.
With --cprofile, the manager path is then run again under cProfile and the functions where
this process spends its time are listed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import http.client
import io
import json
import logging
import os
import pstats
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from direct_kernels import DirectKernel
from harness import CODE, EXPECTED, REPO, Stats, WsKernel, interleave, ms_since, sampling_main
from servers import CpuMeter, RestSession, kernel_pid

from kernelmode.config import GATEWAY_CONFIG_DIR, Settings, load_settings
from kernelmode.logs import JsonFormatter
from kernelmode.models import SessionCreate
from kernelmode.sandbox.spec import KernelParams
from kernelmode.server import KernelmodeApp

# -- the v1 kernel websocket protocol (binary frames, no JSON re-serialization in the gateway) ----

V1 = "v1.kernel.websocket.jupyter.org"


class WsKernelV1(WsKernel):
    """WsKernel with the "v1.kernel.websocket.jupyter.org" subprotocol.

    With it the gateway forwards the kernel's message parts as they are (framed with offsets)
    instead of deserializing, date-parsing and re-encoding every message as JSON.
    """

    SUBPROTOCOL = V1

    def _frame(self, msg: dict[str, Any]) -> bytes:
        pack = self._session.pack
        parts = [pack(msg["header"]), pack(msg["parent_header"]), pack(msg["metadata"]),
                 pack(msg["content"])]
        channel = b"shell"
        offsets = [8 * (1 + 1 + len(parts) + 1)]
        offsets.append(offsets[-1] + len(channel))
        for part in parts:
            offsets.append(offsets[-1] + len(part))
        return b"".join([len(offsets).to_bytes(8, "little"),
                         *(o.to_bytes(8, "little") for o in offsets), channel, *parts])

    def _unframe(self, frame: str | bytes) -> tuple[str, str | None, Any]:
        assert isinstance(frame, bytes)
        n = int.from_bytes(frame[:8], "little")
        offs = [int.from_bytes(frame[8 * (i + 1):8 * (i + 2)], "little") for i in range(n)]
        # parts after the channel: header, parent_header, metadata, content, buffers...
        parts = [frame[offs[i]:offs[i + 1]] for i in range(1, n - 1)]
        return json.loads(parts[0])["msg_type"], json.loads(parts[1]).get("msg_id"), parts[3]

    def _content(self, raw: Any) -> dict[str, Any]:
        return json.loads(raw)


# -- the in-process kernelmode app -------------------------------------------------------------------


class InProcessApp:
    """A KernelmodeApp (gateway child + SessionManager) running in this process."""

    def __init__(self, backend: str, tmp: Path, config_dir: Path | None = None,
                 bare_kernels: bool = True) -> None:
        self.backend = backend
        self.tmp = tmp
        self.config_dir = config_dir
        self.bare_kernels = bare_kernels
        self.app: KernelmodeApp | None = None
        self.sid = ""
        self.bare_kernel_id = ""
        self.v1_kernel_id = ""
        self.ws: WsKernel | None = None
        self.ws_v1: WsKernel | None = None

    async def start(self) -> None:
        settings = load_settings()  # the environment applies, as to the `serve` of the rest paths
        settings.server.port = 0
        settings.server.token = secrets.token_urlsafe(16)
        settings.server.data_dir = self.tmp
        settings.sandbox.backend = self.backend  # type: ignore[assignment]
        if self.config_dir is not None:
            settings.gateway.config_dir = self.config_dir
        self.app = KernelmodeApp(settings)
        await self.app.start()
        info = await self.app.sessions.create(SessionCreate())
        self.sid = info.session_id
        if not self.bare_kernels:
            return
        # A bare kernel with a session's parameters, for the raw websocket path.
        assert self.app.gateway_process is not None
        self.bare_kernel_id = await self._bare_kernel(settings, "kmbench-raw")
        gw = self.app.gateway_process
        self.ws = await WsKernel.open(gw.url, gw.token, self.bare_kernel_id)
        if self.backend != "bwrap":
            return
        # A second bare kernel for the v1 protocol (one connection per kernel: a kernel's
        # iopub messages go to every websocket connected to it).
        self.v1_kernel_id = await self._bare_kernel(settings, "kmbench-v1")
        self.ws_v1 = await WsKernelV1.open(gw.url, gw.token, self.v1_kernel_id)

    async def _bare_kernel(self, settings: Settings, session_id: str) -> str:
        """A kernel started through the gateway with a session's parameters, outside any session."""
        assert self.app is not None and self.app.gateway is not None
        kernel_id = str(uuid.uuid4())
        workspace = self.app.sessions.workspaces / kernel_id  # the gateway names it by kernel id
        workspace.mkdir(mode=0o700)
        params = KernelParams(workspace=workspace, limits=settings.sandbox.limits, session_id=session_id)
        await self.app.gateway.start_kernel(kernel_id, params.to_env(), 60)
        return kernel_id

    @property
    def gateway_pid(self) -> int:
        assert self.app is not None and self.app.gateway_process is not None
        assert self.app.gateway_process.proc is not None
        return self.app.gateway_process.proc.pid

    def session_kernel_id(self) -> str:
        assert self.app is not None
        kernel_id = self.app.sessions.get(self.sid).kernel_id
        assert kernel_id is not None
        return kernel_id

    async def ws_roundtrip(self) -> float:
        assert self.ws is not None
        return await self.ws.roundtrip()

    async def ws_v1_roundtrip(self) -> float:
        assert self.ws_v1 is not None
        return await self.ws_v1.roundtrip()

    async def manager_roundtrip(self) -> float:
        assert self.app is not None
        t0 = time.perf_counter_ns()
        r = await self.app.sessions.execute(self.sid, CODE)
        elapsed = ms_since(t0)
        if r.status != "ok" or r.result != EXPECTED:
            raise RuntimeError(f"manager answered {r!r}")
        return elapsed

    async def stop(self) -> None:
        for ws in (self.ws, self.ws_v1):
            if ws is not None:
                await ws.close()
        if self.app is not None:
            for kid in (self.bare_kernel_id, self.v1_kernel_id):
                if kid and self.app.gateway is not None:
                    with contextlib.suppress(Exception):
                        await self.app.gateway.shutdown_kernel(kid)
            with contextlib.suppress(Exception):
                await self.app.sessions.delete(self.sid)
            await self.app.stop()


def rest_get(rest: RestSession) -> Callable[[], Awaitable[float]]:
    async def get() -> float:
        assert rest.client is not None
        t0 = time.perf_counter_ns()
        r = rest.client.get(f"/v1/sessions/{rest.sid}")
        elapsed = ms_since(t0)
        if r.status_code != 200:
            raise RuntimeError(f"GET session: {r.status_code} {r.text}")
        return elapsed

    return get


class RawHttp:
    """The same POST as `rest`, with the standard library's http.client (a lighter client)."""

    def __init__(self, rest: RestSession) -> None:
        assert rest.server is not None
        host, port = rest.server.url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.connect()
        assert self.conn.sock is not None
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.path = f"/v1/sessions/{rest.sid}/execute"
        self.headers = {"Authorization": f"Bearer {rest.server.token}",
                        "Content-Type": "application/json"}
        self.body = json.dumps({"code": CODE}).encode()

    async def roundtrip(self) -> float:
        t0 = time.perf_counter_ns()
        self.conn.request("POST", self.path, body=self.body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = ms_since(t0)
        if resp.status != 200 or json.loads(data).get("result") != EXPECTED:
            raise RuntimeError(f"http.client POST: {resp.status} {data[:300]!r}")
        return elapsed

    def close(self) -> None:
        self.conn.close()


# -- profiling -----------------------------------------------------------------------------------

GATEWAY_PROFILER = """
# --- added by bench/profile_rest.py: SIGUSR1 starts cProfile in this gateway, the next SIGUSR1
# stops it and writes $HOME/gateway.prof ---
import cProfile as _cProfile, os as _os, signal as _signal
_kmbench = {"prof": None}
def _kmbench_toggle(signum, frame):
    if _kmbench["prof"] is None:
        _kmbench["prof"] = _cProfile.Profile()
        _kmbench["prof"].enable()
    else:
        _kmbench["prof"].disable()
        _kmbench["prof"].dump_stats(_os.environ["HOME"] + "/gateway.prof.tmp")
        _os.rename(_os.environ["HOME"] + "/gateway.prof.tmp", _os.environ["HOME"] + "/gateway.prof")
        _kmbench["prof"] = None
_signal.signal(_signal.SIGUSR1, _kmbench_toggle)
# ---
"""


def profiled_gateway_config(dest: Path) -> Path:
    """A copy of the gateway config (kernelmode/gateway_ext/config/) whose gateway runs under cProfile (the repo is not touched)."""
    shutil.copytree(GATEWAY_CONFIG_DIR, dest)
    cfg = dest / "kernel_gateway_config.py"
    cfg.write_text(GATEWAY_PROFILER + cfg.read_text())
    return dest


def profile_rows(st: pstats.Stats, n_exec: int, pattern: str, limit: int) -> list[list[str]]:
    """The functions matching ``pattern`` with the most cumulative time, per execution."""
    rows = []
    raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    for (file, line, func), (_cc, nc, tt, ct, _callers) in raw.items():
        where = f"{file}:{line}({func})"
        if re.search(pattern, where) is None:
            continue
        short = re.sub(r".*/site-packages/|.*/work/main/|.*/lib/python3\.\d+/", "", where)
        rows.append((ct, [short, f"{nc / n_exec:.1f}", f"{tt / n_exec * 1e3:.3f}",
                          f"{ct / n_exec * 1e3:.3f}"]))
    rows.sort(key=lambda r: -r[0])
    return [r for _, r in rows[:limit]]


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# -- main ----------------------------------------------------------------------------------------

PATHS = ("direct", "ws_none", "ws_bwrap", "ws_bwrap_v1", "manager", "rest", "rest_stdlib",
         "rest_get")
CHAIN = ("direct", "ws_none", "ws_bwrap", "manager", "rest")  # each adds one thing to the last
ROLES = ("client", "manager", "gateway", "kernel")
DESCRIPTIONS = {
    "direct": "jupyter_client -> ipykernel, unsandboxed (the floor)",
    "ws_none": "raw websocket -> kernelmode's gateway -> unsandboxed kernel (+ gateway hop)",
    "ws_bwrap": "raw websocket -> kernelmode's gateway -> bwrap kernel (+ sandbox)",
    "ws_bwrap_v1": "as ws_bwrap, binary v1 websocket subprotocol (not in the chain)",
    "manager": "SessionManager.execute() in-process (+ manager's own work)",
    "rest": "POST /execute on `kernelmode serve` (+ HTTP hop, separate process)",
    "rest_stdlib": "as rest, with http.client instead of httpx as the client (not in the chain)",
    "rest_get": "GET /v1/sessions/{id} with httpx: HTTP + auth + JSON only (not in the chain)",
}


def setup_tmp() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="kmprof-", dir="/tmp"))
    tmp.chmod(0o711)  # sandbox uids must traverse it to their runtime dirs
    (tmp / "direct").mkdir()
    # The in-process apps log like `kernelmode serve` (JSON lines, level info), to a file.
    handler = logging.FileHandler(tmp.with_suffix(".log"))
    handler.setFormatter(JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("tornado.access").setLevel(logging.WARNING)
    return tmp


async def run(args: argparse.Namespace) -> int:
    tmp = setup_tmp()
    direct = DirectKernel(tmp / "direct", "ipc")
    app_none = InProcessApp("none", tmp / "app-none")
    app_bwrap = InProcessApp("bwrap", tmp / "app-bwrap")
    rest = RestSession()
    md: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.callback(lambda: tmp.with_suffix(".log").unlink(missing_ok=True))
        stack.push_async_callback(direct.stop)
        stack.push_async_callback(app_none.stop)
        stack.push_async_callback(app_bwrap.stop)
        stack.push_async_callback(rest.stop)
        print("starting ...", flush=True)
        await direct.start()
        await app_none.start()
        await app_bwrap.start()
        await rest.start()

        assert direct.km is not None and direct.km.provisioner is not None
        me = os.getpid()
        direct_kernel = direct.km.provisioner.pid  # type: ignore[attr-defined]
        assert rest.server is not None
        assert rest.km is not None
        srv = rest.server.proc.pid
        srv_gw = rest.km.gateway_pid
        # The session's own kernel (not a pool kernel beside it), found by its id.
        assert rest.client is not None
        srv_kernel = kernel_pid(srv_gw, rest.client.get(f"/v1/sessions/{rest.sid}").json()["kernel_id"])
        roles: dict[str, dict[str, int]] = {
            "direct": {"client": me, "kernel": direct_kernel},
            "ws_none": {"client": me, "gateway": app_none.gateway_pid,
                        "kernel": kernel_pid(app_none.gateway_pid, app_none.bare_kernel_id)},
            "ws_bwrap": {"client": me, "gateway": app_bwrap.gateway_pid,
                         "kernel": kernel_pid(app_bwrap.gateway_pid, app_bwrap.bare_kernel_id)},
            "ws_bwrap_v1": {"client": me, "gateway": app_bwrap.gateway_pid,
                            "kernel": kernel_pid(app_bwrap.gateway_pid, app_bwrap.v1_kernel_id)},
            "manager": {"client": me, "gateway": app_bwrap.gateway_pid,
                        "kernel": kernel_pid(app_bwrap.gateway_pid, app_bwrap.session_kernel_id())},
            "rest": {"client": me, "manager": srv, "gateway": srv_gw, "kernel": srv_kernel},
            "rest_stdlib": {"client": me, "manager": srv, "gateway": srv_gw, "kernel": srv_kernel},
            "rest_get": {"client": me, "manager": srv},
        }
        raw_http = RawHttp(rest)
        stack.callback(raw_http.close)
        paths: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip, "ws_none": app_none.ws_roundtrip,
            "ws_bwrap": app_bwrap.ws_roundtrip, "ws_bwrap_v1": app_bwrap.ws_v1_roundtrip,
            "manager": app_bwrap.manager_roundtrip, "rest": rest.roundtrip,
            "rest_stdlib": raw_http.roundtrip, "rest_get": rest_get(rest),
        }
        stats = {name: Stats(name) for name in PATHS}
        cpu = CpuMeter(stats)
        for name in PATHS:
            cpu.watch(name, **roles[name])

        print(f"warming up ({args.warmup} each), then measuring: {args.samples} samples each ...", flush=True)
        await interleave({p: paths[p] for p in PATHS}, stats, args.samples, args.batch, args.warmup,
                         around=cpu.around)

        head = ["path", "N", "median", "p95", "min", "+median", *(f"CPU {r}" for r in ROLES),
                "CPU total"]
        rows = []
        prev = None
        for name in PATHS:
            st = stats[name]
            delta = ""
            if name in CHAIN:
                delta = "" if prev is None else f"{st.median - prev:+.3f}"
                prev = st.median
            per = {r: cpu.per_run(name, r) for r in cpu.ns[name]}
            rows.append([name, str(st.n), f"{st.median:.3f}", f"{st.pct(95):.3f}",
                         f"{min(st.samples):.3f}", delta,
                         *(f"{per[r]:.3f}" if r in per else "-" for r in ROLES),
                         f"{sum(per.values()):.3f}"])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
        print()
        print(fmt.format(*head))
        print(fmt.format(*("-" * w for w in widths)))
        for row in rows:
            print(fmt.format(*row))
        print("\n(all ms; latency per request, CPU per request per process; '+median' = added to the"
              " previous chain step; for in-process paths 'client' is this process, which for"
              " 'manager' also runs the SessionManager)")
        md += ["## Latency and CPU per request", "",
               md_table(head, rows), "",
               "\n".join(f"- `{k}`: {v}" for k, v in DESCRIPTIONS.items()), ""]

        if args.cprofile:
            n_exec = args.samples
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n_exec):
                await app_bwrap.manager_roundtrip()
            prof.disable()
            mst = pstats.Stats(prof, stream=io.StringIO())
            mrows = profile_rows(mst, n_exec, r"kernelmode/|websockets/|sqlite3|logging/|pydantic|"
                                 r"json/|asyncio/tasks", 25)
            print(f"\ncProfile, this process, {n_exec} SessionManager.execute() calls "
                  "(ms per execute, inflated by the profiler):")
            for row in mrows:
                print(f"  {row[3]:>7} cum {row[2]:>7} self {row[1]:>5} calls  {row[0]}")
            md += [f"## cProfile: the manager ({n_exec} in-process `SessionManager.execute()`)", "",
                   "Per execute, in ms (cProfile roughly doubles Python's costs: compare shares, "
                   "not absolute values).", "",
                   md_table(["function", "calls", "self ms", "cumulative ms"], mrows), ""]

            print("\nstarting a gateway under cProfile ...", flush=True)
            gw_dir = tmp / "app-gwprof"
            app_prof = InProcessApp("bwrap", gw_dir, profiled_gateway_config(tmp / "gwcfg"),
                                    bare_kernels=False)
            prof_file = gw_dir / "gateway" / "gateway.prof"
            try:
                await app_prof.start()
                for _ in range(args.warmup):
                    await app_prof.manager_roundtrip()
                os.kill(app_prof.gateway_pid, signal.SIGUSR1)  # start profiling
                await asyncio.sleep(0.2)
                for _ in range(n_exec):
                    await app_prof.manager_roundtrip()
                os.kill(app_prof.gateway_pid, signal.SIGUSR1)  # stop and write
                for _ in range(100):
                    if prof_file.exists():
                        break
                    await asyncio.sleep(0.1)
                gst = pstats.Stats(str(prof_file), stream=io.StringIO())
            finally:
                await app_prof.stop()
            grows = profile_rows(gst, n_exec, r"jupyter_client/|jupyter_server/|tornado/websocket|"
                                 r"tornado/iostream|zmq/eventloop|dateutil|json/__init__|kernelmode/", 30)
            print(f"\ncProfile, kernelmode's gateway process, {n_exec} executions through the manager"
                  " (ms per execute, inflated by the profiler):")
            for row in grows:
                print(f"  {row[3]:>7} cum {row[2]:>7} self {row[1]:>5} calls  {row[0]}")
            md += [f"## cProfile: kernelmode's Kernel Gateway ({n_exec} executions through the manager)",
                   "", "Per execute, in ms, the whole gateway process while the manager ran them "
                   "(profiling switched on and off by SIGUSR1; cProfile inflation as above).", "",
                   md_table(["function", "calls", "self ms", "cumulative ms"], grows), ""]

    if not args.no_write:
        out = REPO / "bench" / "PROFILE.md"
        out.write_text("\n".join([
            "# Where the REST round trip's time goes",
            "",
            f"Generated by `bench/profile_rest.py {' '.join(sys.argv[1:])}` on "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; see bench/RESULTS.md for the headline "
            "numbers and the machine. Warm `1+1`, interleaved round-robin; CPU time per request "
            "from /proc/<pid>/task/*/schedstat (all threads of each process).",
            "",
            "How to read it: each line of the chain `direct -> ws_none -> ws_bwrap -> manager -> rest`"
            " adds one thing to the line before it; `+median` is what that thing adds to the median."
            " The CPU columns show where the work is: the hops are Python processes handing each"
            " message on, so on a machine with few CPUs their CPU time, more than the network,"
            " makes the latency. `ws_bwrap_v1`, `rest_stdlib` and `rest_get` are side measurements:"
            " the gateway hop with the binary v1 websocket subprotocol (the gateway then forwards"
            " message parts without decoding and re-encoding them), the REST call with a lighter"
            " HTTP client than httpx, and the bare cost of an HTTP request to the server.",
            "",
            *md,
        ]))
        print(f"\nwrote {out.relative_to(REPO)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cprofile", action="store_true",
                   help="then profile the manager (in-process) and a gateway (under cProfile)")
    return sampling_main(run, p, writes="bench/PROFILE.md")


if __name__ == "__main__":
    sys.exit(main())
