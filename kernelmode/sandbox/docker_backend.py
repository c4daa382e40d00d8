"""The Docker backend: each kernel in a container of the kernel image, with no network.

``--network none``, ``--read-only``, ``--cap-drop ALL``, ``no-new-privileges``, an unprivileged
uid of its own, pids/memory/CPU limits, a size-capped tmpfs ``/tmp``, the session's workspace at
``/mnt/data``, the kernel's ipc socket directory (at the same path as on the host, so the
connection file's socket paths hold on both sides) and its egress dir at /run/kernelmode/egress
(read-only; egress.py, with the bridge as the container's command): nothing else of the host. The container runs
through ``docker_launcher.py`` (the process the gateway watches); the engine is reached with the
Docker SDK. Containers carry the labels ``app=kernelmode``, ``kernelmode.session_id``,
``kernelmode.kernel_id`` and ``kernelmode.server`` (which `serve` made them, for orphan cleanup).

A kernel's start waits until its container runs: when the engine refuses it (a ulimit above the
engine's own hard limit, a full disk...), the gateway answers 503 with the engine's message at
once, instead of a kernel that never connects. ``check_docker`` has the engine grant the
configured ceilings (``sandbox.max_limits``) once at start, so a session within them is grantable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from tornado import web
from traitlets import Float, Integer, Unicode

from ..models import LimitCeilings, Limits
from . import egress, seccomp, uids
from .base import KernelmodeProvisioner, kernel_environment, log
from .bwrap import _chown_tree
from .spec import PACKAGES_ENV, PACKAGES_MOUNT, WORKSPACE_MOUNT

LAUNCHER = str(Path(__file__).with_name("docker_launcher.py"))
LABEL_APP = "app"
LABEL_SERVER = "kernelmode.server"
LABEL_DATA_DIR = "kernelmode.data_dir"
LABEL_KERNEL_ID = "kernelmode.kernel_id"
IMAGE_PYTHON = "python"  # on the image's PATH (its kernel venv)
LOG_CAP_MB = 10  # the engine's log of a kernel container, and what the launcher relays
START_WAIT_SECONDS = 90.0  # for the launcher to say whether its container started (its client: 60 s)
# The rlimit numbers in runc's "error setting rlimit type N", and the ceiling each comes from.
RLIMIT_KEYS = {0: "cpu_seconds", 1: "disk_mb", 7: "open_files"}


def ulimits(limits: Limits | LimitCeilings) -> list[dict[str, Any]]:
    """The container's rlimits (hard = soft: the kernel cannot raise them)."""
    fsize = limits.disk_mb * 1024 * 1024
    return [{"Name": "nofile", "Soft": limits.open_files, "Hard": limits.open_files},
            {"Name": "fsize", "Soft": fsize, "Hard": fsize},
            {"Name": "core", "Soft": 0, "Hard": 0},
            {"Name": "cpu", "Soft": limits.cpu_seconds, "Hard": limits.cpu_seconds}]


