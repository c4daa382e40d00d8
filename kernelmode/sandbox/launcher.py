"""Last step before the sandbox: join cgroups, set rlimits, drop to the kernel's uid, exec.

Run as ``python -I -S launcher.py SPEC_JSON -- COMMAND...`` by the bwrap provisioner. It is a
standalone stdlib script (run by path, isolated mode, no site) so it starts fast and trusts nothing from
the environment. The order matters: cgroups and rlimits are applied while still privileged, then
the uid is dropped so that the sandbox (bwrap) runs as an unprivileged host user; ``exec`` keeps
the pid, so the gateway still sees bwrap's exit status as the kernel's. When the spec names a
compiled seccomp filter, it is opened here and its descriptor handed to bwrap: the command's
``--seccomp SECCOMP_FD`` placeholder becomes ``--seccomp N`` (bwrap reads the filter from fd N).

The launcher dies with the gateway that started it (``die_with_parent``): a start the gateway
never finished (it was stopped meanwhile) must not leave a sandbox running. The signal is set
after the uid drop (a change of credentials clears it) and kept across the exec; bwrap's own
``--die-with-parent`` then takes the sandbox down with it.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SECCOMP_FD = "{seccomp_fd}"  # placeholder in the command, replaced by the filter's descriptor
_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "as": resource.RLIMIT_AS,
    "core": resource.RLIMIT_CORE,
}


def _set_rlimit(which: int, value: int) -> None:
    """Cap a resource at ``value``; where the host's hard limit is lower and may not be raised
    (no CAP_SYS_RESOURCE, as in many containers), at that hard limit: a limit stricter than asked,
    never a kernel that cannot start."""
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY and value > hard:
        try:
            resource.setrlimit(which, (value, value))
            return
        except (ValueError, OSError):
            value = hard
    resource.setrlimit(which, (value, value))


def apply(spec: dict) -> None:
    for procs_file in spec.get("cgroup_procs", []):
        with open(procs_file, "w") as f:
            f.write(str(os.getpid()))
    for name, value in spec.get("rlimits", {}).items():
        _set_rlimit(_RLIMITS[name], value)
    os.umask(0o077)
    uid, gid = spec.get("uid"), spec.get("gid")
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise SystemExit("kernelmode launcher: could not drop privileges")


def pass_seccomp(spec: dict, command: list) -> list:
    """Open the filter file (root-owned, read before the uid is dropped) for bwrap to inherit."""
    path = spec.get("seccomp")
    if path is None:
        return command
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    os.set_inheritable(fd, True)
    i = command.index("--seccomp")  # ValueError: a spec with a filter but no place for it
    if command[i + 1] != SECCOMP_FD:
        raise SystemExit("kernelmode launcher: --seccomp without its placeholder")
    return [*command[: i + 1], str(fd), *command[i + 2:]]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: object) -> None:
    """SIGKILL when the gateway (``parent_pid``) dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise SystemExit(f"kernelmode launcher: prctl: {os.strerror(ctypes.get_errno())}")
    if isinstance(parent_pid, int) and os.getppid() != parent_pid:
        raise SystemExit("kernelmode launcher: the gateway that started this kernel is gone")


def main(argv: list) -> None:
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: launcher.py SPEC_JSON -- COMMAND...")
    spec = json.loads(argv[1])
    command = pass_seccomp(spec, argv[3:])
    apply(spec)
    die_with_parent(spec.get("parent_pid"))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
