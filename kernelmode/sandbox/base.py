"""Shared part of kernelmode's provisioners: per-kernel directory, scrubbed env, death records.

A provisioner lives in the Kernel Gateway process, one instance per kernel, reused when the
kernel restarts: per-launch state is reset in pre_launch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Unicode

from ..models import Limits
from .spec import ENV_WORKSPACE, KernelParams, cause_from_exit, write_death_record

log = logging.getLogger("kernelmode.sandbox")
PORT_KEYS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
SEAL_WAIT_SECONDS = 120.0  # for a kernel to bind its sockets (a slow start on a loaded host)

def kernel_environment(path: str) -> dict[str, str]:
    """The whole environment of a kernel: nothing of the gateway's or the manager's."""
    return {
        "PATH": path,
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLCONFIGDIR": "/tmp/.matplotlib",
        "IPYTHONDIR": "/tmp/.ipython",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "TERM": "xterm-256color",
        # `python -m ipykernel_launcher` runs in /mnt/data: without this, a file named
        # ipykernel_launcher.py (or json.py...) there would take over the kernel's start.
        "PYTHONSAFEPATH": "1",
    }


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the kernel its workspace; never follow a link the kernel may have planted."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


class KernelmodeProvisioner(LocalProvisioner):
    """A LocalProvisioner that knows kernelmode's per-kernel parameters."""

    runtime_dir = Unicode(
        "", config=True,
        help="Parent of the per-kernel directories (connection file, ipc sockets).",
    )
    state_dir = Unicode(
        "", config=True,
        help="Where death records are written for the manager.",
    )
    default_limits = Unicode("{}", config=True, help="JSON of the default Limits.")

    _stopping = False
    _death_recorded = False
    _launching = False
    params: KernelParams | None = None
    _own_workspace: Path | None = None

    # -- hooks for subclasses -------------------------------------------------------------------
    def wrap_command(
        self, cmd: list[str], env: dict[str, str], kdir: Path
    ) -> tuple[list[str], dict[str, str], Path]:
        """Turn the kernelspec's command into the sandboxed one: (argv, env, cwd)."""
        raise NotImplementedError

    def oom_killed(self) -> bool:
        return False

    def release(self, restart: bool) -> None:
        """Free what this kernel held (cgroups, uid); called on cleanup."""

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def kernel_dir(self) -> Path:
        if not self.runtime_dir:
            raise RuntimeError("kernelmode provisioner: runtime_dir is not configured")
        return Path(self.runtime_dir) / self.kernel_id

    # Between pre_launch and the Popen of a (re)start there is no process: the gateway's
    # KernelRestarter then thinks the kernel died and starts a second restart that races the
    # first (seen under load). A launching kernel counts as alive.
    @property
    def has_process(self) -> bool:
        return self._launching or self.process is not None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        self._launching = True
        self._stopping = False  # the same instance serves every restart of its kernel
        self._death_recorded = False
        try:
            return await self._pre_launch(**kwargs)
        except BaseException:
            self._launching = False
            raise

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        # The kernel's own stdout/stderr go to a log of its own (root-owned, outside the
        # sandbox), never to the gateway's log that every kernel would share.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            kwargs.update(stdout=fd, stderr=fd)
            return await super().launch_kernel(cmd, **kwargs)
        finally:
            os.close(fd)
            self._launching = False

    @property
    def log_path(self) -> Path:
        return Path(self.runtime_dir) / f"{self.kernel_id}.log"

    async def _pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        assert km is not None, "a provisioner always has its kernel manager as parent"
        env: dict[str, str] = dict(kwargs.get("env") or {})
        limits = Limits.model_validate_json(self.default_limits or "{}")
        # No workspace sent (a manager with gateway.url): one of our own beside the runtime dir.
        # Only then is it ours to remove at the end: the embedded gateway's manager keeps its
        # workspaces at this very path, and a hibernated session's files must outlive its kernel.
        sent = ENV_WORKSPACE in env
        own = Path(self.runtime_dir).parent / "workspaces" / self.kernel_id if self.runtime_dir and not sent else None
        self.params = KernelParams.pop_from_env(env, limits, own)
        if self.params is None:
            raise RuntimeError("kernelmode provisioner: the kernel request carries no workspace")
        if own is not None and self.params.workspace == own:
            own.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._own_workspace = own
        kdir = self.kernel_dir
        kdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # ZMQ over ipc sockets in the kernel's own directory: no TCP port anywhere.
        km.transport = "ipc"
        km.cache_ports = False
        km.connection_file = str(kdir / "kernel.json")
        km.ip = str(kdir / "k")
        kwargs["env"] = env
        kwargs = await super().pre_launch(**kwargs)
        cmd, launch_env, cwd = self.wrap_command(kwargs.pop("cmd"), kwargs["env"], kdir)
        kwargs.update(cmd=cmd, env=launch_env, cwd=str(cwd))
        return kwargs

    async def post_launch(self, **kwargs: Any) -> None:
        await super().post_launch(**kwargs)
        await self._seal_kernel_dir()

    async def _seal_kernel_dir(self) -> None:
        """Once the kernel has bound its ipc sockets, take its directory back from it.

        The kernel needs to own the directory to bind its sockets; after that it must not rename,
        unlink or add entries there (swap a socket for a link the gateway would follow). The
        directory goes back to our uid, 0755: connecting needs write on the socket, not on the
        directory, so nothing else changes. Only where the kernel runs as a uid of its own (as
        root): with one uid for both, the kernel could chmod it back. Runs before the gateway
        answers the start (post_launch), so before any code of the kernel's runs; a restart's
        ``wrap_command`` hands the directory back to the new kernel.
        """
        kdir = self.kernel_dir
        if kdir.stat().st_uid == os.getuid():
            return
        info: dict[str, Any] = dict(self.connection_info)
        sockets = [Path(f"{info['ip']}-{info[key]}") for key in PORT_KEYS]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SEAL_WAIT_SECONDS
        while not all(_is_socket(p) for p in sockets):
            if self.process is not None and self.process.poll() is not None:
                return  # it died before binding: nothing to protect, a restart re-seals
            if loop.time() > deadline:
                log.warning("kernel %s did not bind its sockets in %.0f s; sealing its directory "
                            "anyway", self.kernel_id, SEAL_WAIT_SECONDS)
                break
            await asyncio.sleep(0.02)
        os.chown(kdir, os.getuid(), os.getgid())
        os.chmod(kdir, 0o755)

    async def poll(self) -> int | None:
        if self.process is None and self._launching:
            return None
        ret = await super().poll()
        if ret is not None and self.process is not None and not self._stopping:
            self._record_death(ret)
        return ret

    def _record_death(self, exit_code: int) -> None:
        if self._death_recorded or not self.state_dir:
            return
        self._death_recorded = True
        cause = cause_from_exit(exit_code, self.oom_killed())
        log.warning("kernel %s died: %s", self.kernel_id, cause.model_dump(exclude_none=True))
        write_death_record(Path(self.state_dir), self.kernel_id, cause, log_tail(self.log_path))

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._stopping = True
        await super().shutdown_requested(restart=restart)

    async def kill(self, restart: bool = False) -> None:
        if self.process is not None and self.process.poll() is not None and not self._stopping:
            self._record_death(self.process.returncode)
        self._stopping = True
        await super().kill(restart=restart)

    async def terminate(self, restart: bool = False) -> None:
        self._stopping = True
        await super().terminate(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        self.release(restart)
        if not restart:
            shutil.rmtree(self.kernel_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)
            if self._own_workspace is not None:  # made here (no manager's workspace): ours to remove
                shutil.rmtree(self._own_workspace, ignore_errors=True)


TAIL_BYTES = 4096  # read from the end of a dead kernel's log
TAIL_LINES = 5
TAIL_CHARS = 1000


def log_tail(path: Path) -> str:
    """The last few lines of a kernel's log (its fd 1 and 2: what a kernel that dies at start
    said, e.g. bwrap's or Python's error), bounded and printable ('' when there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        start = max(0, os.fstat(fd).st_size - TAIL_BYTES)
        f.seek(start)
        text = f.read(TAIL_BYTES).decode(errors="replace")
    raw = text.splitlines()[1 if start else 0:]  # the first line read from the middle is cut
    lines = ["".join(c if c.isprintable() else " " for c in line).strip() for line in raw]
    # A kernel restarted after each death appends the same lines again: each said once, the latest last.
    latest = list(dict.fromkeys(line for line in reversed(lines) if line))[:TAIL_LINES]
    return "\n".join(reversed(latest))[-TAIL_CHARS:]


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False
