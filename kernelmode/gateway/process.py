"""Run a Jupyter Kernel Gateway as a child process that only the manager can reach."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from ..errors import GatewayUnavailable

log = logging.getLogger("kernelmode.gateway")

_PR_SET_PDEATHSIG = 1


def raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: the gateway holds ~6 ZMQ sockets per kernel,
    and the default soft limit of 1024 ran out at ~170 kernels ("Too many open files")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _child_setup() -> None:
    """In the gateway child before exec: SIGTERM if the manager dies (even by SIGKILL), and
    room for many kernels' sockets."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    raise_open_files_limit()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """One Kernel Gateway child: loopback only, random port, random token, scrubbed env."""

    def __init__(self, config_file: Path, work_dir: Path, extra_env: Mapping[str, str]) -> None:
        self.config_file = config_file
        self.work_dir = work_dir
        self.extra_env = dict(extra_env)
        self.token = secrets.token_urlsafe(32)
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = work_dir / "gateway.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _environment(self) -> dict[str, str]:
        runtime = self.work_dir / "jupyter-runtime"
        runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(self.work_dir),
            "PYTHONUNBUFFERED": "1",
            "JUPYTER_RUNTIME_DIR": str(runtime),
            "JUPYTER_DATA_DIR": str(self.work_dir / "jupyter-data"),
            "JUPYTER_CONFIG_DIR": str(self.work_dir / "jupyter-config"),
            "JUPYTER_PLATFORM_DIRS": "1",
            "KERNELMODE_GW_PORT": str(self.port),
            "KERNELMODE_GW_TOKEN": self.token,
        }
        env.update(self.extra_env)
        return env

    async def start(self, timeout: float) -> None:
        if not self.config_file.is_file():
            raise GatewayUnavailable(f"gateway config {self.config_file} not found")
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.port = _free_port()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        logf = os.fdopen(fd, "ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kernel_gateway", f"--config={self.config_file}",
                env=self._environment(), cwd=str(self.work_dir),
                stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                preexec_fn=_child_setup, start_new_session=True,
            )
        finally:
            logf.close()
        await self._wait_ready(timeout)
        log.info("kernel gateway ready on %s (pid %s)", self.url, self.proc.pid)

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    async def _wait_ready(self, timeout: float) -> None:
        client = AsyncHTTPClient()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise GatewayUnavailable(
                    f"the kernel gateway exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                req = HTTPRequest(f"{self.url}/api/kernelspecs", request_timeout=2,
                                  headers={"Authorization": f"token {self.token}"})
                await client.fetch(req)
                return
            except (HTTPClientError, OSError):
                await asyncio.sleep(0.1)
        await self.stop()
        raise GatewayUnavailable(f"the kernel gateway was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the gateway shuts its kernels down), then SIGKILL of the whole group."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("kernel gateway did not stop in %.0f s; killing it", timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 5)
