"""The bubblewrap backend: each kernel in its own user/pid/net/ipc/uts/mount/cgroup namespaces.

What a kernel can see: the system (read-only), the kernel environment (read-only), its own
per-kernel directory (connection file and ipc sockets), its session's workspace at /mnt/data,
a private tmpfs /tmp, its egress dir at /run/kernelmode/egress (read-only; egress.py), and
nothing else of the host. There is no network namespace to reach: only ``lo`` exists inside, where
the egress bridge listens on 127.0.0.1:3128. When the gateway runs as root, each kernel also runs as its own
unprivileged host uid (uid_base + slot, leased host-wide: uids.py), so a kernel is not host
root even outside its namespaces, and RLIMIT_NPROC counts only its own processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from traitlets import Integer, Unicode

from . import cgroups, egress, seccomp, uids
from .base import KernelmodeProvisioner, kernel_environment, log
from .launcher import SECCOMP_FD
from .spec import PACKAGES_ENV, PACKAGES_MOUNT, WORKSPACE_MOUNT

LAUNCHER = str(Path(__file__).with_name("launcher.py"))
SANDBOX_UID = 1000  # the kernel's uid as seen inside the sandbox
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/fonts", "/etc/mime.types", "/etc/alternatives", "/etc/matplotlibrc",
)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the kernel its workspace; never follow a link the kernel may have planted."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


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
        *(["--ro-bind", str(egress_binds[0]), egress.EGRESS_MOUNT,
           "--ro-bind", str(egress_binds[1]), egress.BRIDGE_MOUNT] if egress_binds is not None else []),
        "--remount-ro", "/",
        "--chdir", WORKSPACE_MOUNT,
        "--clearenv",
    ]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    return [*argv, "--", *command]


class BwrapProvisioner(KernelmodeProvisioner):
    """Launches each kernel inside bubblewrap, with cgroup or rlimit caps."""

    bwrap_path = Unicode("bwrap", config=True)
    uid_base = Integer(200_000, config=True)
    uid_count = Integer(65_536, config=True)
    cgroups_mode = Unicode("auto", config=True, help="'auto' uses cgroups when writable; 'off'.")

    _cgroup: cgroups.KernelCgroup | None = None

    def _ro_paths(self, cmd: list[str]) -> list[str]:
        meta = (self.kernel_spec.metadata or {}).get("kernelmode", {})
        return list(meta.get("ro_paths", []))

    def wrap_command(
        self, cmd: list[str], env: dict[str, str], kdir: Path
    ) -> tuple[list[str], dict[str, str], Path]:
        assert self.params is not None
        limits = self.params.limits
        bwrap = shutil.which(self.bwrap_path)
        if bwrap is None:
            raise RuntimeError(f"kernelmode: bubblewrap ({self.bwrap_path}) is not installed")
        spec: dict[str, object] = {
            # Docker's default seccomp profile plus our denials (seccomp.py), compiled once.
            "seccomp": str(seccomp.bpf_file(self.runtime_dir)),
            "parent_pid": os.getpid(),  # the gateway: the launcher dies with it (launcher.py)
            "rlimits": {
                "cpu": limits.cpu_seconds,
                "fsize": limits.disk_mb * 1024 * 1024,
                "nofile": limits.open_files,
                "core": 0,
            }
        }
        rlimits = spec["rlimits"]
        assert isinstance(rlimits, dict)
        version = cgroups.detect() if self.cgroups_mode == "auto" else None
        if version:
            try:
                self._cgroup = cgroups.create(self.kernel_id, limits.memory_mb, limits.pids, version)
                spec["cgroup_procs"] = self._cgroup.procs_files
            except OSError as e:
                log.warning("cgroups refused (%s); falling back to rlimits", e)
                self._cgroup = None
        if self._cgroup is None:
            rlimits["as"] = limits.memory_mb * 1024 * 1024
        uid = gid = os.getuid()
        if os.getuid() == 0:
            uid = gid = uids.allocate(self.kernel_id, self.uid_base, self.uid_count)
            spec.update(uid=uid, gid=gid)
            # RLIMIT_NPROC binds only a non-root uid; here each kernel has its own (uids.py: host-wide).
            rlimits["nproc"] = limits.pids
            os.chown(kdir, uid, gid)
            for f in kdir.iterdir():
                os.chown(f, uid, gid, follow_symlinks=False)
            ws = self.params.workspace
            ws.mkdir(parents=True, exist_ok=True, mode=0o700)
            if ws.stat().st_uid != uid:
                _chown_tree(ws, uid, gid)
        etc_dir = self._write_etc()
        venv_bin = str(Path(cmd[0]).parent)
        kenv = kernel_environment(f"{venv_bin}:/usr/local/bin:/usr/bin:/bin")
        packages = self.params.packages_dir()
        if packages is not None:
            kenv[PACKAGES_ENV] = PACKAGES_MOUNT
        # The sandbox's first process is the egress bridge, which then execs the kernel.
        egress_dir = egress.prepare(Path(self.runtime_dir), self.kernel_id, gid)
        kenv.update(egress.environment())
        cmd, argv_env = egress.bridged(cmd, cmd[0])
        kenv.update(argv_env)
        argv = bwrap_argv(
            bwrap=bwrap,
            kernel_dir=kdir,
            etc_dir=etc_dir,
            workspace=self.params.workspace,
            ro_paths=self._ro_paths(cmd),
            tmp_bytes=limits.disk_mb * 1024 * 1024,
            env=kenv,
            command=cmd,
            packages=packages,
            egress_binds=(egress_dir, egress.bridge_file(self.runtime_dir)),
        )
        launcher = [sys.executable, "-I", LAUNCHER, json.dumps(spec), "--"]
        # bwrap itself starts from a scrubbed environment: its pid 1 inside the sandbox keeps
        # the environment it was started with (visible in /proc/1/environ).
        return launcher + argv, {"PATH": "/usr/local/bin:/usr/bin:/bin"}, kdir

    @property
    def etc_dir(self) -> Path:
        # Beside the kernel's directory, not in it: the kernel can write its own directory, and
        # root must never write through a link the kernel planted there.
        return Path(self.runtime_dir) / f"{self.kernel_id}.etc"

    def _write_etc(self) -> Path:
        """The sandbox's /etc/passwd, group and hosts: root-owned, read-only, out of reach."""
        etc = self.etc_dir
        etc.mkdir(mode=0o755, exist_ok=True)
        files = {
            "passwd": f"root:x:0:0::/root:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/tmp:/usr/sbin/nologin\n",
            "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n",
            "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        }
        for name, text in files.items():
            path = etc / name
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        return etc

    def oom_killed(self) -> bool:
        return self._cgroup is not None and self._cgroup.oom_kills() > 0

    def release(self, restart: bool) -> None:
        if self._cgroup is not None:
            self._cgroup.destroy()
            self._cgroup = None
        if not restart:
            uids.release(self.kernel_id)
            shutil.rmtree(self.etc_dir, ignore_errors=True)
            egress.remove(Path(self.runtime_dir), self.kernel_id)
        with contextlib.suppress(OSError):
            for sock in self.kernel_dir.glob("k-*"):
                sock.unlink()
