"""Enterprise Gateway on the rig: its config (generated), the kernelspec it launches on the
nodes, and its process (EG's own virtualenv ``.eg-venv``, made by ``make setup-cluster``).

EG listens on loopback only, with an auth token. It launches kernels on both nodes over SSH
(``DistributedProcessProxy``, least-connection), receives their connection info on the bridge
(``EG_RESPONSE_IP``), and reaches their ports in the rig's port range.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.cluster.node_kernel import __file__ as NODE_KERNEL
from tests.support.cluster.rig import Rig

REPO = Path(__file__).resolve().parents[3]
EG_VENV = (REPO / ".eg-venv").resolve()  # a real path: bwrap binds its launcher dir
LAUNCHER = EG_VENV / "share" / "eg-launchers" / "launch_ipykernel.py"
KERNEL_NAME = "kernelmode-remote"
SERVICE_PYTHON = sys.executable  # runs node_kernel.py (it imports kernelmode.sandbox)
# The config-time patches EG runs with, here and in the Kubernetes image (one file for both).
EG_PATCHES = REPO / "deploy" / "kubernetes" / "images" / "enterprise-gateway" / "eg_patches.py"


def _load_patches() -> Any:  # a module (its file is outside any package)
    spec = importlib.util.spec_from_file_location("eg_patches", EG_PATCHES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


eg_patches = _load_patches()


def kernel_python() -> str:
    """The shared kernel venv's python (a real path: bwrap binds it into the sandbox)."""
    configured = os.environ.get("KERNELMODE_SANDBOX__KERNEL_PYTHON")
    return configured or str((REPO / ".kernel-venv" / "bin" / "python").absolute())


def missing() -> str | None:
    """Why EG cannot run here (None: it can)."""
    if not (EG_VENV / "bin" / "jupyter-enterprisegateway").exists() or not LAUNCHER.exists():
        return "Enterprise Gateway's virtualenv or launcher is missing: run `make setup-cluster`"
    return None


def kernelspec(rig: Rig) -> dict[str, object]:
    """``python_distributed``-style: DistributedProcessProxy over SSH on both nodes."""
    return {
        "display_name": "kernelmode (remote node, sandboxed)",
        "language": "python",
        "metadata": {"process_proxy": {
            "class_name": "enterprise_gateway.services.processproxies.distributed.DistributedProcessProxy",
            "config": {"remote_hosts": ",".join(n.address for n in rig.nodes)},
        }},
        # EG joins this into one shell line on the node (after the export of KERNEL_*).
        "argv": [
            SERVICE_PYTHON, NODE_KERNEL, "{node_root}", kernel_python(), str(LAUNCHER), "--",
            "--RemoteProcessProxy.kernel-id", "{kernel_id}",
            "--RemoteProcessProxy.response-address", "{response_address}",
            "--RemoteProcessProxy.public-key", "{public_key}",
            "--RemoteProcessProxy.port-range", "{port_range}",
            "--RemoteProcessProxy.spark-context-initialization-mode", "none",
        ],
    }


@dataclass
class EnterpriseGateway:
    url: str
    token: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    rig: Rig

    def env(self) -> dict[str, str]:
        """What a `serve` needs to use this gateway."""
        return {"KERNELMODE_GATEWAY__URL": self.url, "KERNELMODE_GATEWAY__AUTH_TOKEN": self.token,
                "KERNELMODE_GATEWAY__KERNEL_NAME": KERNEL_NAME}

    def request(self, method: str, path: str, **kw: object) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", headers={"Authorization": f"token {self.token}"},
                             timeout=60, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, hard: bool = False) -> None:
        """SIGTERM, SIGKILL after 30 s; ``hard``: SIGKILL at once (a rig with a failed node is
        thrown away: EG's graceful stop would only wait on ssh to the dead node)."""
        if self.proc.poll() is None and hard:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(rig: Rig, port: int = 0, token: str = "") -> EnterpriseGateway:
    """EG on loopback for ``rig``; ``port``/``token``: those of one that ran before (a restart)."""
    home = rig.root / "eg-home"
    spec_dir = rig.root / "eg-share" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = kernelspec(rig)
    # Each node keeps its kernels' workspaces under its own root; the shell picks it by address.
    node_root = "$(case $(hostname -I) in " + " ".join(
        f"*{n.address}*) echo {rig.root / f'node-{n.name}'};;" for n in rig.nodes) + " esac)"
    spec["argv"] = [node_root if a == "{node_root}" else a for a in spec["argv"]]  # type: ignore[union-attr]
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    port = port or _free_port()
    token = token or "eg" + secrets.token_urlsafe(24)
    lo, hi = rig.port_range
    config = rig.root / "eg_config.py"
    config.write_text(eg_patches.config_lines({
        "ip": "127.0.0.1", "port": port, "port_retries": 0, "auth_token": token,
        "default_kernel_name": KERNEL_NAME, "list_kernels": True,
        "load_balancing_algorithm": "least-connection", "port_range": f"{lo}..{hi}",
        "remote_hosts": [n.address for n in rig.nodes],
        "unauthorized_users": ["root"],
    }))
    (rig.root / "logs").mkdir(exist_ok=True)
    env = {
        "PATH": f"{EG_VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(home),  # paramiko's ~/.ssh: the rig's key and known_hosts
        "JUPYTER_PATH": str(rig.root / "eg-share"),
        "JUPYTER_DATA_DIR": str(rig.root / "eg-data"),
        "JUPYTER_RUNTIME_DIR": str(rig.root / "eg-runtime"),
        "JUPYTER_CONFIG_DIR": str(rig.root / "eg-config"),
        "EG_RESPONSE_IP": rig.gateway_address,
        "EG_RESPONSE_PORT": str(rig.response_port),
        "EG_RESPONSE_PORT_RETRIES": "0",
        "EG_KERNEL_LOG_DIR": str(rig.root / "logs"),
        "EG_REMOTE_USER": "root",
        "LANG": "C.UTF-8",
    }
    log_path = rig.root / f"eg-{port}.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [str(EG_VENV / "bin" / "jupyter-enterprisegateway"), f"--config={config}", "--log-level=INFO"],
            env=env, cwd=str(rig.root), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
            start_new_session=True)
    eg = EnterpriseGateway(url=f"http://127.0.0.1:{port}", token=token, port=port, proc=proc,
                           log_path=log_path, rig=rig)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Enterprise Gateway exited:\n{eg.log()[-3000:]}")
        try:
            if eg.request("GET", "/api").status_code == 200:
                return eg
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    eg.stop()
    raise RuntimeError(f"Enterprise Gateway did not answer:\n{eg.log()[-3000:]}")
