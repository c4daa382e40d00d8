"""What every benchmark in bench/ shares: reference clients, statistics and reporting (the
`kernelmode serve` processes themselves, and CPU per path in an A/B: bench/servers.py).

- ``Http``: a lean keep-alive HTTP client for a `kernelmode serve`.
- ``WsKernel``: a kernel driven over a Kernel Gateway's kernel websocket (the floor, unsandboxed
  ipykernels driven with jupyter_client, is in direct_kernels.py).
- ``Stats``, ``verdict``, ``machine_info``, ``write_section`` / ``write_page`` (a benchmark's own
  marked section of a results file, without clobbering the others), ``run_stoppable``.

Benchmarks are run as scripts (``python bench/X.py``), so this module is imported as ``harness``;
importing it puts the repository root on sys.path, so a script imports it before ``kernelmode``
and ``tests`` (isort's order does that: ``harness`` sorts with the third-party imports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import websockets
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session as JupyterSession

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The kernel environment's python: the checkout's .kernel-venv, or the one the service is told to
# use (KERNELMODE_SANDBOX__KERNEL_PYTHON, as in a git worktree, which has no .kernel-venv of its own).
_KVENV = os.environ.get("KERNELMODE_SANDBOX__KERNEL_PYTHON")
KERNEL_PYTHON = Path(_KVENV) if _KVENV else REPO / ".kernel-venv" / "bin" / "python"
# bwrap binds the kernel environment read-only and cannot follow a worktree's symlinked
# .kernel-venv: the real folder (its python, not what that python links to)
REAL_KERNEL_PYTHON = Path(os.path.realpath(KERNEL_PYTHON.parent.parent)) / "bin" / "python"
CODE = "1+1"  # the warm round trip every benchmark times
EXPECTED = "2"
EXEC_BODY = json.dumps({"code": CODE}).encode()
MSG_TIMEOUT = 30.0  # s for one kernel message
CONCURRENCY = 4  # sessions created (or bare kernels started) at a time


def ms_since(t0: int) -> float:
    """Milliseconds since ``t0`` (a ``time.perf_counter_ns()``)."""
    return (time.perf_counter_ns() - t0) / 1e6


# -- statistics and verdicts ---------------------------------------------------------------------


@dataclass
class Stats:
    """Samples of one measurement (ms, MB, ...) and their summary figures."""

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


async def interleave(fns: Mapping[str, Callable[[], Awaitable[float]]], stats: Mapping[str, Stats],
                     samples: int, batch: int, warmup: int = 0,
                     around: Callable[[str], contextlib.AbstractContextManager[object]] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> None:
    """Time each path ``samples`` times (each call returns its own latency) after ``warmup`` calls.

    Round-robin in batches of ``batch``, the order of the paths rotated every round, so that
    load and frequency changes on the machine fall on all paths alike. ``around(name)`` wraps
    each batch (to account CPU, say); ``progress(round, rounds)`` is called five times."""
    names = tuple(fns)
    for _ in range(warmup):
        for name in names:
            await fns[name]()
    rounds = -(-samples // batch)
    for rnd in range(rounds):
        k = rnd % len(names)
        n = min(batch, samples - rnd * batch)
        for name in names[k:] + names[:k]:
            fn, out = fns[name], stats[name].samples
            with around(name) if around is not None else contextlib.nullcontext():
                for _ in range(n):
                    out.append(await fn())
        if progress is not None and (rnd + 1) % max(1, rounds // 5) == 0:
            progress(rnd + 1, rounds)


def verdict(ok: bool, yes: str = "met", no: str = "not met") -> str:
    """The bold verdict word of a goal in a report."""
    return f"**{yes if ok else no}**"


# -- the machine ---------------------------------------------------------------------------------


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_info(kernels: str, python: str = "python (manager, gateway, benchmark client)") -> dict[str, str]:
    """The rows every benchmark's Machine table starts with; ``kernels`` says which kernels run
    the kernel-venv's python, ``python`` which processes run this one."""
    mem = cpu = "?"
    with contextlib.suppress(OSError, StopIteration):
        kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                  if x.startswith("MemTotal:"))
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                   if x.startswith("model name"))
    kpy = subprocess.run([str(KERNEL_PYTHON), "-c",
                          "import sys, ipykernel; print(sys.version.split()[0], ipykernel.__version__)"],
                         capture_output=True, text=True, timeout=30).stdout.split()
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": str(os.cpu_count()),
        "memory": mem,
        "cpu": cpu,
        "kernel": f"{platform.system()} {platform.release()}",
        python: platform.python_version(),
        f"python / ipykernel (kernel-venv: {kernels})": " / ".join(kpy) or "?",
    }


