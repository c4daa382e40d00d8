"""The sandbox side of egress: each kernel's egress dir, its bridge, and its proxy variables.

A kernel keeps no network interface but ``lo``. Its one way out is a host directory of its own,
its *egress dir* (:func:`egress_dir`: ``<runtime dir>/<kernel id>.egress``), bind-mounted
read-only at ``/run/kernelmode/egress`` by both sandbox backends. When the kernel's session has
egress, the manager's proxy puts ``proxy.sock`` there (and ``ca-bundle.pem``); inside, the bridge
(``egress_bridge.py``, the sandbox's first process) relays 127.0.0.1:3128 to that socket, and the
kernel's standard proxy variables name that port. Every kernel has the bridge and the variables,
egress or not: pool kernels start before their session is known, and a session without egress
gets a one-line refusal from the bridge instead of a name-resolution traceback.

Who may use the dir: it is root's (the gateway's user), group the kernel's own gid, mode 0750,
so only that kernel's uid reaches what is in it on the host; inside, it is read-only, so kernel
code cannot plant or replace anything there (connecting to a socket needs no write access to the
mount). It lives as long as the kernel id: kept across restarts (the proxy's socket stays), removed
with the kernel.
"""

from __future__ import annotations

import os
import shutil
import ssl
from functools import cache
from pathlib import Path

import certifi

from .egress_bridge import ARGV_ENV, PORT, encode_argv
from .spec import BRIDGE_MOUNT, EGRESS_MOUNT

SOCKET_NAME = "proxy.sock"  # made by the manager's egress proxy (kernelmode.egress)
CA_NAME = "ca-bundle.pem"
PROXY_URL = f"http://127.0.0.1:{PORT}"
CA_PATH = f"{EGRESS_MOUNT}/{CA_NAME}"
# Every HTTP client's name for "trust this bundle": Python's ssl (and httpx), requests, curl, pip, git.
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO")
# A kernel on an external gateway (no egress dir): its launch values, from which its kernelspec
# or pod template makes HTTP_PROXY (:func:`remote_environment`).
ENV_TOKEN = "KERNEL_KM_EGRESS_TOKEN"
ENV_PROXY = "KERNEL_KM_EGRESS_PROXY"
ENV_CA = "KERNEL_KM_EGRESS_CA"  # egress.remote_ca_bundle: the bundle's path on the node or in the pod


def egress_dir(runtime_dir: Path, kernel_id: str) -> Path:
    """The host directory seen at /run/kernelmode/egress in kernel ``kernel_id`` (the manager and
    the gateway both name it so: the manager's proxy puts the session's socket there)."""
    return runtime_dir / f"{kernel_id}.egress"


def environment() -> dict[str, str]:
    """The kernel's proxy variables. The CA variables name a bundle that is always there (see
    :func:`prepare`): a variable naming a missing file breaks clients at construction
    (``httpx.Client()`` raises FileNotFoundError), not only at their first HTTPS request."""
    env = {name: PROXY_URL for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    env.update({name: "localhost,127.0.0.1,::1" for name in ("NO_PROXY", "no_proxy")})
    env.update({name: CA_PATH for name in CA_VARIABLES})
    return env


def remote_environment(launch: dict[str, str]) -> dict[str, str]:
    """The proxy variables of a kernel on another host, from its launch values (``KERNEL_ID``,
    :data:`ENV_TOKEN`, :data:`ENV_PROXY`): ``http://KERNEL_ID:TOKEN@PROXY`` ({} without a token:
    such a kernel has no way out). What a Kubernetes pod template writes as
    ``http://$(KERNEL_ID):$(KERNEL_KM_EGRESS_TOKEN)@$(KERNEL_KM_EGRESS_PROXY)``. With
    :data:`ENV_CA` (the bundle's path there), the same CA variables as a local kernel's name it."""
    kernel_id, token, proxy = (launch.get(k) for k in ("KERNEL_ID", ENV_TOKEN, ENV_PROXY))
    if not (kernel_id and token and proxy):
        return {}
    url = f"http://{kernel_id}:{token}@{proxy}"
    env = {name: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    env.update({name: "localhost,127.0.0.1,::1" for name in ("NO_PROXY", "no_proxy")})
    bundle = launch.get(ENV_CA)
    if bundle:
        env.update({name: bundle for name in CA_VARIABLES})
    return env


@cache
def default_ca() -> Path:
    """The trust store a kernel starts with (the host's system bundle, else certifi's): the proxy
    replaces it with its own bundle (this one plus the deployment's CA) when it needs to."""
    system = ssl.get_default_verify_paths().cafile
    return Path(system) if system and os.path.getsize(system) > 0 else Path(certifi.where())


def prepare(runtime_dir: Path, kernel_id: str, gid: int) -> Path:
    """Make the kernel's egress dir (or keep it, on a restart) for the kernel's ``gid``: root's,
    group ``gid``, 0750 (not root: the kernel runs as our own uid, 0700), with a default CA bundle."""
    d = egress_dir(runtime_dir, kernel_id)
    d.mkdir(mode=0o700, exist_ok=True)
    if d.is_symlink() or d.stat().st_uid != os.getuid():
        raise RuntimeError(f"kernelmode: {d} is not the gateway's own directory")
    if os.getuid() == 0:
        os.chown(d, 0, gid)
        os.chmod(d, 0o750)
    else:
        os.chmod(d, 0o700)
    ca = d / CA_NAME
    if not ca.exists():
        tmp = d / f".{CA_NAME}.tmp"
        shutil.copyfile(default_ca(), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, ca)
    return d


def grant(path: Path) -> None:
    """Let the kernel of an egress dir connect to the socket at ``path`` in it (made by the
    gateway's user): the dir's group may write it, as connecting needs."""
    os.chown(path, -1, path.parent.stat().st_gid, follow_symlinks=False)
    os.chmod(path, 0o660)


def remove(runtime_dir: Path, kernel_id: str) -> None:
    shutil.rmtree(egress_dir(runtime_dir, kernel_id), ignore_errors=True)


@cache
def bridge_file(runtime_dir: str) -> Path:
    """The bridge's source in ``runtime_dir`` (root-owned, world-readable, out of every kernel's
    reach), bound read-only into each sandbox; written once a process."""
    path = Path(runtime_dir) / "egress-bridge.py"
    source = Path(__file__).with_name("egress_bridge.py").read_bytes()
    try:
        if path.read_bytes() == source:
            return path
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(source)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
    return path


def bridged(cmd: list[str], python: str) -> tuple[list[str], dict[str, str]]:
    """The sandbox's command for kernel command ``cmd``: the bridge, run by ``python``, which
    execs the kernel; and the variable that carries ``cmd`` to it (it removes it)."""
    return [python, "-I", "-S", BRIDGE_MOUNT], {ARGV_ENV: encode_argv(cmd)}
