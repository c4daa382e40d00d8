"""A service's start up to its gateway child, from the settings alone (light imports only).

`KernelmodeApp.start` runs these steps for `serve`. The embedded `kernelmode mcp` runs them
first, before it imports the MCP SDK and the session layer (~1 s of imports): the gateway's own
start (a Python process importing Kernel Gateway) and the sandbox check (a throw-away sandbox)
then run on the other core while this process imports the rest and answers ``initialize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .code_policy import CodePolicy
from .config import Settings
from .errors import ConfigError
from .gateway.process import GatewayProcess
from .sandbox import cgroups
from .sandbox.docker_engine import server_id
from .sandbox.kernelspec import check_bwrap, install_kernelspec, kernel_env_paths
from .tools.registry import ToolRegistry

if TYPE_CHECKING:
    from .mcp.app import KernelmodeMCP

log = logging.getLogger("kernelmode")

DIRS = ("run", "state", "gateway", "kernels")


async def start_host_tools(settings: Settings, tools: ToolRegistry) -> CodePolicy | None:
    """The tools of the settings (and their MCP servers) added to ``tools`` and started, and the
    code policy loaded: a bad tool or policy path fails (ConfigError) before anything runs."""
    s = settings
    tools.add_from_settings(s.tools, s.mcp_servers)
    policy = CodePolicy.load(s.policy.module, s.policy.timeout_seconds) if s.policy.module else None
    await tools.start()
    return policy


def message_limit(settings: Settings) -> int:
    """The largest message a kernel may send the manager, in bytes, from the caps on what the
    manager keeps of one: a display, a tool request, or a stream text cut at the output cap
    (up to 6 bytes a character as escaped JSON); plus room for the rest of the message."""
    return max(settings.sessions.max_display_bytes, settings.tool_calls.max_argument_bytes,
               6 * settings.sessions.max_output_bytes) + 1024 * 1024


def gateway_process(settings: Settings, data_dir: Path, dirs: dict[str, Path]) -> GatewayProcess:
    """The gateway child of ``data_dir`` (not started), with the environment its kernels need."""
    s = settings
    env = {
        "JUPYTER_PATH": str(data_dir),  # -> data_dir/kernels/kernelmode
        "KERNELMODE_GW_RUNTIME_DIR": str(dirs["run"]),
        "KERNELMODE_GW_STATE_DIR": str(dirs["state"]),
        "KERNELMODE_GW_LIMITS": s.sandbox.limits.model_dump_json(),
        "KERNELMODE_GW_BWRAP": s.sandbox.bwrap_path,
        "KERNELMODE_GW_UID_BASE": str(s.sandbox.uid_base),
        "KERNELMODE_GW_UID_COUNT": str(s.sandbox.uid_count),
        "KERNELMODE_GW_CGROUPS": s.sandbox.cgroups,
        "KERNELMODE_GW_POLL_INTERVAL": str(s.gateway.poll_interval_seconds),
        "KERNELMODE_GW_MAX_STREAM_CHARS": str(s.sessions.max_output_bytes + 1),
        "KERNELMODE_GW_MAX_MESSAGE_BYTES": str(message_limit(s)),
        "KERNELMODE_GW_DOCKER_IMAGE": s.sandbox.docker_image,
        "KERNELMODE_GW_DOCKER_CPUS": str(s.sandbox.docker_cpus),
        "KERNELMODE_GW_SERVER_ID": server_id(data_dir),
        **({"DOCKER_HOST": os.environ["DOCKER_HOST"]} if os.environ.get("DOCKER_HOST") else {}),
    }
    # What the running kernels depend on: a gateway started with other values is not adopted.
    fingerprint = hashlib.sha256(json.dumps(
        {**env, "backend": s.sandbox.backend, "python": str(s.sandbox.kernel_python),
         "config": str(s.gateway.config_dir)}, sort_keys=True).encode()).hexdigest()
    env["KERNELMODE_GW_EVENT_LOOP"] = s.server.event_loop  # the kernels do not depend on it
    return GatewayProcess(s.gateway.config_dir / "kernel_gateway_config.py", dirs["gateway"], env,
                          orphan_timeout=s.gateway.orphan_timeout_seconds, fingerprint=fingerprint)


def check_sandbox(settings: Settings, data_dir: Path, adopted: set[str], ro_paths: list[str] | None = None) -> str:
    """The sandbox's check for its backend (a throw-away sandbox, or the Docker engine): a
    description, or SandboxUnavailable saying what is missing. Blocking: run it in a thread.
    ``ro_paths``: the kernel environment's paths, if known (``kernel_env_paths``)."""
    backend = settings.sandbox.backend
    if backend == "docker":
        from .sandbox.docker_engine import check_docker, remove_orphans

        report = check_docker(settings.sandbox.docker_image, settings.sandbox.max_limits)
        removed = remove_orphans(server_id(data_dir), keep=adopted)
        if removed:
            log.info("removed %d kernel container(s) left by an earlier run", removed)
        log.info("sandbox: %s", report)
        return report
    if backend == "none":
        log.warning("=" * 72)
        log.warning("SANDBOX DISABLED (--sandbox none): kernels run as plain local processes")
        log.warning("with this server's user, files, network and environment. Development only.")
        log.warning("=" * 72)
        return "none: NO ISOLATION"
    report = check_bwrap(settings.sandbox.bwrap_path, settings.sandbox.kernel_python, data_dir, ro_paths)
    log.info("sandbox: %s", report)
    version = cgroups.detect() if settings.sandbox.cgroups == "auto" else None
    if version and (swept := cgroups.sweep_stale(version)):
        log.info("removed %d empty kernel cgroup(s) left by killed servers", swept)
    return report