def server_machine_info(ready: dict[str, Any], load_start: str,
                        kernels: str = "sandboxed and bare kernels") -> dict[str, str]:
    """``machine_info`` with what a benchmark of `kernelmode serve` adds: versions, the sandbox
    (``ready``: the checks of /readyz), the gateway config and the load average."""
    sandbox = ready.get("sandbox", {})
    return {
        **machine_info(kernels),
        "jupyter_client / jupyter_kernel_gateway": (f"{version('jupyter_client')} / "
                                                   f"{version('jupyter_kernel_gateway')}"),
        "sandbox": f"{sandbox.get('detail', '?')}; limits: {sandbox.get('limits', '?')}",
        "gateway config dir": os.environ.get("KERNELMODE_GATEWAY__CONFIG_DIR", "the project's (gateway-config/)"),
        "load average (1, 5, 15 min) at the start": load_start,
        "load average (1, 5, 15 min) at the end": loadavg(),
    }


# -- results files -------------------------------------------------------------------------------

# A benchmark that shares a results file keeps its own section between a line starting with
# SECTION_BEGIN and the matching SECTION_END line: rewriting the file keeps the others.
SECTION_BEGIN = "<!-- BEGIN "
SECTION_END = "<!-- END "


def _section_markers(name: str) -> tuple[str, str]:
    return (f"{SECTION_BEGIN}{name}: generated, replaced when it runs again -->",
            f"{SECTION_END}{name} -->")


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


def write_page(path: Path, text: str) -> None:
    """Write ``text`` as the head of ``path``: what stands before its first marked section. All
    from that section on stays as it is, marked or not (hand-written notes between sections
    included: keeping only the marked sections lost them once)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except OSError:
        lines = []
    first = next((i for i, line in enumerate(lines) if line.startswith(SECTION_BEGIN)), len(lines))
    rest = "".join(lines[first:])
    path.write_text(text + ("\n" + rest if rest else ""))


# -- running -------------------------------------------------------------------------------------


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


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--samples, --quick, --batch, --warmup of a benchmark that ``interleave``s paths
    (``sampling_args`` fills in the defaults after parsing)."""
    p.add_argument("--samples", type=int, default=None, help="samples per path (default 300)")
    p.add_argument("--quick", action="store_true", help="60 samples per path, 10 warm-ups")
    p.add_argument("--batch", type=int, default=10, help="samples per path per round (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per path (default 30)")


def sampling_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.samples is None:
        args.samples = 60 if args.quick else 300
    if args.warmup is None:
        args.warmup = 10 if args.quick else 30
    if args.samples < 1 or args.batch < 1 or args.warmup < 0:
        p.error("--samples and --batch must be >= 1, --warmup >= 0")


def sampling_main(run: Callable[[argparse.Namespace], Awaitable[int]], p: argparse.ArgumentParser,
                  writes: str = "bench/RESULTS.md",
                  check: Callable[[argparse.Namespace], str | None] | None = None) -> int:
    """The command line of a benchmark that ``interleave``s paths: ``p`` (its description and own
    options) with --samples, --quick, --batch, --warmup and --no-write (leave ``writes`` alone);
    a usage error when ``check`` names a problem or the kernel environment is missing; then
    ``run`` under ``run_stoppable``."""
    add_sampling_args(p)
    p.add_argument("--no-write", action="store_true", help=f"print only; leave {writes} alone")
    args = p.parse_args()
    sampling_args(p, args)
    require_kernel_venv(p)
    problem = None if check is None else check(args)
    if problem:
        p.error(problem)
    return run_stoppable(run, args)


