"""Manager-owned liveness (sessions/liveness.py), with real parts: a kernel frozen with SIGSTOP
(alive to the gateway, never answering: what a blackholed node looks like) and a frozen
gateway. Deadlines here are the tests' own generous bounds (a failure, never a hang)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Server, start_server, wait_for
from tests.integration.test_recovery import _gateway_pid
from tests.support.procfs import processes_mentioning, unmount_under

FAST = {
    "KERNELMODE_SESSIONS__POOL_SIZE": "1",
    "KERNELMODE_GATEWAY__PROBE_INTERVAL_SECONDS": "0.5",
    "KERNELMODE_GATEWAY__PROBE_TIMEOUT_SECONDS": "2",
    "KERNELMODE_GATEWAY__PROBE_MISSES": "2",
    "KERNELMODE_GATEWAY__SHUTDOWN_TIMEOUT_SECONDS": "5",
    # How long a silent gateway is given before its kernels count as lost (the frozen-gateway test
    # waits it out); still several times a loaded machine's kernel start, which it also bounds.
    "KERNELMODE_SESSIONS__KERNEL_START_TIMEOUT_SECONDS": "12",
}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    server = start_server(FAST)
    try:
        yield server
    finally:
        with contextlib.suppress(AssertionError):
            os.kill(_gateway_pid(server.data_dir), signal.SIGCONT)
        server.stop()
        unmount_under(server.data_dir)
        if os.environ.get("KM_KEEP_LOGS") is None:
            server.discard()


_wait_for: Callable[..., Any] = wait_for


def _signal_kernel(kernel_id: str, sig: int) -> list[int]:
    pids = processes_mentioning(kernel_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _run(c: httpx.Client, sid: str, code: str, **opts: object) -> dict[str, Any]:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts}, timeout=180)
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


def _finished(c: httpx.Client, run_id: str) -> dict[str, Any] | None:
    r = c.get(f"/v1/runs/{run_id}", params={"wait_seconds": 2}).json()
    return dict(r["result"]) if r["done"] else None


def _events(srv: Server) -> list[dict[str, Any]]:
    return [json.loads(x) for x in srv.log().splitlines() if x.startswith('{"ts"')]


def test_a_frozen_kernel_ends_its_run_as_lost_and_the_session_comes_back(srv: Server) -> None:
    with srv.client() as c:
        for sid in ("frozen", "healthy"):
            assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
        assert _run(c, "frozen", "x = 41")["status"] == "ok"
        assert c.post("/v1/sessions/frozen/checkpoint").status_code in (200, 201)
        assert _run(c, "healthy", "h = 'still here'")["status"] == "ok"
        old_kernel = c.get("/v1/sessions/frozen").json()["kernel_id"]
        # A run that would go on for ten minutes, then the kernel stops answering anything.
        r = _run(c, "frozen", "import time\nprint('going', flush=True)\ntime.sleep(600)",
                 timeout_seconds=900, wait_seconds=1)
        assert r["status"] == "running", r
        stopped = _signal_kernel(old_kernel, signal.SIGSTOP)
        assert stopped, "no process of the kernel found"
        try:
            done = _wait_for(lambda: _finished(c, r["run_id"]), "the run on the frozen kernel to end")
            assert done["status"] == "kernel_died" and done["state_lost"] is True, done
            assert done["cause"]["kind"] == "lost" and "kernel_info" in done["cause"]["detail"], done
            assert done["cause"]["signal"] is None and done["cause"]["exit_code"] is None  # nothing guessed
            info = c.get("/v1/sessions/frozen").json()
            assert info["status"] == "dead" and info["cause"]["kind"] == "lost", info
            listed = {i["session_id"]: i for i in c.get("/v1/sessions").json()["sessions"]}
            assert listed["frozen"]["cause"]["kind"] == "lost"
            # Other sessions never noticed.
            assert _run(c, "healthy", "h")["result"] == "'still here'"
            assert c.get("/v1/sessions/healthy").json()["cause"] is None
            # The session answers again: a fresh kernel, restored from its checkpoint.
            again = _run(c, "frozen", "x + 1")
            assert again["status"] == "ok" and again["result"] == "42", again
            assert again["restored_from"] is not None and "x" in again["restored_variables"], again
            info = c.get("/v1/sessions/frozen").json()
            assert info["status"] == "idle" and info["kernel_id"] != old_kernel and info["cause"] is None
            # The frozen kernel is shut down in the background (nobody waited for it).
            gateway_log = srv.data_dir / "gateway" / "gateway.log"
            _wait_for(lambda: f"Kernel shutdown: {old_kernel}" in gateway_log.read_text(errors="replace"),
                      "the gateway to be told to shut the frozen kernel down", 60)
        finally:
            _signal_kernel(old_kernel, signal.SIGCONT)
        # (The workspace keeps the first kernel's id; the old kernel's own files are run/<id>.)
        _wait_for(lambda: not processes_mentioning(f"run/{old_kernel}"), "the frozen kernel's processes to go", 60)
    events = {e["event"] for e in _events(srv)}
    assert "kernel_lost" in events


def test_an_idle_frozen_kernel_is_found_by_the_periodic_probe(srv: Server) -> None:
    with srv.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "sleepy"}).status_code == 201
        assert _run(c, "sleepy", "s = 1")["status"] == "ok"
        kernel = c.get("/v1/sessions/sleepy").json()["kernel_id"]
        assert _signal_kernel(kernel, signal.SIGSTOP)
        try:
            info = _wait_for(lambda: (i := c.get("/v1/sessions/sleepy").json())["status"] == "dead" and i,
                             "the idle frozen session to be marked dead")
            assert info["cause"]["kind"] == "lost"
        finally:
            _signal_kernel(kernel, signal.SIGCONT)
        r = _run(c, "sleepy", "'s' in globals()")
        assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r


def test_a_frozen_gateway_hangs_nothing(srv: Server) -> None:
    """The whole gateway stops answering (as Enterprise Gateway did on a blackholed node): the
    manager's own REST answers, DELETE does not wait on the gateway, and once the gateway has
    been silent longer than a kernel start may take, a run on it ends as lost."""
    with srv.client() as c:
        for sid in ("g1", "g2"):
            assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
            assert _run(c, sid, "v = 1")["status"] == "ok"
        r = _run(c, "g1", "import time\ntime.sleep(600)", timeout_seconds=900, wait_seconds=1)
        assert r["status"] == "running"
        gateway = _gateway_pid(srv.data_dir)
        os.kill(gateway, signal.SIGSTOP)
        try:
            done = _wait_for(lambda: _finished(c, r["run_id"]), "the run to end while the gateway is frozen")
            assert done["status"] == "kernel_died" and done["cause"]["kind"] == "lost", done
            assert c.get("/v1/sessions").status_code == 200
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["gateway"]["ok"] is False
            _wait_for(lambda: c.get("/v1/sessions/g2").json()["status"] == "dead", "the idle session lost")
            # Its kernel's DELETE goes to a gateway that does not answer: in the background.
            assert c.delete("/v1/sessions/g2").status_code in (200, 204)
            assert c.get("/v1/sessions/g2").status_code == 404
        finally:
            os.kill(gateway, signal.SIGCONT)
        _wait_for(lambda: c.get("/readyz").status_code == 200, "readiness once the gateway answers")
        r = _run(c, "g1", "'v' in globals()")
        assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r
        assert c.post("/v1/sessions", json={"session_id": "g3"}).status_code == 201
        assert _run(c, "g3", "1 + 1")["result"] == "2"
