"""Hibernation: idle sessions are checkpointed and their kernels stopped; each front door (REST,
MCP, a console attach) wakes them with their variables; unused ones are deleted in the end."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import Server, start_server
from tests.mcp.conftest import mcp_client

WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"
CAPPED = secrets.token_urlsafe(18)  # a tenant that may hold 2 live sessions


ENV = {"KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "2", "KERNELMODE_SESSIONS__HIBERNATED_TTL_SECONDS": "3600",
       "KERNELMODE_SESSIONS__POOL_SIZE": "0",
       "KERNELMODE_SERVER__TENANTS": f"[{{name: capped, token: '{CAPPED}', max_sessions: 2}}]"}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[Server]]:
    """The module's server (a list: the last test restarts it on the same data directory)."""
    held = [start_server(ENV)]
    yield held
    for s in reversed(held):  # the running one first: both use one data directory
        s.discard()


@pytest.fixture(scope="module")
def srv(servers: list[Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


def _kernel_processes(kernel_id: str) -> int:
    """Processes on this machine whose command line names the kernel (its connection file)."""
    n = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if kernel_id.encode() in (proc / "cmdline").read_bytes():
                    n += 1
            except OSError:
                pass
    return n


def _wait_status(api: httpx.Client, sid: str, status: str, within: float = 120) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        info = api.get(f"/v1/sessions/{sid}").json()
        if info["status"] == status:
            return info
        time.sleep(0.3)
    raise AssertionError(f"session {sid} never became {status}: {info}")


def _hibernated_session(api: httpx.Client, code: str) -> tuple[str, str]:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201
    sid, kernel_id = r.json()["session_id"], r.json()["kernel_id"]
    run = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert run.json()["status"] == "ok", run.text
    info = _wait_status(api, sid, "hibernated")
    assert _kernel_processes(kernel_id) == 0  # nothing of it runs
    assert info["kernel_id"] == kernel_id
    return sid, kernel_id


def test_rest_run_wakes_a_hibernated_session(api: httpx.Client) -> None:
    sid, _ = _hibernated_session(api, "import pandas as pd\nframe = pd.DataFrame({'a': [1, 2, 3]})")
    listed = [s for s in api.get("/v1/sessions").json()["sessions"] if s["session_id"] == sid]
    assert listed[0]["status"] == "hibernated"
    assert api.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"][0]["auto"] is True
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "int(frame.a.sum())"}).json()
    assert r["status"] == "ok" and r["result"] == "6"
    assert r["state_lost"] is False and r["restored_from"] is not None
    api.delete(f"/v1/sessions/{sid}")
    assert api.get(f"/v1/sessions/{sid}").status_code == 404


def test_files_of_a_hibernated_session_stay_and_it_sleeps_again(api: httpx.Client) -> None:
    sid, _ = _hibernated_session(api, "open('/mnt/data/kept.txt', 'w').write('still here')\nn = 1")
    files = api.get(f"/v1/sessions/{sid}/files").json()["files"]  # starts its kernel: files go through it
    assert [f["path"] for f in files] == ["/mnt/data/kept.txt"]
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "n += 1\nn, open('/mnt/data/kept.txt').read()"})
    assert r.json()["result"] == "(2, 'still here')"
    _wait_status(api, sid, "hibernated")  # the second sleep keeps the second state
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "n"}).json()["result"] == "2"
    api.delete(f"/v1/sessions/{sid}")


def test_mcp_run_wakes_a_hibernated_session(srv: Server, api: httpx.Client) -> None:
    sid, _ = _hibernated_session(api, "word = 'awake'")

    async def call() -> str:
        async with mcp_client(srv) as client:
            result = await client.call_tool("run_python", {"code": "word.upper()", "session_id": sid})
        return "\n".join(c.text for c in result.content if hasattr(c, "text"))

    text = asyncio.run(call())
    assert "AWAKE" in text and "restored from checkpoint" in text and "all variables are back" in text
    api.delete(f"/v1/sessions/{sid}")


def test_console_attach_wakes_a_hibernated_session(srv: Server, api: httpx.Client) -> None:
    sid, old_kernel = _hibernated_session(api, "z = 99")
    with connect(f"ws{srv.url[4:]}/v1/sessions/{sid}/channels",
                 additional_headers={"Authorization": f"Bearer {srv.token}"},
                 subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                 open_timeout=120):
        info = api.get(f"/v1/sessions/{sid}").json()
        assert info["status"] != "hibernated" and info["kernel_id"] != old_kernel
        assert _kernel_processes(info["kernel_id"]) >= 1
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "z"}).json()
    assert r["result"] == "99" and r["state_lost"] is False
    api.delete(f"/v1/sessions/{sid}")


