"""`kernelmode doctor`: check everything `serve` needs, with what to do about each missing piece.

The checks are the ones `serve` makes at start-up, called here without starting anything:
the throw-away bubblewrap sandbox (`sandbox.kernelspec.check_bwrap`), the Docker engine and a
test container (`sandbox.docker_engine`), the kernel environment probe, cgroup detection, the
workspace-volume probe (`artifacts.volume`), and the artifact store's own start. ``fail`` means
`serve` would not start (or `/readyz` would not be ready); ``warn`` means it runs with a weaker
fallback that the check names.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from .config import Settings
from .errors import KernelmodeError
from .sandbox import cgroups
from .sandbox.kernelspec import INSTALL_HINT, check_bwrap, kernel_env_paths

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Report:
    backend: str  # the backend `serve` would use (auto resolved)
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "backend": self.backend, "checks": [asdict(c) for c in self.checks]}

    def text(self) -> str:
        head = "serve can run" if self.ok else "serve cannot run"
        lines = [f"kernelmode doctor: {head} (sandbox backend: {self.backend})"]
        for c in self.checks:
            lines.append(f"  {c.status.upper() if c.status == 'fail' else c.status:<5} {c.name}: {c.detail}")
            if c.fix and c.status != "ok":
                lines.append(f"        fix: {c.fix}")
        return "\n".join(lines)


def _nearest_existing(path: Path) -> Path:
    return next(p for p in [path, *path.parents] if p.exists())


def _gateway_config(s: Settings) -> Check:
    d = s.gateway.config_dir
    missing = [n for n in ("kernel_gateway_config.py", "kernelspec.json") if not (d / n).is_file()]
    if missing:
        return Check("gateway config", "fail", f"{', '.join(missing)} missing in {d}",
                     "reinstall kernelmode (the files ship inside the package), or set "
                     "gateway.config_dir (KERNELMODE_GATEWAY__CONFIG_DIR) to a directory holding them")
    if importlib.util.find_spec("kernel_gateway") is None:
        return Check("gateway config", "fail", "the jupyter-kernel-gateway package is not installed",
                     "pip install kernelmode (it depends on jupyter-kernel-gateway)")
    if s.gateway.url:  # serve would start none: the external one must answer with its token
        return _external_gateway(s)
    return Check("gateway config", "ok", f"embedded (serve starts it): {d}")


def _external_gateway(s: Settings) -> Check:
    from .errors import ConfigError
    from .gateway.remote import check_external

    url = s.gateway.url
    assert url is not None
    try:
        version = asyncio.run(check_external(url, s.gateway.auth_token, s.gateway.validate_cert))
    except ConfigError as e:
        return Check("gateway config", "fail", f"external: {e.message}",
                     "check gateway.url and gateway.auth_token (KERNELMODE_GATEWAY__URL, __AUTH_TOKEN)")
    return Check("gateway config", "ok", f"external (serve starts none): {url}, version {version}")


def _data_dir(s: Settings) -> Check:
    d = s.server.data_dir.absolute()
    base = _nearest_existing(d)
    if not os.access(base, os.W_OK | os.X_OK):
        return Check("data dir", "fail", f"{d}: {base} is not writable by this user",
                     "give serve a writable --data-dir (server.data_dir)")
    if os.getuid() == 0:
        for p in [base, *base.parents]:
            if not p.stat().st_mode & 0o001:
                return Check("data dir", "fail", f"{p} is not searchable by other users, so the "
                             "sandboxed kernels (other uids) cannot reach their workspaces",
                             f"`chmod o+x {p}`, or put the data dir elsewhere (--data-dir)")
    lock = d / "serve.lock"
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            return Check("data dir", "fail", f"{d} is in use by another kernelmode serve (pid {owner})",
                         "stop that serve, or give this one another --data-dir")
        finally:
            os.close(fd)
    return Check("data dir", "ok", f"{d}" + ("" if d.exists() else " (created at start)"))


def _port(s: Settings) -> Check:
    host, port = s.server.host, s.server.port
    if port == 0:
        return Check("port", "ok", f"{host}: any free port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return Check("port", "fail", f"cannot listen on {host}:{port}: {e.strerror}",
                     "stop what holds the port, or choose another (--port, server.port)")
    return Check("port", "ok", f"{host}:{port} is free")


def _docker(s: Settings) -> tuple[bool, Check]:
    """(usable, check) for the engine and the kernel image."""
    backend = s.sandbox.backend
    if backend in ("bwrap", "none"):
        return False, Check("docker", "skip", f"not used (backend {backend})")
    from .sandbox.docker_engine import engine_status

    usable, why = engine_status(s.sandbox.docker_image)
    fix = ("`make docker-setup` (installs an engine and builds the image), or build "
           "kernel-image/ yourself: docker build -t kernelmode/kernel:latest kernel-image")
    if usable:
        return True, Check("docker", "ok", why)
    if backend == "docker":
        return False, Check("docker", "fail", why, fix)
    return False, Check("docker", "skip", f"auto falls back to bwrap: {why}",
                        f"for the Docker backend: {fix}")


def _docker_sandbox(s: Settings) -> Check:
    from .sandbox.docker_engine import check_docker

    try:
        return Check("docker sandbox", "ok", check_docker(s.sandbox.docker_image, s.sandbox.max_limits))
    except KernelmodeError as e:
        return Check("docker sandbox", "fail", e.message,
                     "see the engine's log; rebuild the image with `make docker-setup`")


def _kernel_env(s: Settings, needed: bool) -> Check:
    python = s.sandbox.kernel_python
    fix = (f"`kernelmode setup` (builds {python.parent.parent} from the kernel requirements), or "
           "point sandbox.kernel_python (KERNELMODE_SANDBOX__KERNEL_PYTHON) at a Python with ipykernel")
    try:
        paths = kernel_env_paths(python)
    except KernelmodeError as e:
        return Check("kernel environment", "fail" if needed else "warn", e.message, fix)
    return Check("kernel environment", "ok", f"{python} (mounted read-only: {', '.join(paths)})")


def _user_namespaces() -> str:
    """What the kernel allows, for a failing bubblewrap check's message."""
    out = []
    for f in ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone",
              "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"):
        with contextlib.suppress(OSError):
            out.append(f"{f}={Path(f).read_text().strip()}")
    return "; ".join(out)


