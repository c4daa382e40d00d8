"""The seccomp filter of every sandboxed kernel: Docker's default profile, less what we deny.

One source for both backends. ``docker-seccomp-default.json`` beside this module is Docker's
default profile verbatim (moby/profiles ``seccomp/default.json`` v0.2.3, as vendored in
moby/moby). :func:`profile` takes it and

- removes every name of :data:`DENIED` from every rule (Docker's default allows ``ptrace`` and
  ``process_vm_readv/writev`` on kernels >= 4.8, and the rest behind capabilities a kernel never
  has): those calls then fail with the default action, EPERM;
- keeps only each architecture's native ABI (no 32-bit x86 or x32 on x86-64): a foreign-ABI
  call is refused, which closes the compat syscall layer to kernel code.

Docker gets that profile as JSON (``--security-opt seccomp=...``). bubblewrap gets it compiled
to classic BPF by libseccomp (:func:`compile_bpf`, through ``pyseccomp``) and passed as
``bwrap --seccomp FD``; bwrap applies it after setting up the sandbox, so its own mounts and
namespaces are unaffected. The rules are evaluated as Docker evaluates them for a container
with no capabilities (``cap_drop: ALL``), which is what a kernel is under both backends.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

UPSTREAM = Path(__file__).with_name("docker-seccomp-default.json")

# What kernel code may never call, on top of what Docker's default already refuses.
DENIED: frozenset[str] = frozenset({
    # Debugging and reading other processes (the sandbox's pid 1 included).
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    # Kernel attack surface an analysis kernel has no use for.
    "perf_event_open", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register",
    # The kernel keyring: not namespaced, a long record of bugs.
    "keyctl", "add_key", "request_key",
    # System administration (Docker's default allows these only with capabilities a kernel
    # never has; listed so that they stay refused whatever the capabilities).
    "mount", "umount", "umount2", "pivot_root", "chroot", "setns", "unshare", "fsopen",
    "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "stime", "clock_settime", "clock_settime64",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "iopl", "ioperm", "quotactl",
    "quotactl_fd", "vm86", "vm86old", "syslog", "vhangup", "fanotify_init",
})

# Docker's architecture names (the profile's "arches") by Python's platform.machine().
_DOCKER_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x",
                "riscv64": "riscv64"}


@cache
def profile() -> dict[str, Any]:
    """Docker's default profile with :data:`DENIED` removed and native ABIs only."""
    prof: dict[str, Any] = json.loads(UPSTREAM.read_text())
    for arch in prof.get("archMap") or []:
        arch["subArchitectures"] = None
    rules = []
    for rule in prof["syscalls"]:
        names = [n for n in rule["names"] if n not in DENIED]
        if names:
            rules.append({**rule, "names": names})
    prof["syscalls"] = rules
    return prof


def _kernel_version() -> tuple[int, ...]:
    release = platform.release().split("-")[0]
    return tuple(int(p) for p in release.split(".")[:2] if p.isdigit())


def _applies(rule: dict[str, Any], arch: str, kernel: tuple[int, ...]) -> bool:
    """Whether Docker would put ``rule`` in a capability-less container's filter."""
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if inc.get("caps"):  # needs a capability: a kernel has none
        return False
    if inc.get("arches") and arch not in inc["arches"]:
        return False
    if exc.get("arches") and arch in exc["arches"]:
        return False
    if inc.get("minKernel"):
        wanted = tuple(int(p) for p in str(inc["minKernel"]).split(".")[:2])
        if kernel < wanted:
            return False
    return True


def compile_bpf() -> bytes:
    """:func:`profile` as a classic-BPF program for this machine, as ``bwrap --seccomp`` reads it."""
    import pyseccomp as sc

    prof = profile()
    default_errno = int(prof.get("defaultErrnoRet") or errno.EPERM)
    f = sc.SyscallFilter(sc.ERRNO(default_errno))
    # A call of another ABI (int 0x80, x32) ends the process, as a filter without that
    # architecture does under Docker.
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    ops = {"SCMP_CMP_NE": sc.NE, "SCMP_CMP_LT": sc.LT, "SCMP_CMP_LE": sc.LE, "SCMP_CMP_EQ": sc.EQ,
           "SCMP_CMP_GE": sc.GE, "SCMP_CMP_GT": sc.GT, "SCMP_CMP_MASKED_EQ": sc.MASKED_EQ}
    arch = _DOCKER_ARCH.get(platform.machine(), platform.machine())
    kernel = _kernel_version()
    for rule in prof["syscalls"]:
        if not _applies(rule, arch, kernel):
            continue
        if rule["action"] == "SCMP_ACT_ALLOW":
            action = sc.ALLOW
        elif rule["action"] == "SCMP_ACT_ERRNO":
            action = sc.ERRNO(int(rule.get("errnoRet") or default_errno))
        else:
            raise ValueError(f"seccomp profile: unsupported action {rule['action']}")
        args = [sc.Arg(a["index"], ops[a["op"]], a["value"], a.get("valueTwo", 0))
                for a in rule.get("args") or []]
        for name in rule["names"]:
            # Names this libseccomp does not know (-1) or that do not exist on this architecture
            # (other negative pseudo-numbers) are skipped, as runc skips them.
            if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
                continue
            if action == sc.ERRNO(default_errno):
                continue  # the default already: libseccomp refuses such a rule
            f.add_rule(action, name, *args)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _write_once(path: Path, data: bytes) -> Path:
    """Write ``data`` at ``path`` (root-owned, world-readable) unless it is there already."""
    try:
        if path.read_bytes() == data:
            return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
    return path


@cache
def bpf_file(directory: str) -> Path:
    """The compiled filter in ``directory`` (out of every kernel's reach), made once a process."""
    return _write_once(Path(directory) / "seccomp.bpf", compile_bpf())


@cache
def profile_file(directory: str) -> Path:
    """The profile as JSON in ``directory``, for the Docker launcher, made once a process."""
    return _write_once(Path(directory) / "seccomp.json", json.dumps(profile()).encode())
