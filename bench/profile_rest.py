"""Where does the REST round trip's overhead over a direct ipykernel go?

Run:  .venv/bin/python bench/profile_rest.py [--samples N] [--cprofile]

Measures the warm `1+1` round trip along successively longer paths, interleaved round-robin
like bench/roundtrip.py, and the CPU time each process spends per request (from
/proc/<pid>/task/*/schedstat, so every thread counts):

  direct       jupyter_client -> ipykernel (kernel-venv, unsandboxed, ipc)       [the floor]
  ws_none      websocket -> kernelmode's gateway config (NoDelay, ipc) -> kernel, sandbox none
  ws_bwrap     websocket -> kernelmode's gateway config -> kernel in bwrap         (+ sandbox)
  manager      SessionManager.execute() in this process -> its gateway -> bwrap kernel
                                                            (+ the manager's own work)
  rest         POST /v1/sessions/{id}/execute on a `kernelmode serve` subprocess  (+ HTTP)
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
import io
import logging
import os
import pstats
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from roundtrip import (  # noqa: E402
    CODE,
    EXPECTED,
    DirectKernel,
    RestSession,
    Stats,
    WsKernel,
    now_ms,
)

from kernelmode.cli import _JsonFormatter  # noqa: E402
from kernelmode.config import Settings  # noqa: E402
from kernelmode.models import SessionCreate  # noqa: E402
from kernelmode.sandbox.spec import KernelParams  # noqa: E402
from kernelmode.server import KernelmodeApp  # noqa: E402

# -- CPU accounting --------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        for c in children(p):
            seen.append(c)
            todo.append(c)
    return seen


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def kernel_pid(gateway_pid: int, kernel_id: str) -> int:
    """The ipykernel process (not its bwrap wrappers) of ``kernel_id`` under a gateway."""
    for p in descendants(gateway_pid):
        argv = cmdline(p)
        if argv and "bwrap" not in Path(argv[0]).name and "ipykernel_launcher" in argv \
                and any(kernel_id in a for a in argv):
            return p
    raise RuntimeError(f"no kernel process for {kernel_id} under pid {gateway_pid}")


def cpu_ns(pid: int) -> int:
    """On-CPU time of every thread of ``pid`` (ns)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


# -- the in-process kernelmode app -------------------------------------------------------------------


