"""What Enterprise Gateway runs on a node (over SSH, as root) to start one sandboxed kernel.

``python node_kernel.py NODE_ROOT KERNEL_PYTHON LAUNCHER -- LAUNCHER_ARGS...`` (the rig's
kernelspec argv; EG exports the ``KERNEL_*`` launch parameters before it). It:

- makes the kernel's workspace ON THE NODE (``NODE_ROOT/workspaces/KERNEL_ID``, bound at
  ``/mnt/data``) and its own directory, owned by an unprivileged uid of its own;
- applies rlimits from ``KERNEL_PIDS``/``KERNEL_DISK_MB`` (nproc binds: the uid is not root);
- builds the bubblewrap command with kernelmode's own ``bwrap_argv`` (read-only system and
  kernel env, private /tmp, pid/ipc/uts/user namespaces, all capabilities dropped, seccomp
  filter) except that the network namespace is the node's (``--share-net``): nftables on the
  node locks it to the gateway;
- gives the kernel ``HTTP_PROXY`` & co. naming its own id and egress token
  (``KERNEL_KM_EGRESS_TOKEN``) at ``KERNEL_KM_EGRESS_PROXY``, when the manager sent them, and
  the CA variables naming ``KERNEL_KM_EGRESS_CA`` (bound read-only into the sandbox);
- execs ``setpriv`` (that uid, no groups, empty bounding and inheritable sets, no-new-privs) ->
  ``bwrap`` -> EG's launcher with the shared kernel venv's python, from a scrubbed environment.
  ``exec`` keeps the pid EG was given, so EG's ``kill -0``/signals reach the sandbox.
"""

from __future__ import annotations

import os
import resource
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from kernelmode.sandbox import seccomp  # noqa: E402
from kernelmode.sandbox.base import kernel_environment  # noqa: E402
from kernelmode.sandbox.bwrap_command import SANDBOX_UID, bwrap_argv  # noqa: E402
from kernelmode.sandbox.egress import ENV_CA, remote_environment  # noqa: E402
from kernelmode.sandbox.launcher import pass_seccomp  # noqa: E402

UID_BASE = 310_000  # the kernels' host uids on the nodes: UID_BASE + a slot from the kernel id
UID_COUNT = 10_000
# The launcher logs HMAC keys at its default level (10): 30 keeps them out of the kernel log.
LAUNCHER_LOG_LEVEL = "30"


def _etc(directory: Path) -> Path:
    directory.mkdir(mode=0o755, exist_ok=True)
    files = {
        "passwd": f"root:x:0:0::/root:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/tmp:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    }
    for name, text in files.items():
        (directory / name).write_text(text)
        (directory / name).chmod(0o444)
    return directory


def _limit(which: int, value: int) -> None:
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY and value > hard:
        value = hard
    resource.setrlimit(which, (value, value))


def main(argv: list[str]) -> None:
    if len(argv) < 5 or argv[4] != "--":
        raise SystemExit("usage: node_kernel.py NODE_ROOT KERNEL_PYTHON LAUNCHER -- ARGS...")
    node_root, kernel_python, launcher, args = Path(argv[1]), argv[2], argv[3], argv[5:]
    kernel_id = str(uuid.UUID(os.environ["KERNEL_ID"]))  # a uuid, never a path
    uid = UID_BASE + uuid.UUID(kernel_id).int % UID_COUNT
    workspace = node_root / "workspaces" / kernel_id
    kdir = node_root / "kernels" / kernel_id
    for d in (workspace, kdir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(d, uid, uid)
    etc = _etc(node_root / "kernels" / f"{kernel_id}.etc")
    disk_mb = int(os.environ.get("KERNEL_DISK_MB", "1024"))
    venv = str(Path(kernel_python).parent.parent)
    env = kernel_environment(f"{venv}/bin:/usr/local/bin:/usr/bin:/bin")
    env["LOG_LEVEL"] = LAUNCHER_LOG_LEVEL
    # Its egress: HTTP_PROXY with its own id and token, to `kernelmode egress-proxy` (none without).
    env.update(remote_environment(dict(os.environ)))
    command = [kernel_python, launcher, *args]
    ro_paths = [venv, str(Path(launcher).parent)]
    # The CA bundle its CA variables name (egress.remote_ca_bundle), as the node's operator put it.
    bundle = os.environ.get(ENV_CA)
    if bundle and os.path.isfile(bundle):
        ro_paths.append(bundle)
    argv_bwrap = bwrap_argv(bwrap="/usr/bin/bwrap", kernel_dir=kdir, etc_dir=etc, workspace=workspace,
                            ro_paths=ro_paths, tmp_bytes=disk_mb * 1024 * 1024,
                            env=env, command=command)
    # The node's network namespace (nftables-locked) instead of bwrap's empty one.
    argv_bwrap.insert(argv_bwrap.index("--unshare-all") + 1, "--share-net")
    spec = {"seccomp": str(seccomp.bpf_file(str(node_root / "kernels")))}
    argv_bwrap = pass_seccomp(spec, argv_bwrap)
    _limit(resource.RLIMIT_NPROC, int(os.environ.get("KERNEL_PIDS", "256")))
    _limit(resource.RLIMIT_FSIZE, disk_mb * 1024 * 1024)
    _limit(resource.RLIMIT_CORE, 0)
    setpriv = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    os.umask(0o077)
    os.execve(setpriv[0], setpriv + argv_bwrap, {"PATH": "/usr/bin:/bin"})


if __name__ == "__main__":
    main(sys.argv)
