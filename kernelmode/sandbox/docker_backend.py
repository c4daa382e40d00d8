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
once, instead of a kernel that never connects. This module is the provisioner, loaded into the
gateway process; the labels, names and the manager's engine calls are in docker_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tornado import web
from traitlets import Float, Integer, Unicode

from ..protocol import PACKAGES_ENV
from . import egress, seccomp, uids
from .base import KernelmodeProvisioner, chown_tree, kernel_environment, log
from .docker_engine import (
    IMAGE_PYTHON,
    LABEL_APP,
    LABEL_DATA_DIR,
    LABEL_KERNEL_ID,
    LABEL_SERVER,
    LABEL_SESSION_ID,
    container_name,
    engine_client,
    ulimits,
)
from .spec import PACKAGES_MOUNT, WORKSPACE_MOUNT

LAUNCHER = str(Path(__file__).with_name("docker_launcher.py"))
LOG_CAP_MB = 10  # the engine's log of a kernel container, and what the launcher relays
START_WAIT_SECONDS = 90.0  # for the launcher to say whether its container started (its client: 60 s)


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
            chown_tree(ws, uid, uid)
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
                LABEL_SESSION_ID: self.params.session_id,
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
            return engine_client().containers.get(container_name(self.kernel_id))
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