class InProcessApp:
    """A KernelmodeApp (gateway child + SessionManager) running in this process."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.backend = backend
        self.tmp = tmp
        self.app: KernelmodeApp | None = None
        self.sid = ""
        self.bare_kernel_id = ""
        self.ws: WsKernel | None = None

    async def start(self) -> None:
        settings = Settings()
        settings.server.port = 0
        settings.server.token = secrets.token_urlsafe(16)
        settings.server.data_dir = self.tmp
        settings.sandbox.backend = self.backend  # type: ignore[assignment]
        self.app = KernelmodeApp(settings)
        await self.app.start()
        info = await self.app.sessions.create(SessionCreate())
        self.sid = info.session_id
        # A bare kernel with a session's parameters, for the raw websocket path.
        workspace = self.app.sessions.workspaces / "kmbench-raw"
        workspace.mkdir(mode=0o700)
        params = KernelParams(workspace=workspace, limits=settings.sandbox.limits,
                              session_id="kmbench-raw")
        assert self.app.gateway is not None and self.app.gateway_process is not None
        self.bare_kernel_id = await self.app.gateway.start_kernel(params.to_env(), 60)
        self.ws = await WsKernel.open(self.app.gateway_process.url, self.app.gateway_process.token,
                                      self.bare_kernel_id)

    @property
    def gateway_pid(self) -> int:
        assert self.app is not None and self.app.gateway_process is not None
        assert self.app.gateway_process.proc is not None
        return self.app.gateway_process.proc.pid

    def session_kernel_id(self) -> str:
        assert self.app is not None
        return self.app.sessions._live[self.sid].kernel_id

    async def ws_roundtrip(self) -> float:
        assert self.ws is not None
        return await self.ws.roundtrip()

    async def manager_roundtrip(self) -> float:
        assert self.app is not None
        t0 = time.perf_counter_ns()
        r = await self.app.sessions.execute(self.sid, CODE)
        elapsed = now_ms(t0)
        if r.status != "ok" or r.result != EXPECTED:
            raise RuntimeError(f"manager answered {r!r}")
        return elapsed

    async def stop(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.app is not None:
            if self.bare_kernel_id and self.app.gateway is not None:
                with contextlib.suppress(Exception):
                    await self.app.gateway.shutdown_kernel(self.bare_kernel_id)
            with contextlib.suppress(Exception):
                await self.app.sessions.delete(self.sid)
            await self.app.stop()


def rest_get(rest: RestSession) -> Callable[[], Awaitable[float]]:
    async def get() -> float:
        assert rest.client is not None
        t0 = time.perf_counter_ns()
        r = rest.client.get(f"/v1/sessions/{rest.sid}")
        elapsed = now_ms(t0)
        if r.status_code != 200:
            raise RuntimeError(f"GET session: {r.status_code} {r.text}")
        return elapsed

    return get


# -- main --------------------------------------------------------------------------------------------


PATHS = ("direct", "ws_none", "ws_bwrap", "manager", "rest", "rest_get")


def setup_tmp() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="kmprof-", dir="/tmp"))
    tmp.chmod(0o711)  # sandbox uids must traverse it to their runtime dirs
    (tmp / "direct").mkdir()
    # The in-process apps log like `kernelmode serve` (JSON lines, level info), to a file.
    handler = logging.FileHandler(tmp.with_suffix(".log"))
    handler.setFormatter(_JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("tornado.access").setLevel(logging.WARNING)
    return tmp


async def run(args: argparse.Namespace) -> None:
    tmp = setup_tmp()
    direct = DirectKernel(tmp / "direct", "ipc")
    app_none = InProcessApp("none", tmp / "app-none")
    app_bwrap = InProcessApp("bwrap", tmp / "app-bwrap")
    rest = RestSession()
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
        srv = rest.server.proc.pid
        srv_gw = children(srv)[0]
        srv_kernel = [p for p in descendants(srv_gw) if "ipykernel_launcher" in cmdline(p)
                      and "bwrap" not in Path(cmdline(p)[0]).name][0]
        roles: dict[str, dict[str, int]] = {
            "direct": {"client": me, "kernel": direct_kernel},
            "ws_none": {"client": me, "gateway": app_none.gateway_pid,
                        "kernel": kernel_pid(app_none.gateway_pid, app_none.bare_kernel_id)},
            "ws_bwrap": {"client": me, "gateway": app_bwrap.gateway_pid,
                         "kernel": kernel_pid(app_bwrap.gateway_pid, app_bwrap.bare_kernel_id)},
            "manager": {"client": me, "gateway": app_bwrap.gateway_pid,
                        "kernel": kernel_pid(app_bwrap.gateway_pid, app_bwrap.session_kernel_id())},
            "rest": {"client": me, "manager": srv, "gateway": srv_gw, "kernel": srv_kernel},
            "rest_get": {"client": me, "manager": srv},
        }
        paths: dict[str, Callable[[], Awaitable[float]]] = {
            "direct": direct.roundtrip, "ws_none": app_none.ws_roundtrip,
            "ws_bwrap": app_bwrap.ws_roundtrip, "manager": app_bwrap.manager_roundtrip,
            "rest": rest.roundtrip, "rest_get": rest_get(rest),
        }
        print(f"warming up ({args.warmup} each) ...", flush=True)
        for _ in range(args.warmup):
            for name in PATHS:
                await paths[name]()
        stats = {name: Stats(name) for name in PATHS}
        cpu = {name: dict.fromkeys(roles[name], 0) for name in PATHS}
        rounds = -(-args.samples // args.batch)
        print(f"measuring: {args.samples} samples each, {rounds} rounds ...", flush=True)
        for rnd in range(rounds):
            k = rnd % len(PATHS)
            order = PATHS[k:] + PATHS[:k]
            n = min(args.batch, args.samples - rnd * args.batch)
            for name in order:
                before = {r: cpu_ns(pid) for r, pid in roles[name].items()}
                for _ in range(n):
                    stats[name].samples.append(await paths[name]())
                for r, pid in roles[name].items():
                    cpu[name][r] += cpu_ns(pid) - before[r]

        print()
        cols = ["client", "manager", "gateway", "kernel"]
        head = f"{'path':<9} {'N':>4} {'median':>8} {'p95':>8} {'min':>8} {'+median':>8}   CPU ms/request: " \
            + " ".join(f"{c:>8}" for c in cols) + f" {'total':>8}"
        print(head)
        print("-" * len(head))
        prev = None
        for name in PATHS:
            s = stats[name]
            delta = "" if prev is None or name == "rest_get" else f"{s.median - prev:+.3f}"
            if name != "rest_get":
                prev = s.median
            per = {r: v / 1e6 / s.n for r, v in cpu[name].items()}
            cells = " ".join(f"{per[c]:8.3f}" if c in per else f"{'-':>8}" for c in cols)
            print(f"{name:<9} {s.n:>4} {s.median:8.3f} {s.pct(95):8.3f} {min(s.samples):8.3f} "
                  f"{delta:>8}   {'':16}{cells} {sum(per.values()):8.3f}")
        print("\n(ms; '+median' = added to the previous line's median; for ws_*/manager the "
              "'client' column is this process, which for 'manager' runs the SessionManager too)")

        if args.cprofile:
            n = args.samples
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                await app_bwrap.manager_roundtrip()
            prof.disable()
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(45)
            print(f"\ncProfile of {n} SessionManager.execute() calls (this process only):")
            print(buf.getvalue())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--cprofile", action="store_true", help="then profile the manager path")
    args = p.parse_args()
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
