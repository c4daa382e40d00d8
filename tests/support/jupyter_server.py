"""Jupyter Server (or JupyterLab) whose kernels live on a gateway: a kernelmode serve, in the
tests of Jupyter's gateway path and in bench/jupyter_attach.py."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.server import REPO

JUPYTER_TOKEN = secrets.token_urlsafe(18)
ATTACHING = "--ServerApp.kernel_manager_class=kernelmode.console.jupyter_server.AttachingKernelManager"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_jupyter_server(gateway_url: str, token: str, extra: list[str] | None = None,
                         module: str = "jupyter_server") -> tuple[subprocess.Popen[bytes], str, Path]:
    """Jupyter Server (or JupyterLab: ``module``) on a free loopback port, its kernels on
    ``gateway_url`` with tenant ``token`` (sent as ``Authorization: token ...``, the default).
    Returns (process, url, its notebook directory); remove the directory's parent after."""
    home = Path(tempfile.mkdtemp(prefix="km-jupyter-"))
    root = home / "notebooks"  # what its file browser shows
    root.mkdir()
    port = _free_port()
    log = home / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={JUPYTER_TOKEN}",
         f"--gateway-url={gateway_url}", f"--GatewayClient.auth_token={token}",
         "--GatewayClient.request_timeout=120", "--allow-root", "--ServerApp.terminals_enabled=False",
         *(extra or [])],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), cwd=root,  # noqa: SIM115
        # Its runtime and config files in its own directory, not the user's
        env={**os.environ, "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_CONFIG_DIR": str(home / "config"),
             "JUPYTER_DATA_DIR": str(home / "data"),
             "PYTHONPATH": str(REPO)})  # this checkout's kernelmode (its AttachingKernelManager)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/api/status", headers={"Authorization": f"token {JUPYTER_TOKEN}"},
                         timeout=5).status_code == 200:
                return proc, url, root
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"jupyter server did not start:\n{log.read_text()[-3000:]}")
