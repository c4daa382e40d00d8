"""Whole-service behaviour: caps, clean shutdown, sessions after a restart, backend choice."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import BACKEND, REPO, start_server, wait_for
from tests.support.procfs import processes_mentioning, unmount_under


def test_cap_shutdown_and_lost_sessions_after_restart():
    data_dir = Path(tempfile.mkdtemp(prefix="kmlife-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__MAX_SESSIONS": "2", "KERNELMODE_SESSIONS__POOL_SIZE": "0"},
                       data_dir=data_dir)
    try:
        with srv.client() as c:
            assert c.get("/readyz").json()["checks"]["pool"] == {"ok": True, "state": "off", "ready": 0, "size": 0,
                                                                  "target": 0, "error": None}
            for sid in ("one", "two"):
                r = c.post("/v1/sessions", json={"session_id": sid})
                assert r.status_code == 201 and r.json()["from_pool"] is False
            r = c.post("/v1/sessions", json={"session_id": "three"})
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "too_many_sessions"
            assert c.post("/v1/sessions/one/execute", json={"code": "x = 1"}).json()["status"] == "ok"
            # A cold kernel's first run has all its output: kernel_info and the boot code go out
            # together (Kernel._info_and_boot), and neither may cost a run its IOPub messages.
            first = c.post("/v1/sessions/two/execute", json={"code": "print('first'); 1+1"}).json()
            assert (first["stdout"], first["result"]) == ("first\n", "2"), first
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


def _left_behind(data_dir: Path) -> list[str]:
    """What of a stopped server's kernels still exists: processes (launchers, bwrap, kernels,
    the gateway), Docker containers, mounts and loop devices of its workspace images."""
    left = _running(data_dir)
    left += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if line.split()[4].startswith(f"{data_dir}/")]
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if str(data_dir) in (image := backing.read_text().strip()):
                left.append(f"{backing.parent.parent.name} on {image}")
    return left


def _running(data_dir: Path) -> list[str]:
    """Processes and containers of the server of ``data_dir``."""
    left = [f"pid {pid}: {_cmdline(pid)[:160]}" for pid in processes_mentioning(str(data_dir))]
    if BACKEND == "docker":
        import docker

        containers = docker.from_env().containers.list(
            all=True, filters={"label": f"kernelmode.data_dir={data_dir}"}, ignore_removed=True)
        left += [f"container {c.name} ({c.status})" for c in containers]
    return left


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


# Where the warm pool's first kernel start is when SIGTERM comes, one stage per stop: its volume
# being made (right at "serving on"), the gateway's provisioner at work (the kernel's directory),
# the launcher started (the kernel's log), the kernel up and binding its sockets.
_REFILL_STAGES = (
    lambda run: True,
    lambda run: any(p.is_dir() for p in run.iterdir()),
    lambda run: any(run.glob("*.log")),
    lambda run: any(run.glob("*/k-*")),
)


def test_sigterm_during_pool_refills_leaves_no_kernel_behind():
    """Issue 32: one stop in six left a pool kernel that was being started running (its launcher
    orphaned, a loop device on a deleted image). Shutdown stops the refills, waits for the start
    in flight, and a launcher dies with its gateway: after each stop nothing is left."""
    stops = 8
    for i in range(stops):
        stage = i % len(_REFILL_STAGES)
        assert _stop_during_refill(stage) == [], f"stop {i + 1} of {stops}, at stage {stage}"


def _stop_during_refill(stage: int) -> list[str]:
    """Start a server with a warm pool, SIGTERM it at ``stage`` of its first refill: what is left."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmpoolstop-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "2"}, data_dir=data_dir)
    try:
        run = data_dir / "run"
        wait_for(lambda: _REFILL_STAGES[stage](run), f"refill stage {stage}", timeout=60, every=0.01)
        assert srv.stop(timeout=60) == 0, srv.log()[-3000:]
        # What the server started goes with it (a launcher that dies with its parent takes a
        # moment), not at the next start.
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not _left_behind(data_dir), "nothing left", timeout=20)
        return _left_behind(data_dir)
    finally:
        srv.discard()
        _remove_left(data_dir)


def _remove_left(data_dir: Path) -> None:
    """Clean what a failing stop left, so that one failure does not leak into other tests."""
    for pid in processes_mentioning(str(data_dir)):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    if BACKEND == "docker":
        import docker

        for c in docker.from_env().containers.list(all=True, filters={"label": f"kernelmode.data_dir={data_dir}"}, ignore_removed=True):
            with contextlib.suppress(Exception):
                c.remove(force=True)
    unmount_under(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)


def test_a_launcher_dies_with_its_gateway():
    """Whatever ends the gateway (here SIGKILL, after its manager's), the kernels' launchers die
    with it and take their sandboxes along (Docker: the container is removed): before, on
    Docker, they ran on until the next `serve` on the data dir removed them."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmgwkill-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "0"}, data_dir=data_dir)
    try:
        with srv.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            assert c.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"}).json()["status"] == "ok"
        gateway = json.loads((data_dir / "gateway" / "gateway.json").read_text())["pid"]
        srv.proc.kill()  # no manager left to clean up after the gateway
        srv.proc.wait(30)
        os.kill(gateway, signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not _running(data_dir), "the kernel gone", timeout=20)
        assert _running(data_dir) == []
    finally:
        srv.discard()
        _remove_left(data_dir)