def test_hibernated_sessions_are_deleted_after_their_ttl() -> None:
    s = start_server({"KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "1",
                      "KERNELMODE_SESSIONS__HIBERNATED_TTL_SECONDS": "2",
                      "KERNELMODE_SESSIONS__POOL_SIZE": "0"})
    try:
        with s.client() as api:
            sid = api.post("/v1/sessions", json={}).json()["session_id"]
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "a = 1"})
            deadline = time.monotonic() + 120
            seen = set()
            while time.monotonic() < deadline:
                r = api.get(f"/v1/sessions/{sid}")
                if r.status_code == 404:
                    break
                seen.add(r.json()["status"])
                time.sleep(0.3)
            assert r.status_code == 404 and "hibernated" in seen
            assert not list((s.data_dir / "artifacts" / ".checkpoints").glob("*/namespace.kmck"))
            log = [json.loads(line) for line in s.log().splitlines() if line.startswith("{")]
            assert log and not any(e.get("level") in ("error", "critical") for e in log)
    finally:
        s.discard()


def test_a_run_sent_while_the_session_hibernates_wakes_it(api: httpx.Client) -> None:
    # The hibernation's checkpoint is held up (pickling `gate` waits for a file) while a run is
    # sent: that run waits, then finds the session asleep, wakes it and runs there.
    r = api.post("/v1/sessions", json={})
    sid = r.json()["session_id"]
    api.post(f"/v1/sessions/{sid}/execute", json={"code": (
        "import os, time\nclass Gate:\n    def __reduce__(self):\n"
        "        open('/mnt/data/started', 'w').close()\n"
        "        while not os.path.exists('/mnt/data/go'):\n            time.sleep(0.05)\n"
        "        return (int, (5,))\ngate = Gate()")})
    deadline = time.monotonic() + 120
    while not any(f["path"] == "/mnt/data/started" for f in api.get(f"/v1/sessions/{sid}/files").json()["files"]):
        assert time.monotonic() < deadline, "the hibernation never began"
        time.sleep(0.2)
    queued = api.post(f"/v1/sessions/{sid}/execute", json={"code": "gate + 1", "wait_seconds": 0})
    assert queued.status_code == 202
    assert api.put(f"/v1/sessions/{sid}/files/go", content=b"").status_code == 201
    run_id = queued.json()["run_id"]
    while True:
        progress = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 30}).json()
        if progress["done"]:
            break
        assert time.monotonic() < deadline + 120
    result = progress["result"]
    assert result["status"] == "ok" and result["result"] == "6" and result["restored_from"], result
    api.delete(f"/v1/sessions/{sid}")


def test_a_wake_is_an_admission_the_tenants_quota_holds(srv: Server) -> None:
    """A tenant limited to 2 live sessions, holding 2 busy ones, cannot wake a hibernated one
    through any door (run, files, console attach, restart): each answers the create path's 429
    quota_exceeded saying what to do, and the session stays hibernated with its variables."""
    with srv.client(CAPPED) as capped:
        asleep = [_hibernated_session(capped, f"kept = {n}")[0] for n in (1, 2)]
        busy = []
        for _ in range(2):
            r = capped.post("/v1/sessions", json={})
            assert r.status_code == 201, r.text
            busy.append(r.json()["session_id"])
            run = capped.post(f"/v1/sessions/{busy[-1]}/execute",
                              json={"code": "import time; time.sleep(600)", "wait_seconds": 0})
            assert run.status_code == 202, run.text
        sid = asleep[0]
        attempts = [capped.post(f"/v1/sessions/{sid}/execute", json={"code": "kept"}),
                    capped.get(f"/v1/sessions/{sid}/files"),
                    capped.post(f"/v1/sessions/{sid}/restart"),
                    capped.post(f"/v1/sessions/{sid}/checkpoint")]
        for r in attempts:
            assert r.status_code == 429, (r.request.url, r.text)
            error = r.json()["error"]
            assert error["code"] == "quota_exceeded", error
            assert "maximum of 2 sessions" in error["message"] and "stays hibernated" in error["message"], error
        with pytest.raises(InvalidStatus) as refused:
            connect(f"ws{srv.url[4:]}/v1/sessions/{sid}/channels",
                    additional_headers={"Authorization": f"Bearer {CAPPED}"},
                    subprotocols=[WS_PROTOCOL], open_timeout=120)  # type: ignore[list-item]
        assert refused.value.response.status_code == 429
        live = [s for s in capped.get("/v1/sessions").json()["sessions"] if s["status"] != "hibernated"]
        assert len(live) == 2, live
        for s in asleep:
            assert capped.get(f"/v1/sessions/{s}").json()["status"] == "hibernated"
        # One busy session closed: the wake is admitted, with the session's variables
        assert capped.delete(f"/v1/sessions/{busy.pop()}").status_code == 204
        r = capped.post(f"/v1/sessions/{sid}/execute", json={"code": "kept"}).json()
        assert r["status"] == "ok" and r["result"] == "1" and r["state_lost"] is False, r
        for s in [*asleep, *busy]:
            capped.delete(f"/v1/sessions/{s}")


