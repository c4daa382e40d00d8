"""Last step before the sandbox: join cgroups, set rlimits, drop to the kernel's uid, exec.

Run as ``python -I launcher.py SPEC_JSON -- COMMAND...`` by the bwrap provisioner. It is a
standalone stdlib script (run by path, isolated mode) so it starts fast and trusts nothing from
the environment. The order matters: cgroups and rlimits are applied while still privileged, then
the uid is dropped so that the sandbox (bwrap) runs as an unprivileged host user; ``exec`` keeps
the pid, so the gateway still sees bwrap's exit status as the kernel's. When the spec names a
compiled seccomp filter, it is opened here and its descriptor handed to bwrap: the command's
``--seccomp SECCOMP_FD`` placeholder becomes ``--seccomp N`` (bwrap reads the filter from fd N).
"""

import json
import os
import resource
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


def main(argv: list) -> None:
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: launcher.py SPEC_JSON -- COMMAND...")
    spec = json.loads(argv[1])
    command = pass_seccomp(spec, argv[3:])
    apply(spec)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
