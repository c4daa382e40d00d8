"""What the manager tells the provisioner about one kernel, and what the provisioner tells back.

Down: the manager puts ``KERNEL_KM_*`` variables in the POST /api/kernels body; Kernel Gateway
passes ``KERNEL_*`` variables on to the provisioner, which removes them from the kernel's
environment. Up: when a kernel dies on its own, the provisioner writes a death record that the
manager reads to report the cause. Both sides import this module, so the names live here once.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..models import DeathCause, Limits

ENV_WORKSPACE = "KERNEL_KM_WORKSPACE"
ENV_LIMITS = "KERNEL_KM_LIMITS"
ENV_SESSION = "KERNEL_KM_SESSION_ID"
ENV_PACKAGES = "KERNEL_KM_PACKAGES"
WORKSPACE_MOUNT = "/mnt/data"
# The session's package layer (kernelmode/packages/layer.py), mounted read-only; the preamble
# appends the path the kernel sees (protocol.PACKAGES_ENV in its environment; not KERNELMODE_*: no
# setting of the manager's reaches a kernel) to sys.path.
PACKAGES_MOUNT = "/opt/kernelmode/packages"
EGRESS_MOUNT = "/run/kernelmode/egress"  # the kernel's egress dir, inside the sandbox (sandbox/egress.py)
BRIDGE_MOUNT = "/run/kernelmode/egress-bridge.py"  # the in-sandbox bridge's source


@dataclass(frozen=True)
class KernelParams:
    workspace: Path
    limits: Limits
    session_id: str = ""
    packages: Path | None = None  # the host directory of the session's package layer

    def to_env(self) -> dict[str, str]:
        return {
            ENV_WORKSPACE: str(self.workspace),
            ENV_LIMITS: self.limits.model_dump_json(),
            ENV_SESSION: self.session_id,
            **({ENV_PACKAGES: str(self.packages)} if self.packages is not None else {}),
        }

    def packages_dir(self) -> Path | None:
        """The layer to mount, if the manager gave one and it exists."""
        return self.packages if self.packages is not None and self.packages.is_dir() else None

    @classmethod
    def pop_from_env(cls, env: dict[str, str], default_limits: Limits,
                     default_workspace: Path | None = None) -> KernelParams | None:
        """Take the parameters out of ``env`` (they must not reach the kernel). A manager that
        drives this gateway from elsewhere (``gateway.url``) sends no workspace: then
        ``default_workspace``, the gateway's own."""
        workspace = env.pop(ENV_WORKSPACE, None)
        limits = env.pop(ENV_LIMITS, None)
        session_id = env.pop(ENV_SESSION, "")
        packages = env.pop(ENV_PACKAGES, None)
        remote_limits = _launch_limits(env)
        if workspace is None and (limits is not None or remote_limits is not None) and default_workspace is not None:
            workspace = str(default_workspace)
        if workspace is None:
            return None
        parsed = Limits.model_validate_json(limits) if limits else remote_limits or default_limits
        return cls(Path(workspace), parsed, session_id, Path(packages) if packages else None)


# The limits a manager with gateway.url sends (gateway/launch.py: plain checked numbers, the
# names an Enterprise Gateway's pod template reads too).
LAUNCH_LIMITS = {"memory_mb": "KERNEL_MEMORY_MB", "cpu_seconds": "KERNEL_CPU_SECONDS",
                 "pids": "KERNEL_PIDS", "disk_mb": "KERNEL_DISK_MB", "open_files": "KERNEL_OPEN_FILES"}


def _launch_limits(env: dict[str, str]) -> Limits | None:
    """The limits of a start from a manager with gateway.url (None: it sent none); a value
    that is not a valid limit fails the start, as a bad KERNEL_KM_LIMITS does."""
    if not all(name in env for name in LAUNCH_LIMITS.values()):
        return None
    return Limits.model_validate({key: env[name] for key, name in LAUNCH_LIMITS.items()})


def death_record_path(state_dir: Path, kernel_id: str) -> Path:
    return state_dir / "deaths" / f"{kernel_id}.json"


def cause_from_exit(exit_code: int | None, oom: bool) -> DeathCause:
    """bwrap reports a child killed by signal N as exit code 128+N."""
    if oom:
        return DeathCause(kind="oom", exit_code=exit_code, signal=9)
    if exit_code is None:
        return DeathCause(kind="unknown")
    if exit_code < 0:  # an unsandboxed kernel killed by a signal (subprocess convention)
        return DeathCause(kind="signal", signal=-exit_code)
    if exit_code > 128:
        return DeathCause(kind="signal", exit_code=exit_code, signal=exit_code - 128)
    return DeathCause(kind="exit", exit_code=exit_code)


def write_death_record(state_dir: Path, kernel_id: str, cause: DeathCause, output: str = "") -> None:
    """The cause, and ``output``: the last lines the kernel wrote to its log (fd 1 and 2), which
    say why a kernel that dies at start died (the manager reports them for a failed start only)."""
    path = death_record_path(state_dir, kernel_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
        f.write(json.dumps({**cause.model_dump(), OUTPUT_KEY: output}))
    os.replace(f.name, path)


OUTPUT_KEY = "output"  # beside the cause's fields in a death record (DeathCause ignores it)


def pop_death(state_dir: Path, kernel_id: str) -> tuple[DeathCause, str] | None:
    """The kernel's death record, once: its cause and its last output."""
    path = death_record_path(state_dir, kernel_id)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    output = data.pop(OUTPUT_KEY, "") if isinstance(data, dict) else ""
    return DeathCause.model_validate(data), str(output)


def pop_death_record(state_dir: Path, kernel_id: str) -> DeathCause | None:
    died = pop_death(state_dir, kernel_id)
    return died[0] if died is not None else None