def _bwrap(s: Settings, needed: bool, env_ok: bool) -> Check:
    level: Status = "fail" if needed else "warn"
    if shutil.which(s.sandbox.bwrap_path) is None:
        return Check("bubblewrap", level, f"{s.sandbox.bwrap_path} not found", INSTALL_HINT)
    if not env_ok:
        return Check("bubblewrap", "skip", "needs the kernel environment to try a sandbox")
    data_dir = s.server.data_dir.absolute()
    with tempfile.TemporaryDirectory(dir=data_dir if data_dir.is_dir() else None,
                                     prefix="doctor-") as tmp:
        os.chmod(tmp, 0o711)
        try:
            return Check("bubblewrap", "ok", check_bwrap(s.sandbox.bwrap_path, s.sandbox.kernel_python,
                                                         Path(tmp)))
        except KernelmodeError as e:
            return Check("bubblewrap", level, f"{e.message} [{_user_namespaces()}]",
                         "enable unprivileged user namespaces (sysctl user.max_user_namespaces=15000, "
                         "kernel.unprivileged_userns_clone=1, or an AppArmor profile for bwrap), or "
                         "use the Docker backend")


def _cgroups(s: Settings) -> Check:
    if s.sandbox.cgroups == "off":
        return Check("cgroups", "skip", "sandbox.cgroups is off: rlimits only")
    version = cgroups.detect()
    if version:
        return Check("cgroups", "ok", f"{version}: per-kernel memory and pids caps")
    return Check("cgroups", "warn", "no writable cgroup hierarchy with memory and pids: limits fall "
                 "back to rlimits (address space instead of memory; no pids cap unless root)",
                 "run serve as root on a machine with cgroup v2 (memory and pids controllers), or "
                 "delegate a cgroup subtree to its user")


