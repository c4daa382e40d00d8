"""Whole-service behaviour: caps, clean shutdown, sessions after a restart, backend choice."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import REPO, start_server
from tests.support.procfs import processes_mentioning, unmount_under


def test_cap_shutdown_and_lost_sessions_after_restart():
    data_dir = Path(tempfile.mkdtemp(prefix="kmlife-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__MAX_SESSIONS": "2", "KERNELMODE_SESSIONS__POOL_SIZE": "0"},
                       data_dir=data_dir)
    try:
        with srv.client() as c:
            assert c.get("/readyz").json()["checks"]["pool"] == {"ok": True, "state": "off", "ready": 0, "size": 0,
                                                                  "error": None}
            for sid in ("one", "two"):
                r = c.post("/v1/sessions", json={"session_id": sid})
                assert r.status_code == 201 and r.json()["from_pool"] is False
            r = c.post("/v1/sessions", json={"session_id": "three"})
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "too_many_sessions"
            assert c.post("/v1/sessions/one/execute", json={"code": "x = 1"}).json()["status"] == "ok"
        # Kernels, sandboxes and the gateway all run with the data dir in their command line.
        assert len(processes_mentioning(str(data_dir))) >= 3
        assert srv.stop() == 0
        deadline = time.monotonic() + 15
        while processes_mentioning(str(data_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(data_dir)) == []
        mounts = Path("/proc/self/mountinfo").read_text()
        assert f"{data_dir}/" not in mounts  # workspace volumes are detached at shutdown

        srv = start_server(data_dir=data_dir)
        with srv.client() as c:
            info = c.get("/v1/sessions/one").json()
            assert info["status"] == "lost"
            r = c.post("/v1/sessions/one/execute", json={"code": "x"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "kernel_unavailable"
            assert c.delete("/v1/sessions/one").status_code == 204
            assert c.get("/v1/sessions/one").status_code == 404
            # The id is free again.
            assert c.post("/v1/sessions", json={"session_id": "one"}).status_code == 201
    finally:
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_sigkill_of_the_manager_leaves_no_kernel():
    """A manager that is killed and never comes back: its gateway (kept for adoption) shuts
    itself and its kernels down once the manager's lease is older than the orphan timeout."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmkill-", dir="/tmp"))
    srv = start_server({"KERNELMODE_GATEWAY__ORPHAN_TIMEOUT_SECONDS": "3"}, data_dir=data_dir)
    try:
        with srv.client() as c:
            assert c.post("/v1/sessions", json={}).status_code == 201
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 30
        while processes_mentioning(str(data_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(data_dir)) == []
    finally:
        unmount_under(data_dir)  # a killed manager cannot detach its workspace volumes
        shutil.rmtree(data_dir, ignore_errors=True)


def test_sandbox_none_must_be_asked_for_and_warns():
    data_dir = Path(tempfile.mkdtemp(prefix="kmnone-", dir="/tmp"))
    srv = start_server(data_dir=data_dir, args=["--sandbox", "none"])
    try:
        with srv.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "import os\nx = 2\nos.getcwd()"}).json()
            assert r["status"] == "ok"
            assert f"{data_dir}/workspaces/" in r["result"]
            assert c.post(f"/v1/sessions/{sid}/execute", json={"code": "x * 21"}).json()["result"] == "42"
            assert c.get(f"/v1/sessions/{sid}").json()["sandbox"] == "none"
        assert "SANDBOX DISABLED" in srv.log()
    finally:
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_missing_bubblewrap_refuses_to_start_with_install_hint():
    data_dir = Path(tempfile.mkdtemp(prefix="kmnobw-", dir="/tmp"))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
             "--sandbox", "bwrap"],
            env={**os.environ, "KERNELMODE_SANDBOX__BWRAP_PATH": "/nonexistent/bwrap"},
            capture_output=True, text=True, timeout=60, cwd=str(REPO),
        )
        assert proc.returncode == 2
        assert "apt-get install bubblewrap" in proc.stderr
        assert "serving on" not in proc.stdout
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_bad_config_key_is_named_with_its_line(tmp_path):
    cfg = tmp_path / "kernelmode.yaml"
    cfg.write_text("server:\n  port: 9000\nsessions:\n  max_sesions: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kernelmode.cli", "serve", "--config", str(cfg)],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )
    assert proc.returncode == 2
    assert "sessions.max_sesions (line 4): unknown key" in proc.stderr


def test_rest_quickstart_example_runs(server):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rest_quickstart.py")],
        env={**os.environ, "KERNELMODE_URL": server.url, "KERNELMODE_TOKEN": server.token},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "2: ok -> 22.5" in proc.stdout
    assert "3: error AttributeError" in proc.stdout


def test_a_second_serve_on_the_same_data_dir_is_refused():
    """It would adopt the first one's gateway and kernels from under it."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmlock-", dir="/tmp"))
    srv = start_server(data_dir=data_dir)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", str(data_dir)],
            capture_output=True, text=True, timeout=120, cwd=str(REPO))
        assert second.returncode == 1
        assert f"another kernelmode serve (pid {srv.proc.pid}) is using the data dir" in second.stderr
        with srv.client() as c:  # the first one is untouched
            assert c.get("/readyz").status_code == 200
    finally:
        srv.stop()
    srv = start_server(data_dir=data_dir)  # free again once the first has stopped
    srv.stop()  # at once, while its pool kernel is still being made
    # No volume outlives the server (a cancelled start used to mount its volume after the sweep).
    assert str(data_dir) not in Path("/proc/self/mountinfo").read_text()
    shutil.rmtree(data_dir, ignore_errors=True)
