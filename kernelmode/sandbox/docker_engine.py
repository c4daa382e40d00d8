"""The Docker engine as both of kernelmode's processes see it: the labels and names of kernel
containers, their rlimits, the SDK client, and the manager's own calls (``remove_orphans`` at
start and stop, ``engine_status`` for ``sandbox.backend: auto`` and the doctor, ``check_docker``
at start). The provisioner that starts containers (in the gateway process) is docker_backend.py.

``check_docker`` has the engine grant the configured ceilings (``sandbox.max_limits``) once at
start, so a session within them is grantable.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import uuid
from pathlib import Path
from typing import Any

from ..errors import SandboxUnavailable
from ..models import LimitCeilings, Limits

log = logging.getLogger("kernelmode.sandbox")
LABEL_APP = "app"
LABEL_SERVER = "kernelmode.server"
LABEL_DATA_DIR = "kernelmode.data_dir"
LABEL_KERNEL_ID = "kernelmode.kernel_id"
LABEL_SESSION_ID = "kernelmode.session_id"
IMAGE_PYTHON = "python"  # on the image's PATH (its kernel venv)
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


def engine_client(timeout: int = 30) -> Any:
    import docker

    return docker.from_env(timeout=timeout)


def remove_orphans(server: str, keep: set[str] | frozenset[str] = frozenset()) -> int:
    """Remove this server's containers but those of the kernels in ``keep`` (adopted from a
    gateway that outlived its manager), and those of servers whose data dir is gone (a server
    that was killed and never came back)."""
    from docker.errors import DockerException

    n = 0
    try:
        for c in engine_client().containers.list(all=True, filters={"label": f"{LABEL_APP}=kernelmode"}):
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
        client = engine_client(timeout=5)
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

    ok, why = engine_status(image)
    if not ok:
        raise SandboxUnavailable(f"the Docker backend cannot run: {why}")
    limits: dict[str, Any] = {}
    if ceilings is not None:
        memory = ceilings.memory_mb * 1024 * 1024
        limits = {"ulimits": ulimits(ceilings), "pids_limit": ceilings.pids, "mem_limit": memory,
                  "memswap_limit": memory}
    client = engine_client(timeout=60)
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
