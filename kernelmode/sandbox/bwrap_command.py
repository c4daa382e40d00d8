"""The bubblewrap command line of one kernel: what the bwrap provisioner (in the gateway process)
runs, and what the manager's start-up check (kernelspec.check_bwrap) runs once to prove bwrap works
on this host. A pure function, tested on its own (tests/unit/test_units.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .launcher import SECCOMP_FD
from .spec import BRIDGE_MOUNT, EGRESS_MOUNT, PACKAGES_MOUNT, WORKSPACE_MOUNT

LAUNCHER = str(Path(__file__).with_name("launcher.py"))


def launcher_argv(spec: dict[str, object]) -> list[str]:
    """The launcher's command line, before the sandbox's: stdlib only, so ``-S`` (no site, none of
    the venv's .pth files) besides ``-I``; ~8 ms less of every kernel start (docs/performance-notes.md)."""
    return [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec), "--"]


SANDBOX_UID = 1000  # the kernel's uid as seen inside the sandbox
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/fonts", "/etc/mime.types", "/etc/alternatives", "/etc/matplotlibrc",
)


def bwrap_argv(
    *,
    bwrap: str,
    kernel_dir: Path,
    etc_dir: Path,
    workspace: Path,
    ro_paths: list[str],
    tmp_bytes: int,
    env: dict[str, str],
    command: list[str],
    seccomp_filter: bool = True,
    packages: Path | None = None,
    egress_binds: tuple[Path, Path] | None = None,
) -> list[str]:
    """The bwrap command line for one kernel (a pure function, tested on its own). With
    ``seccomp_filter``, the launcher puts the filter's descriptor in place of ``SECCOMP_FD``;
    ``egress_binds`` is (the kernel's egress dir, the bridge's source), both bound read-only."""
    argv = [
        bwrap,
        *(["--seccomp", SECCOMP_FD] if seccomp_filter else []),
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup (and mount) namespaces
        "--unshare-user",  # required, not just "try": --disable-userns depends on it
        "--disable-userns",  # no nested user namespaces from inside
        "--new-session",  # no TIOCSTI into the launcher's terminal (CVE-2017-5226)
        "--die-with-parent",
        "--cap-drop", "ALL",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox",
    ]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in ETC_FILES:
        argv += ["--ro-bind-try", f, f]
    for name in ("passwd", "group", "hosts"):
        argv += ["--ro-bind", str(etc_dir / name), f"/etc/{name}"]
    # The private /tmp first: host paths below /tmp (a checkout or data dir there) are bound
    # after it, on top of it, instead of being hidden by it.
    argv += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--tmpfs", "/tmp",
    ]
    for p in ro_paths:
        if not any(p == d or p.startswith(d + "/") for d in SYSTEM_DIRS):
            argv += ["--ro-bind", p, p]
    argv += [
        "--bind", str(kernel_dir), str(kernel_dir),
        "--bind", str(workspace), WORKSPACE_MOUNT,
        *(["--ro-bind", str(packages), PACKAGES_MOUNT] if packages is not None else []),
        *(["--ro-bind", str(egress_binds[0]), EGRESS_MOUNT,
           "--ro-bind", str(egress_binds[1]), BRIDGE_MOUNT] if egress_binds is not None else []),
        "--remount-ro", "/",
        "--chdir", WORKSPACE_MOUNT,
        "--clearenv",
    ]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    return [*argv, "--", *command]
