"""A Kernel Gateway that the test owns (not `serve`): kernelmode's own gateway config, on
loopback, with an auth token, in its own process; a `serve` with `gateway.url` drives it."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kernelmode.config import load_settings
from kernelmode.early_start import gateway_process
from kernelmode.gateway.process import _LAUNCH
from kernelmode.sandbox.kernelspec import install_kernelspec


@dataclass
class ExternalGateway:
    url: str
    token: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def env(self) -> dict[str, str]:
        """What a `serve` needs to use this gateway."""
        return {"KERNELMODE_GATEWAY__URL": self.url, "KERNELMODE_GATEWAY__AUTH_TOKEN": self.token}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": f"token {self.token}"}, timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_external_gateway(data_dir: Path, port: int = 0, token: str = "") -> ExternalGateway:
    """A gateway whose kernels use ``data_dir``'s layout (the same host: the disk is shared);
    ``port`` and ``token``: those of one that ran before (a restarted gateway)."""
    settings = load_settings()
    settings.server.data_dir = data_dir
    dirs = {name: data_dir / name for name in ("run", "state", "gateway", "kernels")}
    for name, d in dirs.items():
        d.mkdir(exist_ok=True)
        d.chmod(0o711 if name == "run" else 0o700)
    install_kernelspec(dirs["kernels"], settings.sandbox.backend, settings.sandbox.kernel_python,
                       settings.gateway.config_dir / "kernelspec.json")
    gp = gateway_process(settings, data_dir.resolve(), dirs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gp.port = port or s.getsockname()[1]
    gp.token = token or "g" + secrets.token_urlsafe(24)
    env = gp._environment()
    env.pop("KERNELMODE_GW_LEASE")  # no manager lease: this gateway lives until the test stops it
    log_path = data_dir.with_suffix(".gateway.log")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, f"--config={gp.config_file}"], env=env,
                                cwd=str(dirs["gateway"]), stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=logf, start_new_session=True)
    gw = ExternalGateway(url=gp.url, token=gp.token, proc=proc, log_path=log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited:\n{log_path.read_text()[-3000:]}")
        try:
            if gw.get("/api").status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gw.stop()
    raise RuntimeError(f"the gateway did not answer:\n{log_path.read_text()[-3000:]}")
