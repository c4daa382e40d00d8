"""Failure recovery: the Kernel Gateway or the manager dies (SIGKILL, as a crash would)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import BACKEND, start_server, wait_for
from tests.support.procfs import processes_mentioning, unmount_under


def _gateway_pid(data_dir: Path) -> int:
    for pid in processes_mentioning(str(data_dir)):
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


def _wait_for(predicate, what: str, timeout: float = 60):  # noqa: ANN001, ANN202
    return wait_for(predicate, what, timeout)


def test_gateway_death_is_noticed_sessions_marked_and_gateway_restarted():
    data_dir = Path(tempfile.mkdtemp(prefix="kmgw-", dir="/tmp"))
    srv = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "1"}, data_dir=data_dir)
    try:
        with srv.client() as c:
            assert c.post("/v1/sessions", json={"session_id": "a"}).status_code == 201
            assert c.post("/v1/sessions/a/execute", json={"code": "x = 1"}).json()["status"] == "ok"
            old_kernel = c.get("/v1/sessions/a").json()["kernel_id"]
            old_gateway = _gateway_pid(data_dir)
            assert processes_mentioning(old_kernel) or BACKEND == "docker"  # what is checked below
            if BACKEND == "docker":
                assert _containers_of(old_kernel)
            os.kill(old_gateway, signal.SIGKILL)
            # Noticed at once (the manager is the gateway's parent): the session is marked dead.
            _wait_for(lambda: c.get("/v1/sessions/a").json()["status"] == "dead", "the session marked dead", 30)
            # A new gateway answers.
            ready = _wait_for(lambda: (r := c.get("/readyz")).status_code == 200 and r.json(), "readiness")
            assert ready["checks"]["gateway"] == {"ok": True, "restarts": 1, "mode": "embedded"}
            assert _gateway_pid(data_dir) != old_gateway
            # Nothing of the old kernel is left (its sandbox died with the gateway).
            _wait_for(lambda: not processes_mentioning(old_kernel), "the old kernel's processes to end", 30)
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
        _wait_for(lambda: not processes_mentioning(str(data_dir)), "every process to end", 30)
    finally:
        srv.stop()
        unmount_under(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def test_manager_sigkill_then_restart_adopts_kernels_with_their_variables():
    """kill -9 of `serve`: the gateway and kernels live on; the next `serve` on the same data dir
    adopts them. Variables survive, the run that was in flight reports `interrupted`, a session
    whose kernel vanished is `lost`, and nothing is left over."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmadopt-", dir="/tmp"))
    env = {"KERNELMODE_SESSIONS__POOL_SIZE": "1", "KERNELMODE_GATEWAY__ORPHAN_TIMEOUT_SECONDS": "120"}
    srv = start_server(env, data_dir=data_dir)
    srv2 = None
    try:
        with srv.client() as c:
            for sid in ("keep", "busy", "gone"):
                assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
            assert c.post("/v1/sessions/keep/execute", json={"code": "x = 41"}).json()["status"] == "ok"
            assert c.post("/v1/sessions/busy/execute", json={"code": "y = 5"}).json()["status"] == "ok"
            long = c.post("/v1/sessions/busy/execute",
                          json={"code": "import time\nfor _ in range(600): time.sleep(1)", "wait_seconds": 1})
            assert long.status_code == 202, long.text
            long_run = long.json()["run_id"]
            gone_kernel = c.get("/v1/sessions/gone").json()["kernel_id"]
        gateway = _gateway_pid(data_dir)
        srv.proc.kill()
        srv.proc.wait(10)
        time.sleep(1)
        assert _gateway_pid(data_dir) == gateway  # the gateway outlives its manager
        # A kernel that vanishes meanwhile (shut down behind kernelmode's back).
        state = json.loads((data_dir / "gateway" / "gateway.json").read_text())
        r = httpx.delete(f"http://127.0.0.1:{state['port']}/api/kernels/{gone_kernel}",
                         headers={"Authorization": f"token {state['token']}"})
        assert r.status_code == 204

        srv2 = start_server(env, data_dir=data_dir)
        with srv2.client() as c:
            assert _gateway_pid(data_dir) == gateway  # adopted, not replaced
            assert c.get("/v1/sessions/keep").json()["status"] == "idle"
            r = c.post("/v1/sessions/keep/execute", json={"code": "x + 1"}).json()
            assert r["status"] == "ok" and r["result"] == "42" and r["state_lost"] is False, r
            run = c.get(f"/v1/runs/{long_run}").json()
            assert run["status"] == "interrupted" and run["done"] is True, run
            assert run["result"]["error"]["ename"] == "ServerRestarted" and run["result"]["state_lost"] is False
            r = c.post("/v1/sessions/busy/execute", json={"code": "y"}).json()
            assert r["status"] == "ok" and r["result"] == "5", r  # interrupted, variables kept
            assert c.get("/v1/sessions/gone").json()["status"] == "lost"
            assert c.post("/v1/sessions", json={"session_id": "new"}).status_code == 201
            assert c.post("/v1/sessions/new/execute", json={"code": "7 * 6"}).json()["result"] == "42"
            # The old manager's pool kernel was shut down: live kernels are the sessions' and the
            # new pool's only.
            sessions = {s["kernel_id"] for s in c.get("/v1/sessions").json()["sessions"] if s["status"] != "lost"}
            kernels = {k["id"] for k in httpx.get(f"http://127.0.0.1:{state['port']}/api/kernels",
                                                   headers={"Authorization": f"token {state['token']}"}).json()}
            assert sessions <= kernels and len(kernels - sessions) <= 1, (sessions, kernels)
        events = [json.loads(x) for x in srv2.log().splitlines() if x.startswith('{"ts"')]
        assert {e["session_id"] for e in events if e["event"] == "session_adopted"} == {"keep", "busy"}
        assert srv2.stop() == 0
        _wait_for(lambda: not processes_mentioning(str(data_dir)), "every process to end", 30)
        assert not (data_dir / "gateway" / "gateway.json").exists()
    finally:
        for s in (srv, srv2):
            if s is not None and s.proc.poll() is None:
                s.stop()
        if processes_mentioning(str(data_dir)):
            with contextlib.suppress(ProcessLookupError, AssertionError):
                os.killpg(_gateway_pid(data_dir), signal.SIGKILL)
        unmount_under(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