def server_id(data_dir: Path | str) -> str:
    """Which `serve` a container belongs to: several may share one engine."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]


def container_name(kernel_id: str) -> str:
    return f"kernelmode-{kernel_id}"


def _client(timeout: int = 30) -> Any:
    import docker

    return docker.from_env(timeout=timeout)


class DockerProvisioner(KernelmodeProvisioner):
    image = Unicode("kernelmode/kernel:latest", config=True, help="The kernel image.")
    cpus = Float(1.0, config=True, help="CPUs a kernel may use (--cpus).")
    uid_base = Integer(200_000, config=True, help="Kernel N runs as uid uid_base+N.")
    uid_count = Integer(65_536, config=True)
    server = Unicode("", config=True, help="The server id put on containers (kernelmode.server).")

    def wrap_command(
        self, cmd: list[str], env: dict[str, str], kdir: Path
    ) -> tuple[list[str], dict[str, str], Path]:
        assert self.params is not None
        limits = self.params.limits
        uid = uids.allocate(self.kernel_id, self.uid_base, self.uid_count)
        os.chown(kdir, uid, uid)
        for f in kdir.iterdir():
            os.chown(f, uid, uid, follow_symlinks=False)
        ws = self.params.workspace
        ws.mkdir(parents=True, exist_ok=True, mode=0o700)
        if ws.stat().st_uid != uid:
            _chown_tree(ws, uid, uid)
        memory = limits.memory_mb * 1024 * 1024
        etc = self._write_etc()
        kenv = kernel_environment("/opt/kernel-venv/bin:/usr/local/bin:/usr/bin:/bin")
        # The image is headless (Agg) for scripts; in a kernel, figures are displayed inline.
        kenv["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        packages = self.params.packages_dir()
        if packages is not None:
            kenv[PACKAGES_ENV] = PACKAGES_MOUNT
        # The container's command is the egress bridge, which then execs the kernel.
        egress_dir = egress.prepare(Path(self.runtime_dir), self.kernel_id, uid)
        kenv.update(egress.environment())
        command, argv_env = egress.bridged([IMAGE_PYTHON, *cmd[1:]], IMAGE_PYTHON)
        kenv.update(argv_env)
        create: dict[str, Any] = {
            "image": self.image,
            "command": command,
            "user": f"{uid}:{uid}",
            "environment": kenv,
            "working_dir": WORKSPACE_MOUNT,
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": limits.pids,
            "mem_limit": memory,
            "memswap_limit": memory,  # no swap: the cap is the cap
            "nano_cpus": int(self.cpus * 1e9),
            # /sys empty (as with bubblewrap): the host's kernel and devices are none of its business.
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.disk_mb}m,mode=1777", "/sys": "ro,size=1k"},
            "volumes": {
                str(ws): {"bind": WORKSPACE_MOUNT, "mode": "rw"},
                str(kdir): {"bind": str(kdir), "mode": "rw"},
                **({str(packages): {"bind": PACKAGES_MOUNT, "mode": "ro"}} if packages is not None else {}),
                str(egress_dir): {"bind": egress.EGRESS_MOUNT, "mode": "ro"},
                str(egress.bridge_file(self.runtime_dir)): {"bind": egress.BRIDGE_MOUNT, "mode": "ro"},
                # Not the engine's copies: they would carry the host's name servers.
                **{str(etc / name): {"bind": f"/etc/{name}", "mode": "ro"} for name in ("hosts", "resolv.conf")},
            },
            # A tiny init as pid 1: the kernel can be killed by a signal like any process (pid 1
            # ignores them), and its exit says how it ended.
            "init": True,
            "ulimits": ulimits(limits),
            "labels": {
                LABEL_APP: "kernelmode",
                "kernelmode.session_id": self.params.session_id,
                LABEL_KERNEL_ID: self.kernel_id,
                LABEL_SERVER: self.server,
                LABEL_DATA_DIR: str(Path(self.runtime_dir).parent),
            },
            "hostname": "sandbox",
            # What the kernel writes to fd 1/2 is kept by the engine too: bounded, like the
            # bubblewrap kernel's log is by RLIMIT_FSIZE.
            "log_config": {"type": "json-file", "config": {"max-size": f"{LOG_CAP_MB}m", "max-file": "1"}},
            "auto_remove": False,  # kept until cleanup: its OOMKilled state says why it died
        }
        spec = {"name": container_name(self.kernel_id), "create": create,
                "parent_pid": os.getpid(),  # the gateway: the launcher dies with it (docker_launcher.py)
                "log_cap_bytes": LOG_CAP_MB * 1024 * 1024, "status_file": str(self.status_path),
                # Docker's default seccomp profile plus our denials (seccomp.py): the launcher
                # adds it to security_opt (a file, not ~20 KB of JSON on a command line).
                "seccomp_profile": str(seccomp.profile_file(self.runtime_dir))}
        launcher_env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
        if os.environ.get("DOCKER_HOST"):
            launcher_env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        # -I: nothing from the environment or the (kernel-writable) cwd; the script's own
        # directory (root-owned) holds no module named like the SDK.
        return [sys.executable, "-I", LAUNCHER, json.dumps(spec)], launcher_env, kdir

    @property
    def status_path(self) -> Path:
        """Where the launcher says whether the container started (root's, beside the etc dir)."""
        return Path(self.runtime_dir) / f"{self.kernel_id}.started"

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        self.status_path.unlink(missing_ok=True)
        info = await super().launch_kernel(cmd, **kwargs)
        refusal = await self._container_started()
        if refusal is not None:
            # Nothing runs and the gateway will not clean up a kernel that failed to launch.
            self._stopping = True  # not a death: no record, no restart
            launcher = self.process
            with contextlib.suppress(Exception):
                if launcher is not None:
                    await asyncio.to_thread(launcher.wait, 10)  # it exits right after saying so
                await self.cleanup(restart=False)
            # The gateway answers with log_message as it is (tornado's str() %-formats it).
            message = f"the Docker engine refused the kernel's container: {refusal}"
            raise web.HTTPError(503, message.replace("%", "%%"))
        return info

    async def _container_started(self) -> str | None:
        """None once the container runs; the engine's message when it was refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_WAIT_SECONDS
        while loop.time() < deadline:
            try:
                status = json.loads(self.status_path.read_text())
            except (OSError, ValueError):
                status = None
            if status is not None:
                self.status_path.unlink(missing_ok=True)
                return None if status.get("started") else str(status.get("error") or "unknown error")
            if self.process is not None and (code := self.process.poll()) is not None:
                return f"the container launcher exited with code {code} (see the kernel's log)"
            await asyncio.sleep(0.05)
        log.warning("kernel %s: no word from its container launcher after %.0f s", self.kernel_id,
                    START_WAIT_SECONDS)
        return None  # slow, not refused: the manager's own start timeout decides

    @property
    def etc_dir(self) -> Path:
        # Beside the kernel's directory, not in it: root never writes where the kernel can.
        return Path(self.runtime_dir) / f"{self.kernel_id}.etc"

    def _write_etc(self) -> Path:
        etc = self.etc_dir
        etc.mkdir(mode=0o755, exist_ok=True)
        for name, text in {"hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n", "resolv.conf": ""}.items():
            path = etc / name
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        return etc

    def _container(self) -> Any:
        from docker.errors import DockerException

        try:
            return _client().containers.get(container_name(self.kernel_id))
        except DockerException:
            return None

    def oom_killed(self) -> bool:
        c = self._container()
        return bool(c is not None and c.attrs.get("State", {}).get("OOMKilled"))

    async def kill(self, restart: bool = False) -> None:
        await super().kill(restart=restart)
        self._remove()  # the launcher may be gone without stopping its container

    def _remove(self) -> None:
        from docker.errors import DockerException

        c = self._container()
        if c is not None:
            with contextlib.suppress(DockerException):
                c.remove(force=True)

    def release(self, restart: bool) -> None:
        self._remove()
        if not restart:
            uids.release(self.kernel_id)
            shutil.rmtree(self.etc_dir, ignore_errors=True)
            self.status_path.unlink(missing_ok=True)
            egress.remove(Path(self.runtime_dir), self.kernel_id)
        with contextlib.suppress(OSError):
            for sock in self.kernel_dir.glob("k-*"):
                sock.unlink()


def remove_orphans(server: str, keep: set[str] | frozenset[str] = frozenset()) -> int:
    """Remove this server's containers but those of the kernels in ``keep`` (adopted from a
    gateway that outlived its manager), and those of servers whose data dir is gone (a server
    that was killed and never came back)."""
    from docker.errors import DockerException

    n = 0
    try:
        for c in _client().containers.list(all=True, filters={"label": f"{LABEL_APP}=kernelmode"}):
            data_dir = c.labels.get(LABEL_DATA_DIR)
            gone = data_dir is not None and not Path(data_dir).exists()
            mine = c.labels.get(LABEL_SERVER) == server and c.labels.get(LABEL_KERNEL_ID) not in keep
            if mine or gone:
                with contextlib.suppress(DockerException):
                    c.remove(force=True)
                    n += 1
    except DockerException as e:
        log.warning("could not list kernel containers: %s", e)
    return n


def engine_status(image: str) -> tuple[bool, str]:
    """(usable, why): the engine answers and the kernel image exists."""
    try:
        from docker.errors import DockerException, ImageNotFound
    except ImportError:
        return False, "the docker Python package is not installed"
    try:
        client = _client(timeout=5)
        client.ping()
    except DockerException as e:
        return False, f"no Docker engine reachable ({e})"
    try:
        client.images.get(image)
    except ImageNotFound:
        return False, f"the kernel image {image} does not exist (build it: make docker-setup)"
    except DockerException as e:
        return False, f"the Docker engine failed: {e}"
    return True, f"engine reachable, image {image} present"


def check_docker(image: str, ceilings: LimitCeilings | None = None) -> str:
    """Run one throw-away kernel container, with the ``ceilings`` as its limits (so every
    session within them is grantable); return a description or raise SandboxUnavailable."""
    from docker.errors import DockerException

    from ..errors import SandboxUnavailable

    ok, why = engine_status(image)
    if not ok:
        raise SandboxUnavailable(f"the Docker backend cannot run: {why}")
    limits: dict[str, Any] = {}
    if ceilings is not None:
        memory = ceilings.memory_mb * 1024 * 1024
        limits = {"ulimits": ulimits(ceilings), "pids_limit": ceilings.pids, "mem_limit": memory,
                  "memswap_limit": memory}
    client = _client(timeout=60)
    name = f"kernelmode-check-{uuid.uuid4().hex[:12]}"
    try:
        out = client.containers.run(
            image, [IMAGE_PYTHON, "-c", "import ipykernel, socket, os; print(socket.if_nameindex(), os.getuid())"],
            name=name, network_mode="none", read_only=True, cap_drop=["ALL"],
            security_opt=["no-new-privileges"], user="65534:65534", remove=True,
            environment={"HOME": "/tmp"}, tmpfs={"/tmp": "size=16m"}, **limits,
        )
    except DockerException as e:
        # `remove` applies to a container that ran: one the engine refused to start stays "Created".
        with contextlib.suppress(DockerException):
            client.containers.get(name).remove(force=True)
        m = re.search(r"rlimit type (\d+)", str(e))
        if ceilings is not None and m and int(m.group(1)) in RLIMIT_KEYS:
            key = RLIMIT_KEYS[int(m.group(1))]
            raise SandboxUnavailable(
                f"the Docker engine cannot grant sandbox.max_limits.{key} ({getattr(ceilings, key)}): "
                f"lower it (to at most the engine's own hard limit; see /proc/$(pidof dockerd)/limits): "
                f"{e}") from e
        raise SandboxUnavailable(f"a test container of {image} failed: {e}") from e
    return f"docker ok ({image}); inside: {out.decode().strip()}"
