"""Failure recovery: the Kernel Gateway dies under a running server (SIGKILL, as a crash would)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from tests.conftest import BACKEND, start_server
from tests.integration.test_lifecycle import _processes_mentioning, _unmount_under


def _gateway_pid(data_dir: Path) -> int:
    for pid in _processes_mentioning(str(data_dir)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kernel_gateway" in cmdline:
            return pid
    raise AssertionError("no kernel gateway process found")


def _containers_of(kernel_id: str) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        return [c.id for c in client.containers.list(all=True, filters={"label": f"kernelmode.kernel_id={kernel_id}"})]
    finally:
        client.close()


def _wait_for(predicate, what: str, timeout: float = 60):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_gateway_death_is_noticed_sessions_marked_and_gateway_restarted():
    data_dir = Path(tempfile.mkdtemp(prefix="kmgw-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "1"}, data_dir=data_dir)
    try:
        with srv.client() as c:
            assert c.post("/v1/sessions", json={"session_id": "a"}).status_code == 201
            assert c.post("/v1/sessions/a/execute", json={"code": "x = 1"}).json()["status"] == "ok"
            old_kernel = c.get("/v1/sessions/a").json()["kernel_id"]
            old_gateway = _gateway_pid(data_dir)
            assert _processes_mentioning(old_kernel) or BACKEND == "docker"  # what is checked below
            if BACKEND == "docker":
                assert _containers_of(old_kernel)
            os.kill(old_gateway, signal.SIGKILL)
            # Noticed at once (the manager is the gateway's parent): the session is marked dead.
            _wait_for(lambda: c.get("/v1/sessions/a").json()["status"] == "dead", "the session marked dead", 30)
            # A new gateway answers.
            ready = _wait_for(lambda: (r := c.get("/readyz")).status_code == 200 and r.json(), "readiness")
            assert ready["checks"]["gateway"] == {"ok": True, "restarts": 1}
            assert _gateway_pid(data_dir) != old_gateway
            # Nothing of the old kernel is left (its sandbox died with the gateway).
            _wait_for(lambda: not _processes_mentioning(old_kernel), "the old kernel's processes to end", 30)
            if BACKEND == "docker":
                _wait_for(lambda: not _containers_of(old_kernel), "the old kernel's container to go", 30)
            # The session goes on with a fresh kernel on its workspace, and says its state is lost.
            r = c.post("/v1/sessions/a/execute", json={"code": "'x' in globals()"}).json()
            assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r
            info = c.get("/v1/sessions/a").json()
            assert info["status"] == "idle" and info["kernel_id"] != old_kernel
            r = c.post("/v1/sessions/a/execute", json={"code": "y = 2; y"}).json()
            assert r["result"] == "2" and r["state_lost"] is False
            # New sessions work.
            assert c.post("/v1/sessions", json={"session_id": "b"}).status_code == 201
            assert c.post("/v1/sessions/b/execute", json={"code": "40 + 2"}).json()["result"] == "42"
            metrics = c.get("/metrics").text
            assert "kernelmode_gateway_restarts_total 1.0" in metrics
        events = [json.loads(x)["event"] for x in srv.log().splitlines() if x.startswith('{"ts"')]
        assert "gateway_died" in events and "gateway_restarted" in events
        assert srv.stop() == 0
        _wait_for(lambda: not _processes_mentioning(str(data_dir)), "every process to end", 30)
    finally:
        srv.stop()
        _unmount_under(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
