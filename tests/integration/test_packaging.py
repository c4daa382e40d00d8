"""`pip install .` (a built wheel, not an editable install) gives a working kernelmode.

One slow test that follows a newcomer without the Makefile: build the wheel, install it into a
fresh venv outside the checkout, `kernelmode --help`, `kernelmode setup` (the kernel
environment; a short requirements list here, the shipped one takes minutes), `kernelmode doctor`,
then a real `kernelmode serve` on bubblewrap that answers /readyz and runs code.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _run(argv: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Not pytest's tmp_path: as root, sandboxed kernels (other uids) must traverse to the data
    # dir and the kernel environment, and pytest's base directory is 0700.
    d = Path(tempfile.mkdtemp(prefix="kmpkg-", dir="/tmp"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_wheel_install_setup_doctor_serve(workdir: Path) -> None:
    # -- the wheel carries the files serve and setup read at run time ------------------------
    # Built from a copy of what the service image copies (setuptools builds in the source tree).
    src = workdir / "src"
    shutil.copytree(REPO / "kernelmode", src / "kernelmode", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (src / "kernel-image").mkdir()
    for name in ("pyproject.toml", "README.md", "kernel-image/requirements.txt",
                 "kernel-image/ipython_kernel_config.json"):
        shutil.copy(REPO / name, src / name)
    dist = workdir / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
          "-w", str(dist), str(src)], 600)
    (wheel,) = dist.glob("kernelmode-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "kernelmode/gateway_ext/config/kernel_gateway_config.py" in names
        assert "kernelmode/gateway_ext/config/kernelspec.json" in names
        # The kernel environment's list, the same as the Docker image's (a file, not a link).
        shipped = z.read("kernelmode/sandbox/kernel-requirements.txt")
        ipython_config = z.read("kernelmode/sandbox/ipython_kernel_config.json")
    assert shipped == (REPO / "kernel-image" / "requirements.txt").read_bytes()
    assert ipython_config == (REPO / "kernel-image" / "ipython_kernel_config.json").read_bytes()

    # -- a fresh venv, outside the checkout --------------------------------------------------
    venv = workdir / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 300)
    # --no-compile: byte-compiling ~100 dependencies is most of the install's time, and not what
    # this test is about.
    _run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "--no-compile",
          str(wheel)], 1200)
    km = str(venv / "bin" / "kernelmode")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELMODE_")}
    where = _run([str(venv / "bin" / "python"), "-c", "import kernelmode; print(kernelmode.__file__)"],
                 60, cwd=workdir, env=env).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout
    helptext = _run([km, "--help"], 60, cwd=workdir, env=env).stdout
    for command in ("serve", "mcp", "setup", "doctor"):
        assert command in helptext

    # -- kernelmode setup: a venv readable by the sandbox uids, idempotent -------------------
    kenv = workdir / "kernel-env"
    reqs = workdir / "requirements.txt"
    reqs.write_text("ipykernel\n")
    out = _run([km, "setup", "--kernel-env", str(kenv), "--requirements", str(reqs)], 1200,
               cwd=workdir, env=env).stdout
    assert "[1/4]" in out and "[4/4]" in out and "kernel environment ready" in out, out
    kpython = kenv / "bin" / "python"
    for path in (kenv / "lib", kenv / ".stamp", kenv / "etc" / "ipython" / "ipython_kernel_config.json"):
        assert path.stat().st_mode & stat.S_IROTH, path
    again = _run([km, "setup", "--kernel-env", str(kenv), "--requirements", str(reqs)], 300,
                 cwd=workdir, env=env).stdout
    assert "up to date" in again and "[3/4]" not in again, again
    env["KERNELMODE_SANDBOX__KERNEL_PYTHON"] = str(kpython)
    env["KERNELMODE_SANDBOX__BACKEND"] = "bwrap"
    env["KERNELMODE_SESSIONS__POOL_SIZE"] = "0"

    # -- kernelmode doctor: the installed copy finds everything ------------------------------
    data = workdir / "data"
    port = _free_port()
    doc = subprocess.run([km, "doctor", "--json", "--data-dir", str(data), "--port", str(port)],
                         capture_output=True, text=True, timeout=300, cwd=workdir, env=env)
    report = json.loads(doc.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert doc.returncode == 0 and report["ok"], doc.stdout
    # "embedded (serve starts it): PATH", the config inside the installed copy
    assert by_name["gateway config"]["detail"].split(": ", 1)[-1].startswith(str(venv))
    assert by_name["bubblewrap"]["status"] == "ok"

    # -- kernelmode serve: ready, and runs code in the sandbox -------------------------------
    token = secrets.token_urlsafe(16)
    env["KERNELMODE_TOKEN"] = token
    log = open(workdir / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([km, "serve", "--port", str(port), "--data-dir", str(data)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        ready = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{url}/readyz", timeout=10)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert ready is not None and ready.status_code == 200, (workdir / "serve.log").read_text()[-4000:]
        assert ready.json()["checks"]["sandbox"]["backend"] == "bwrap"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "import sys; print(sys.prefix); 6*7"})
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "ok" and r.json()["result"] == "42", r.text
            assert r.json()["stdout"].strip() == str(kenv)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
