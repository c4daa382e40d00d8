"""Run a Jupyter Kernel Gateway as a child process that only the manager can reach.

The gateway outlives a manager that crashes, so that a restarted manager can adopt it with its
kernels (and their variables): its pid, port and token are kept in ``gateway.json`` (0600), and
the manager renews a lease file every second. A gateway whose lease is older than its orphan
timeout (a manager that never came back) shuts itself and its kernels down
(``gateway_ext.kg_extensions.watch_lease``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

STATE_FILE = "gateway.json"
LEASE_FILE = "manager.lease"


def raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: the gateway holds ~6 ZMQ sockets per kernel,
    and the default soft limit of 1024 ran out at ~170 kernels ("Too many open files")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _child_setup() -> None:
    """In the gateway child before exec: room for many kernels' sockets."""
    raise_open_files_limit()


# `python -m kernel_gateway`, less imports it does not use: jsonschema (through nbformat) imports
# its optional format checkers' libraries when they are installed: rfc3987_syntax builds a Lark
# grammar at import (2-4 s of the gateway's start), rfc3986_validator its regexes and isoduration
# the arrow package (~45 ms more, on the embedded `kernelmode mcp`'s path to its first result),
# for "iri", "uri" and "duration" checks that neither the gateway nor its kernels run (without
# them, jsonschema leaves those formats unchecked). "kernel_gateway" stays in the command line
# (see _is_gateway).
# The gateway imports kernelmode (its config's classes, the provisioners) from the same place as
# this manager: its cwd is its work dir, so without the path it found whichever copy is installed
# (a checkout's changes to gateway code were not what its gateway ran).
_ROOT = str(Path(__file__).resolve().parents[2])
_UNUSED = ("rfc3987_syntax", "rfc3986_validator", "isoduration")
_LAUNCH = (f"import sys; sys.path.insert(0, {_ROOT!r}); sys.modules.update(dict.fromkeys({_UNUSED!r})); "
           "import kernel_gateway.gatewayapp as app; app.launch_instance()")


def _is_gateway(pid: int) -> bool:
    try:
        return b"kernel_gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """One Kernel Gateway child: loopback only, random port, random token, scrubbed env."""

    def __init__(self, config_file: Path, work_dir: Path, extra_env: Mapping[str, str],
                 orphan_timeout: float = 120.0, fingerprint: str = "") -> None:
        """``fingerprint``: what the kernels depend on (backend, limits...); a gateway left by a
        manager with another fingerprint is not adopted."""
        self.config_file = config_file
        self.work_dir = work_dir
        self.extra_env = dict(extra_env)
        self.orphan_timeout = orphan_timeout
        self.fingerprint = fingerprint
        self.token = secrets.token_urlsafe(32)
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None  # of the gateway, ours or adopted
        self.adopted = False
        self.log_path = work_dir / "gateway.log"
        self.state_path = work_dir / STATE_FILE
        self.lease_path = work_dir / LEASE_FILE

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
            "KERNELMODE_GW_LEASE": str(self.lease_path),
            "KERNELMODE_GW_ORPHAN_TIMEOUT": str(self.orphan_timeout),
        }
        env.update(self.extra_env)
        return env

    async def start(self, timeout: float) -> None:
        await self.spawn()
        await self.wait_ready(timeout)

    async def spawn(self) -> None:
        """Start the gateway process without waiting for it (its start takes a second or two:
        the caller does its other start-up work meanwhile, then calls ``wait_ready``)."""
        if not self.config_file.is_file():
            raise GatewayUnavailable(f"gateway config {self.config_file} not found")
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.renew_lease()
        self.port = _free_port()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        logf = os.fdopen(fd, "ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _LAUNCH, f"--config={self.config_file}",
                env=self._environment(), cwd=str(self.work_dir),
                stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                preexec_fn=_child_setup, start_new_session=True,
            )
        finally:
            logf.close()
        self.pid, self.adopted = self.proc.pid, False
        log.debug("kernel gateway starting (pid %s)", self.pid)

    async def wait_ready(self, timeout: float) -> None:
        """Until the spawned gateway answers (it is stopped, and GatewayUnavailable raised, if it
        exits or does not answer in ``timeout`` seconds)."""
        await self._wait_ready(timeout)
        self._save_state()
        assert self.proc is not None
        log.info("kernel gateway ready on %s (pid %s)", self.url, self.proc.pid)

    def renew_lease(self) -> None:
        """Tell the gateway its manager lives (called every second)."""
        self.lease_path.touch(mode=0o600)
        os.utime(self.lease_path)

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": self.pid, "port": self.port, "token": self.token,
                       "fingerprint": self.fingerprint}, f)
        os.replace(tmp, self.state_path)

    async def adopt(self) -> list[str] | None:
        """Take over the gateway a crashed manager left running: its kernel ids, or None when
        there is none to adopt (a gateway found unusable is killed, with its kernels)."""
        try:
            state = json.loads(self.state_path.read_text())
            pid, port, token = int(state["pid"]), int(state["port"]), str(state["token"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not _is_gateway(pid):
            return None
        if state.get("fingerprint") != self.fingerprint:
            log.info("the gateway left running (pid %s) has other settings: stopping it", pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            return None
        self.renew_lease()
        req = HTTPRequest(f"http://127.0.0.1:{port}/api/kernels", request_timeout=5,
                          headers={"Authorization": f"token {token}"})
        try:
            resp = await AsyncHTTPClient().fetch(req)
            kernels = [str(k["id"]) for k in json.loads(resp.body)]
        except (HTTPClientError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("the gateway left running (pid %s) does not answer (%s): killing it", pid, e)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            return None
        self.pid, self.port, self.token, self.adopted = pid, port, token, True
        log.info("adopted the kernel gateway left running on %s (pid %s, %d kernel(s))",
                 self.url, pid, len(kernels))
        return kernels

    async def wait(self) -> int | None:
        """Until the gateway exits: its exit code (None for an adopted gateway, not our child)."""
        if self.proc is not None and not self.adopted:
            return await self.proc.wait()
        assert self.pid is not None
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return None
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        loop.add_reader(pidfd, gone.set)  # a pidfd turns readable when its process exits
        try:
            await gone.wait()
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return None

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
                await asyncio.sleep(0.05)
        await self.stop()
        raise GatewayUnavailable(f"the kernel gateway was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        if self.adopted:
            return self.pid is not None and _is_gateway(self.pid)
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the gateway shuts its kernels down), then SIGKILL of the whole group."""
        pid = self.pid
        if pid is None:
            return
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("kernel gateway did not stop in %.0f s; killing it", timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if self.proc is not None and not self.adopted:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
        self.state_path.unlink(missing_ok=True)