def _workspace_quota(s: Settings) -> Check:
    from .artifacts.volume import WorkspaceVolumes

    if s.sandbox.workspace_quota == "off":
        return Check("workspace quota", "skip", "sandbox.workspace_quota is off: plain directories")
    data_dir = s.server.data_dir.absolute()
    with tempfile.TemporaryDirectory(dir=data_dir if data_dir.is_dir() else None, prefix="doctor-") as tmp:
        how = WorkspaceVolumes(Path(tmp), s.sandbox.workspace_quota).start()  # the probe serve runs
    if how.startswith("off"):
        return Check("workspace quota", "warn", f"{how}: a workspace can fill the host's disk "
                     "(only single files are capped)",
                     "run serve as root with loop devices (/dev/loop-control) and mkfs.ext4 "
                     "(apt-get install e2fsprogs)")
    return Check("workspace quota", "ok", how)


def _store(s: Settings) -> Check:
    cfg = s.artifacts
    if cfg.store == "local":
        d = s.server.data_dir.absolute() / "artifacts"
        base = _nearest_existing(d)
        if not os.access(base, os.W_OK | os.X_OK):
            return Check("artifact store", "fail", f"local: {base} is not writable",
                         "give serve a writable --data-dir")
        return Check("artifact store", "ok", f"local: {d}")
    from .artifacts.s3 import S3Store
    from .errors import StoreError

    async def probe() -> None:
        store = S3Store(cfg)
        try:
            await store.start()  # what serve does: reach the endpoint, create the bucket if missing
        finally:
            await store.stop()

    try:
        asyncio.run(probe())
    except (StoreError, ValueError) as e:
        return Check("artifact store", "fail", f"s3: {e}",
                     "check artifacts.endpoint, secure, access_key, secret_key and bucket; runs "
                     "would report artifact_error and /readyz would not be ready")
    return Check("artifact store", "ok", f"s3: {cfg.endpoint}, bucket {cfg.bucket!r}")


def _session_store(s: Settings) -> Check:
    """Where sessions are kept: the SQLite file, or the PostgreSQL database (reached, not changed)."""
    if s.store.url is None:
        return Check("session store", "ok", f"SQLite: {s.server.data_dir.absolute() / 'sessions.sqlite3'}")
    from .errors import ConfigError
    from .sessions.store.postgres import probe

    try:
        return Check("session store", "ok", probe(s.store.url))
    except ConfigError as e:
        return Check("session store", "fail", str(e), "check store.url (user, password, host, port, "
                     "database) and that the PostgreSQL server answers; serve would not start")


def diagnose(s: Settings) -> Report:
    """Every check, for the backend `serve` would choose with these settings."""
    checks = [_gateway_config(s), _data_dir(s), _port(s)]
    docker_usable, docker = _docker(s)
    checks.append(docker)
    backend = s.sandbox.backend
    if backend == "auto":
        backend = "docker" if docker_usable else "bwrap"
    if backend == "docker":
        checks.append(_docker_sandbox(s))
    env = _kernel_env(s, needed=backend in ("bwrap", "none"))
    checks.append(env)
    if backend == "none":
        checks.append(Check("bubblewrap", "skip", "backend none: NO isolation (development only)"))
    else:
        checks.append(_bwrap(s, needed=backend == "bwrap", env_ok=env.status == "ok"))
    if backend == "bwrap":
        checks.append(_cgroups(s))
    checks.append(_workspace_quota(s))
    checks.append(_store(s))
    checks.append(_session_store(s))
    return Report(backend, checks)