class LocalStart:
    """The data dir (made, and locked for this process), and the gateway child of this host:
    adopted or spawned, its lease renewed, the sandbox checked beside its start. Each step runs
    once, whoever asks first (the embedded `kernelmode mcp`, then ``KernelmodeApp.start``)."""

    def __init__(self, settings: Settings, data_dir: Path) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.dirs: dict[str, Path] = {}
        self.process: GatewayProcess | None = None
        self.adopted: list[str] | None = None  # kernel ids of a gateway left running (adopted)
        self.ro_paths: list[str] | None = None  # the kernel environment's (kernel_env_paths)
        self._lock_fd: int | None = None
        self._launching: asyncio.Future[None] | None = None
        self._lease: asyncio.Task[None] | None = None
        self._installing: asyncio.Future[None] | None = None
        self._check: asyncio.Future[str] | None = None
        self._stopped = False
        self.spawned = asyncio.Event()  # the gateway adopted or spawned (or that failed: launch() says why)

    def prepare_dirs(self) -> dict[str, Path]:
        if self.dirs:
            return self.dirs
        dirs = {name: self.data_dir / name for name in DIRS}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        # Kernels run as other uids and must traverse (not list) the data dir to their own parts.
        self.data_dir.chmod(0o711)
        for name, d in dirs.items():
            d.mkdir(exist_ok=True)
            d.chmod(0o711 if name == "run" else 0o700)
        self.dirs = dirs
        return dirs

    def _lock(self) -> None:
        """One `serve` per data dir: a second one would adopt (steal) the first one's gateway and
        kernels. The lock dies with its process, so a crashed manager's successor gets it."""
        fd = os.open(self.data_dir / "serve.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"another kernelmode serve (pid {owner}) is using the data dir "
                              f"{self.data_dir}: stop it, or give this one another --data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd  # held (open) until release()

    def begin(self) -> None:
        """The gateway adopted or spawned, in a task of its own (``spawned`` is set once it is)."""
        if self._launching is None:
            self._launching = asyncio.ensure_future(self._launch())

    async def launch(self) -> None:
        """The gateway adopted or spawned (not waited for: ``process.wait_ready``), then the
        kernelspec installed. Raises what stopped it, to every caller."""
        self.begin()
        assert self._launching is not None
        await self._launching
        if self._installing is None:
            # After the spawn (the gateway reads kernelspecs at a kernel's start, not at its own):
            # the kernel environment's paths come from its Python (~0.2 s), beside the gateway's start.
            self._installing = asyncio.ensure_future(asyncio.to_thread(self._install_kernelspec))
        await self._installing

    async def _launch(self) -> None:
        s = self.settings
        try:
            dirs = self.prepare_dirs()
            self.process = gateway_process(s, self.data_dir, dirs)
            # A gateway that a crashed manager left running keeps its kernels: adopt them.
            self.adopted = await self.process.adopt()
            # Renewed from here on: a gateway slow to start must not find its lease stale.
            self._lease = asyncio.create_task(self._renew_lease_forever(), name="gateway-lease")
            if self.adopted is None:
                await self.process.spawn()
        finally:
            self.spawned.set()

    def _install_kernelspec(self) -> None:
        s = self.settings
        self.ro_paths = [] if s.sandbox.backend == "docker" else kernel_env_paths(s.sandbox.kernel_python)
        install_kernelspec(self.dirs["kernels"], s.sandbox.backend, s.sandbox.kernel_python,
                           s.gateway.config_dir / "kernelspec.json", self.ro_paths)

    def start_check(self) -> None:
        """The kernelspec and the sandbox check (a throw-away sandbox) under way, once, in a task.
        The embedded `kernelmode mcp` starts them once its own imports for ``initialize`` are
        done, not beside them (more starts than cores slow all); a failed check stops the gateway
        with the rest (KernelmodeApp.stop)."""
        if self._check is None:
            self._check = asyncio.ensure_future(self._checked())

    async def _checked(self) -> str:
        await self.launch()
        return await asyncio.to_thread(check_sandbox, self.settings, self.data_dir, set(self.adopted or ()),
                                       self.ro_paths)

    async def sandbox_checked(self) -> str:
        """The sandbox check's report (SandboxUnavailable if it failed), started if it was not."""
        self.start_check()
        assert self._check is not None
        return await self._check

    async def _renew_lease_forever(self) -> None:
        while True:
            if self.process is not None:
                with contextlib.suppress(OSError):
                    self.process.renew_lease()
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        """The gateway (and its kernels) stopped, the lease no longer renewed; the lock is kept
        (``release``). Once: the app stops it, then its embedder makes sure."""
        if self._stopped:
            return
        self._stopped = True
        if self._launching is not None:
            if not self._launching.done():
                self._launching.cancel()
                await asyncio.wait([self._launching])
            if not self._launching.cancelled():
                self._launching.exception()  # retrieved: whoever needed the launch was told
        if self._lease is not None:
            self._lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease
        for step in (self._installing, self._check):  # threads: they end on their own (with timeouts)
            if step is not None:
                await asyncio.wait([step])
                if not step.cancelled():
                    step.exception()  # retrieved: whoever needed the step was told
        if self.process is not None:
            await self.process.stop()

    def release(self) -> None:
        """The data dir is free for the next serve."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass
class EarlyStart:
    """What the embedded `kernelmode mcp` started before importing the service, for
    ``KernelmodeApp`` to take over: the host tools (started), their policy, and the MCP server
    made on them (already answering)."""

    local: LocalStart
    policy: CodePolicy | None
    mcp: KernelmodeMCP
