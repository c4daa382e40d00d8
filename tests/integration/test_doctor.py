"""`kernelmode doctor` against this machine: what `serve` needs is there (bubblewrap works), the
JSON report parses, and a missing piece is reported with what to do about it and exit code 1."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kmdoctor-", dir="/tmp"))
    d.chmod(0o711)  # as root, the sandbox uids must traverse it (as for serve)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KERNELMODE_")}
    return subprocess.run([sys.executable, "-m", "kernelmode.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**environ, **(env or {})})


def checks(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    report = json.loads(proc.stdout)
    assert isinstance(report["ok"], bool) and report["backend"] in ("bwrap", "docker", "none")
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"} and c["status"] in ("ok", "warn", "fail", "skip")
    return {c["name"]: c for c in report["checks"]}


def test_this_machine_can_serve_on_bwrap(data_dir: Path) -> None:
    proc = doctor("--json", "--sandbox", "bwrap", "--data-dir", str(data_dir), "--port", "0")
    by_name = checks(proc)
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["backend"] == "bwrap"
    assert by_name["bubblewrap"]["status"] == "ok" and "bwrap ok" in by_name["bubblewrap"]["detail"]
    for name in ("gateway config", "kernel environment", "data dir", "artifact store", "session store"):
        assert by_name[name]["status"] == "ok", by_name[name]
    # What serve falls back from is a warning with advice, never a failure.
    for name in ("cgroups", "workspace quota"):
        assert by_name[name]["status"] in ("ok", "warn"), by_name[name]
        assert by_name[name]["status"] == "ok" or by_name[name]["fix"]
    assert by_name["docker"]["status"] == "skip"  # not asked for
    # The text form says the same.
    text = doctor("--sandbox", "bwrap", "--data-dir", str(data_dir), "--port", "0")
    assert text.returncode == 0 and "serve can run" in text.stdout and "ok    bubblewrap" in text.stdout


def test_missing_kernel_environment_is_reported_with_advice(data_dir: Path) -> None:
    missing = {"KERNELMODE_SANDBOX__KERNEL_PYTHON": str(data_dir / "nowhere" / "bin" / "python")}
    proc = doctor("--json", "--sandbox", "bwrap", "--data-dir", str(data_dir), "--port", "0", env=missing)
    assert proc.returncode == 1, proc.stdout
    assert json.loads(proc.stdout)["ok"] is False
    env = checks(proc)["kernel environment"]
    assert env["status"] == "fail" and "does not exist" in env["detail"]
    assert "kernelmode setup" in env["fix"] and str(data_dir / "nowhere") in env["fix"]
    text = doctor("--sandbox", "bwrap", "--data-dir", str(data_dir), "--port", "0", env=missing)
    assert text.returncode == 1 and "serve cannot run" in text.stdout
    assert "FAIL  kernel environment" in text.stdout and "fix: `kernelmode setup`" in text.stdout


def test_port_in_use_and_bad_flags(data_dir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = doctor("--json", "--sandbox", "none", "--data-dir", str(data_dir), "--port", str(port))
    assert proc.returncode == 1
    port_check = checks(proc)["port"]
    assert port_check["status"] == "fail" and "--port" in port_check["fix"]
    # A flag out of range is one line naming the flag, not a traceback.
    bad = doctor("--port", "70000")
    assert bad.returncode == 1 and bad.stderr.strip().startswith("kernelmode: --port:")
    assert "Traceback" not in bad.stderr


def test_unreachable_s3_store_fails(data_dir: Path) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"KERNELMODE_ARTIFACTS__STORE": "s3", "KERNELMODE_ARTIFACTS__ENDPOINT": f"127.0.0.1:{port}",
           "KERNELMODE_ARTIFACTS__ACCESS_KEY": "doctor", "KERNELMODE_ARTIFACTS__SECRET_KEY": "doctor-secret"}
    proc = doctor("--json", "--sandbox", "none", "--data-dir", str(data_dir), "--port", "0", env=env)
    assert proc.returncode == 1
    store = checks(proc)["artifact store"]
    assert store["status"] == "fail" and store["detail"].startswith("s3:") and "endpoint" in store["fix"]


def test_the_postgresql_store_is_reached_and_left_as_it_was(data_dir: Path, pg_url: str) -> None:
    env = {"KERNELMODE_STORE__URL": pg_url}
    store = checks(doctor("--json", "--sandbox", "none", "--data-dir", str(data_dir), "--port", "0", env=env))
    assert store["session store"]["status"] == "ok"
    assert "no kernelmode tables yet" in store["session store"]["detail"]  # doctor created none
    env["KERNELMODE_STORE__URL"] = re.sub(r"/[^/?]+\?", "/no_such_db?", pg_url, count=1)
    proc = doctor("--json", "--sandbox", "none", "--data-dir", str(data_dir), "--port", "0", env=env)
    bad = checks(proc)["session store"]
    assert proc.returncode == 1 and bad["status"] == "fail" and "store.url" in bad["fix"]
    assert bad["detail"].startswith("store.url: cannot connect to PostgreSQL at") and "no_such_db" in bad["detail"]