def small_bench_main(doc: str | None, run: Callable[[argparse.Namespace], Awaitable[int]], samples: int,
                     warmup: int, quick_samples: int) -> int:
    """The command line of a benchmark that times a few operations per sandbox (--samples,
    --warmup, --quick, --sandbox, --no-write), then ``run`` under ``run_stoppable``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=samples)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--quick", action="store_true", help=f"{quick_samples} samples, 1 warm-up")
    p.add_argument("--sandbox", choices=("bwrap", "docker"), default="bwrap")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.samples, args.warmup = quick_samples, 1
    require_kernel_venv(p)
    return run_stoppable(run, args)


def require_kernel_venv(p: argparse.ArgumentParser) -> None:
    """Exit with a usage error when the kernel environment is missing."""
    if not KERNEL_PYTHON.is_file():
        p.error(f"{KERNEL_PYTHON} not found (run `make setup`)")


# -- a lean HTTP client --------------------------------------------------------------------------


class Http:
    """One keep-alive HTTP/1.1 connection on asyncio streams (TCP_NODELAY is asyncio's default)."""

    def __init__(self, url: str, token: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", int(u.port or 80)
        self._head = f"Host: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"{method} {path} HTTP/1.1\r\n{self._head}Content-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await self.writer.drain()
        line = await self.reader.readline()
        if not line:
            await self.close()
            raise ConnectionError(f"{method} {path}: the server closed the connection")
        status = int(line.split()[1])
        length, chunked, close = 0, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, val = line.decode("latin-1").partition(":")
            key, val = key.strip().lower(), val.strip().lower()
            if key == "content-length":
                length = int(val)
            elif key == "transfer-encoding":
                chunked = "chunked" in val
            elif key == "connection":
                close = val == "close"
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readline()
            data = b"".join(parts)
        else:
            data = await self.reader.readexactly(length) if length else b""
        if close:
            await self.close()
        return status, data

    async def json(self, method: str, path: str, obj: Any = None) -> tuple[int, Any]:
        status, data = await self.request(method, path, b"" if obj is None else json.dumps(obj).encode())
        return status, (json.loads(data) if data else None)

    async def execute(self, sid: str) -> float:
        """One warm `1+1` round trip in session ``sid``, in ms (checks the answer)."""
        path = f"/v1/sessions/{sid}/execute"
        t0 = time.perf_counter_ns()
        status, data = await self.request("POST", path, EXEC_BODY)
        elapsed = ms_since(t0)
        if status != 200:
            raise RuntimeError(f"POST {path}: {status} {data[:500]!r}")
        body = json.loads(data)
        if body.get("status") != "ok" or body.get("result") != EXPECTED:
            raise RuntimeError(f"session {sid} answered {body!r}"[:1000])
        return elapsed

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.wait_closed(), 2)
        self.reader = self.writer = None


# -- a kernel behind a gateway's websocket ---------------------------------------------------------


class WsKernel:
    """A kernel driven over a Kernel Gateway's kernel websocket with the `websockets` library
    (JSON text frames; a subclass may speak another framing: ``SUBPROTOCOL``, ``_frame``,
    ``_unframe``, ``_content``)."""

    SUBPROTOCOL: str | None = None

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._session = JupyterSession(key=b"", username="kmbench")

    @classmethod
    async def open(cls, http_url: str, token: str, kernel_id: str) -> WsKernel:
        url = (f"ws{http_url[len('http'):]}/api/kernels/{kernel_id}/channels"
               f"?session_id={uuid.uuid4().hex}")
        extra: dict[str, Any] = {"subprotocols": [cls.SUBPROTOCOL]} if cls.SUBPROTOCOL else {}
        ws = await websockets.connect(url, additional_headers={"Authorization": f"token {token}"},
                                      compression=None, ping_interval=None, open_timeout=30,
                                      max_size=None, **extra)
        self = cls(ws)
        try:
            if cls.SUBPROTOCOL and ws.subprotocol != cls.SUBPROTOCOL:
                raise RuntimeError(f"the gateway did not accept {cls.SUBPROTOCOL} (got {ws.subprotocol!r})")
            # wait until the kernel answers (kernel_info round trip)
            msg_id = await self._send("kernel_info_request", {})
            while True:
                kind, parent, _ = self._unframe(await asyncio.wait_for(ws.recv(), 60))
                if kind == "kernel_info_reply" and parent == msg_id:
                    return self
        except BaseException:
            await self.close()
            raise

    def _frame(self, msg: dict[str, Any]) -> str | bytes:
        msg["channel"] = "shell"
        return json.dumps(msg, default=json_default)

    def _unframe(self, frame: str | bytes) -> tuple[str, str | None, Any]:
        """(msg_type, the parent's msg_id, the content as ``_content`` takes it) of a message."""
        m = json.loads(frame)
        return m["msg_type"], m["parent_header"].get("msg_id"), m["content"]

    def _content(self, raw: Any) -> dict[str, Any]:
        return raw

    async def _send(self, msg_type: str, content: dict[str, Any]) -> str:
        msg = self._session.msg(msg_type, content)
        await self.ws.send(self._frame(msg))
        return str(msg["header"]["msg_id"])

    async def roundtrip(self) -> float:
        t0 = time.perf_counter_ns()
        msg_id = await self._send("execute_request", {
            "code": CODE, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True,
        })
        result = await asyncio.wait_for(self._collect(msg_id), MSG_TIMEOUT)
        elapsed = ms_since(t0)
        if result != EXPECTED:
            raise RuntimeError(f"kernel behind the websocket answered {result!r}, not {EXPECTED!r}")
        return elapsed

    async def _collect(self, msg_id: str) -> str | None:
        """Read until the execute_reply and the idle status of ``msg_id``; the text result."""
        got_reply = got_idle = False
        result = None
        while not (got_reply and got_idle):
            kind, parent, raw = self._unframe(await self.ws.recv())
            if parent != msg_id:
                continue
            if kind == "execute_reply":
                got_reply = True
            elif kind == "execute_result":
                result = self._content(raw)["data"].get("text/plain")
            elif kind == "status" and self._content(raw)["execution_state"] == "idle":
                got_idle = True
        return result

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 5)