# A checkpointed variable whose loading never ends: the kernel renames itself (seen in /proc from
# here, whichever backend) and loops, so a restore of it is under way until something stops it.
ENDLESS_RESTORE = (
    "class Endless:\n    def __reduce__(self):\n        return (exec, (\"open('/proc/self/comm', 'w')"
    ".write('km-restoring')\\nimport time\\nwhile True:\\n    time.sleep(0.05)\",))\n"
    "endless = Endless()\nkept = 5")


def _restoring() -> bool:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "km-restoring":
                    return True
            except OSError:
                pass
    return False


def test_a_restart_during_a_restore_ends_the_run_at_once(srv: Server, api: httpx.Client) -> None:
    """A Jupyter-API restart while a woken session's checkpoint is being restored ends the run
    in flight by the time the restart answers (interrupted, state lost, the cause said), and the
    session is usable at once, empty as a restart leaves it."""
    from kernelmode.api.jupyter_api import kernel_id_of

    sid, _ = _hibernated_session(api, ENDLESS_RESTORE)
    queued = api.post(f"/v1/sessions/{sid}/execute", json={"code": "kept", "wait_seconds": 0})
    assert queued.status_code == 202, queued.text
    run_id = queued.json()["run_id"]
    deadline = time.monotonic() + 120
    while not _restoring():
        assert time.monotonic() < deadline, "the restore never began"
        time.sleep(0.1)
    restarted = api.post(f"/api/kernels/{kernel_id_of(sid)}/restart")
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["execution_state"] == "idle"
    progress = api.get(f"/v1/runs/{run_id}").json()
    assert progress["done"], progress  # ended by the restart, not by a timeout later
    result = progress["result"]
    assert result["status"] == "interrupted" and result["state_lost"] is True, result
    assert "restart was requested while the session was being restored" in result["error"]["evalue"], result
    assert not _restoring()
    after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "'kept' in dir(), 6 * 7"}).json()
    assert after["status"] == "ok" and after["result"] == "(False, 42)", after
    assert api.get(f"/v1/sessions/{sid}").json()["status"] == "idle"
    api.delete(f"/v1/sessions/{sid}")


def test_a_restart_during_a_consoles_restore_gives_it_a_fresh_kernel(srv: Server, api: httpx.Client) -> None:
    """A console attaching to a woken session waits for the restore; a restart meanwhile cuts it
    short: the console is attached to a fresh, empty kernel, and the restart's answer says idle."""
    import threading

    from kernelmode.api.jupyter_api import kernel_id_of

    sid, _ = _hibernated_session(api, ENDLESS_RESTORE)
    attached: list[object] = []
    leave = threading.Event()

    def attach() -> None:
        try:
            with connect(f"ws{srv.url[4:]}/v1/sessions/{sid}/channels",
                         additional_headers={"Authorization": f"Bearer {srv.token}"},
                         subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                         open_timeout=120) as ws:
                attached.append(ws)
                leave.wait(300)
        except Exception as e:  # noqa: BLE001 (reported below)
            attached.append(e)

    worker = threading.Thread(target=attach)
    worker.start()
    deadline = time.monotonic() + 120
    while not _restoring():
        assert time.monotonic() < deadline, "the restore never began"
        time.sleep(0.1)
    restarted = api.post(f"/api/kernels/{kernel_id_of(sid)}/restart")
    assert restarted.status_code == 200 and restarted.json()["execution_state"] == "idle", restarted.text
    try:
        deadline = time.monotonic() + 120
        while not attached:
            assert time.monotonic() < deadline, "the console never attached"
            time.sleep(0.1)
        assert not isinstance(attached[0], Exception), attached
        assert not _restoring()
        after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "'kept' in dir(), 6 * 7"}).json()
        assert after["status"] == "ok" and after["result"] == "(False, 42)", after
    finally:
        leave.set()
        worker.join(120)
    api.delete(f"/v1/sessions/{sid}")


def test_hibernated_sessions_outlive_a_restart_of_the_server(servers: list[Server], api: httpx.Client) -> None:
    """Last in this module: it restarts the module's server on its data directory."""
    sid, _ = _hibernated_session(api, "open('/mnt/data/f.txt', 'w').write('disk')\nmemo = {'k': 'v'}")
    first = servers[-1]
    assert first.stop() == 0
    second = start_server(ENV, data_dir=first.data_dir)
    servers.append(second)
    with second.client() as c:
        assert c.get(f"/v1/sessions/{sid}").json()["status"] == "hibernated"
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "memo['k'], open('/mnt/data/f.txt').read()"})
        assert r.json()["result"] == "('v', 'disk')" and r.json()["state_lost"] is False
        c.delete(f"/v1/sessions/{sid}")
