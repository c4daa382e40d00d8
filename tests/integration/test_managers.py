"""Several managers on one PostgreSQL store and one external Kernel Gateway (real parts: the
suite's PostgreSQL, a real gateway, real `serve` processes, bubblewrap): ownership by leases,
start-up beside live managers, failover after a `kill -9`, one reaper across managers
(docs/high-availability.md). Requests go to the owner, or to any manager after its death."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from jupyter_client.session import Session as JupyterSession
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from kernelmode.api.forwarding import FORWARDED_HEADER
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame
from tests.support.managers import Managers, start_managers
from tests.support.postgres import PgCluster
from tests.support.server import wait_for

LEASE = 3  # store.lease_seconds: failover within about 1.5 of it
ENV = {
    "KERNELMODE_STORE__LEASE_SECONDS": str(LEASE),
    "KERNELMODE_SESSIONS__POOL_SIZE": "1",
    "KERNELMODE_SERVER__DRAIN_SECONDS": "20",  # the default (the suite's servers stop without)
    # Sessions stay where they were made, as the tests assert (rebalancing: test_rebalance.py).
    "KERNELMODE_STORE__REBALANCE": "false",
    # Hibernation on, but only a session created with a short ttl_seconds is ever due (the
    # reaping test); a hibernated one is deleted 2 s later, by one manager.
    "KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "3600",
    "KERNELMODE_SESSIONS__HIBERNATED_TTL_SECONDS": "2",
}


@pytest.fixture(scope="module")
def ms(pg_cluster: PgCluster) -> Iterator[Managers]:
    with start_managers(2, pg_cluster.create_database("managers"), ENV) as managers:
        yield managers


def _sql(ms: Managers, query: str, args: tuple = ()) -> list[tuple]:
    with psycopg.connect(ms.env["KERNELMODE_STORE__URL"], autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def _owner_url(ms: Managers, sid: str) -> str | None:
    rows = _sql(ms, "SELECT m.url FROM leases l JOIN managers m USING (manager_id) "
                "WHERE l.session_id = %s AND l.expires_at > now() AND m.expires_at > now()", (sid,))
    return rows[0][0] if rows else None


def _create(c: httpx.Client, sid: str, **extra: object) -> None:
    r = c.post("/v1/sessions", json={"session_id": sid, **extra})
    assert r.status_code == 201, r.text


def _run(c: httpx.Client, sid: str, code: str) -> dict:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, r.text
    return r.json()


def _answers(c: httpx.Client, sid: str, code: str) -> dict | None:
    """The run's result once a manager serves the session (None while it answers 503: the dead
    owner's lease runs, and forwarding to it finds it gone)."""
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    if r.status_code == 503:
        assert r.json()["error"]["code"] in ("session_owned_elsewhere", "manager_gone"), r.text
        return None
    assert r.status_code == 200, r.text
    return r.json()


class _Console:
    """A console's kernel websocket to one manager (``/v1/sessions/{id}/channels``, v1 frames)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.session = JupyterSession(key=b"", username="person")

    def execute(self, code: str) -> dict:
        """The execute_reply's content."""
        msg = self.session.msg("execute_request", {"code": code, "silent": False})
        self.ws.send(encode_frame(msg, "shell"))
        while True:
            reply = decode_frame(self.ws.recv(timeout=60), Bounds(max_part_bytes=1 << 24))
            if reply["msg_type"] == "execute_reply" and reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]


@contextlib.contextmanager
def _console(url: str, sid: str, token: str) -> Iterator[_Console]:
    ws_url = url.replace("http", "ws", 1) + f"/v1/sessions/{sid}/channels"
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"},
                 subprotocols=[Subprotocol("v1.kernel.websocket.jupyter.org")]) as ws:
        yield _Console(ws)


def _pool_of(ms: Managers, i: int) -> set[str]:
    """The kernels manager ``i`` marked that are no session's (its warm pool)."""
    return {r[0] for r in _sql(ms, "SELECT p.kernel_id FROM pool_kernels p JOIN managers m USING (manager_id) "
                               "WHERE m.url = %s AND m.expires_at > now() AND p.kernel_id NOT IN "
                               "(SELECT kernel_id FROM sessions WHERE kernel_id IS NOT NULL)", (ms[i].url,))}


def _gateway_kernels(ms: Managers) -> set[str]:
    return {k["id"] for k in ms.gateway.get("/api/kernels").json()}


def _audits(ms: Managers, event: str, only: int | None = None, **match: object) -> list[dict]:
    """The audit lines ``event`` (with the fields of ``match``) of every manager's log (or of
    manager ``only``'s)."""
    found = []
    for i in range(len(ms)) if only is None else [only]:
        for line in ms[i].log().splitlines():
            if f'"event": "{event}"' not in line and f'"event":"{event}"' not in line:
                continue
            entry = json.loads(line[line.index("{"):])
            if all(entry.get(k) == v for k, v in match.items()):
                found.append(entry)
    return found


def test_each_manager_is_in_the_store_with_its_url(ms: Managers) -> None:
    rows = dict(_sql(ms, "SELECT url, manager_id FROM managers WHERE expires_at > now()"))
    assert {ms[0].url, ms[1].url} <= set(rows)


def test_a_starting_manager_leaves_the_live_ones_sessions_and_kernels_alone(ms: Managers) -> None:
    with ms.client(0) as c:
        _create(c, "mine0")
        assert _run(c, "mine0", "x = 41")["status"] == "ok"
        wait_for(lambda: c.get("/readyz").json()["checks"]["pool"]["ready"] >= 1, "manager 0's pool kernel")
    assert _owner_url(ms, "mine0") == ms[0].url
    kernel = _sql(ms, "SELECT kernel_id FROM sessions WHERE session_id = 'mine0'")[0][0]
    pool = _pool_of(ms, 0)
    ms.restart(1)  # a start beside a live manager: before ownership, mine0 became lost here
    assert _sql(ms, "SELECT status FROM sessions WHERE session_id = 'mine0'")[0][0] == "idle"
    with ms.client(0) as c:
        assert _run(c, "mine0", "x + 1")["result"] == "42"
        assert c.get("/v1/sessions/mine0").json()["status"] == "idle"
    assert pool and {kernel, *pool} <= _gateway_kernels(ms)  # neither its session's kernel nor its pool's
    assert _owner_url(ms, "mine0") == ms[0].url
    with ms.client(1) as c:  # the other manager forwards to the owner (api/forwarding.py)
        r = c.post("/v1/sessions/mine0/execute", json={"code": "x + 0"})
        assert r.status_code == 200 and r.json()["result"] == "41", r.text
        # A request forwarded once already is not served by a non-owner: never deleted under its owner.
        r = c.delete("/v1/sessions/mine0", headers={FORWARDED_HEADER: "another"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "session_owned_elsewhere", r.text
        assert ms[0].url in r.json()["error"]["message"], r.text
    with ms.client(0) as c:
        assert _run(c, "mine0", "x")["result"] == "41"


def test_kill_9_of_the_owner_while_idle_another_manager_serves_the_session(ms: Managers) -> None:
    with ms.client(0) as c:
        _create(c, "idle0")
        assert _run(c, "idle0", "kept = 'yes'")["status"] == "ok"
    assert _owner_url(ms, "idle0") == ms[0].url
    with ms.client(0) as c:
        wait_for(lambda: c.get("/readyz").json()["checks"]["pool"]["ready"] >= 1, "manager 0's pool kernel")
    pool = _pool_of(ms, 0)
    assert pool
    ms.kill(0)
    t0 = time.monotonic()
    with ms.client(1) as c:
        result = wait_for(lambda: _answers(c, "idle0", "kept"), "manager 1 to serve idle0", timeout=60)
    took = time.monotonic() - t0
    print(f"failover (idle): {took:.1f} s with store.lease_seconds={LEASE}")
    assert isinstance(result, dict) and result["status"] == "ok" and result["result"] == "'yes'", result
    assert _owner_url(ms, "idle0") == ms[1].url
    assert len(_audits(ms, "sessions_taken_over")) >= 1
    # The dead manager's pool kernel is shut down, by one survivor.
    wait_for(lambda: not pool & _gateway_kernels(ms), "manager 0's pool kernel to be shut down")
    removed = [k for e in _audits(ms, "orphan_kernels_removed") for k in e["kernel_ids"] if k in pool]
    assert sorted(removed) == sorted(pool)
    ms.restart(0)


def test_kill_9_during_a_long_run_ends_it_interrupted_once_and_keeps_the_state(ms: Managers) -> None:
    with ms.client(1) as c:
        _create(c, "busy1")
        assert _run(c, "busy1", "y = 7\nstarts = 0")["status"] == "ok"
        r = c.post("/v1/sessions/busy1/execute", json={
            "code": "starts += 1\nimport time\nwhile True: time.sleep(0.1)", "wait_seconds": 0})
        assert r.status_code in (200, 202), r.text
        run_id = r.json()["run_id"]
        wait_for(lambda: c.get(f"/v1/runs/{run_id}").json()["status"] == "running", "the run to start")
        time.sleep(0.5)  # the cell is under way in the kernel
    ms.kill(1)
    t0 = time.monotonic()
    with ms.client(0) as c:
        result = wait_for(lambda: _answers(c, "busy1", "(y, starts)"), "manager 0 to serve busy1", timeout=60)
        took = time.monotonic() - t0
        print(f"failover (during a run): {took:.1f} s with store.lease_seconds={LEASE}")
        # The variables kept, and the interrupted cell was not run again.
        assert isinstance(result, dict) and result["result"] == "(7, 1)", result
        run = c.get(f"/v1/runs/{run_id}").json()["result"]
    assert run["status"] == "interrupted", run
    assert run["error"]["ename"] == "ServerRestarted" and "another manager took the session over" in run["error"]["evalue"]
    assert run["state_lost"] is False
    assert _sql(ms, "SELECT COUNT(*) FROM runs WHERE run_id = %s", (run_id,))[0][0] == 1
    assert _sql(ms, "SELECT COUNT(*) FROM runs WHERE running")[0][0] == 0
    ms.restart(1)


def _stored_run(ms: Managers, run_id: str) -> dict:
    rows = _sql(ms, "SELECT result FROM runs WHERE run_id = %s", (run_id,))
    return json.loads(rows[0][0]) if rows else {}


LONG = "print('started', flush=True)\nimport time\nwhile True: time.sleep(0.1)"


def test_a_manager_frozen_past_its_lease_never_overwrites_the_new_owners_records(ms: Managers) -> None:
    """SIGSTOP of the owner during a long run: the other manager takes the session over and
    ends the run ``interrupted``. Woken (SIGCONT), the old owner sees its run end; the store
    refuses its writes (the lease is gone: fencing), so the record stays the new owner's; its
    waiting client gets 503 ``session_owned_elsewhere`` naming the run (not sent again), and the
    session is the other manager's from then on."""
    with ms.client(0) as c:
        _create(c, "frozen0")
        assert _run(c, "frozen0", "v = 5")["status"] == "ok"
    kernel = _sql(ms, "SELECT kernel_id FROM sessions WHERE session_id = 'frozen0'")[0][0]
    with ThreadPoolExecutor(1) as pool, ms.client(0) as c:
        waiting = pool.submit(c.post, "/v1/sessions/frozen0/execute", json={"code": LONG})  # answered at the end
        running = wait_for(lambda: _sql(ms, "SELECT run_id FROM runs WHERE session_id = 'frozen0' AND running"),
                           "the long run to be recorded")
        run_id = running[0][0]  # type: ignore[index]
        with ms.client(0) as poll:
            wait_for(lambda: poll.get(f"/v1/runs/{run_id}").json()["events"], "the cell to start")
        os.kill(ms[0].proc.pid, signal.SIGSTOP)
        # Its heartbeat held up once it wakes (its managers row locked; the heartbeat waits off
        # the event loop): the run's end, not a renewal, is the first to find the lease gone.
        with psycopg.connect(ms.env["KERNELMODE_STORE__URL"]) as holder:
            try:
                wait_for(lambda: _stored_run(ms, run_id).get("status") == "interrupted",
                         "manager 1 to take frozen0 over and end its run", timeout=60)
                assert _owner_url(ms, "frozen0") == ms[1].url
                holder.execute("SELECT 1 FROM managers WHERE url = %s FOR UPDATE", (ms[0].url,))
            finally:
                os.kill(ms[0].proc.pid, signal.SIGCONT)
            answer = waiting.result(timeout=60)  # the run ended in manager 0's view
            holder.rollback()
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "session_owned_elsewhere" and error["details"] == {"run_id": run_id}, error
    assert answer.headers["Retry-After"] == "1"
    with ms.client(0) as c:  # manager 0 reads the new owner's record, and serves the session no more
        run = c.get(f"/v1/runs/{run_id}").json()["result"]
        assert run["status"] == "interrupted" and run["error"]["ename"] == "ServerRestarted", run
        assert _run(c, "frozen0", "v")["result"] == "5"  # forwarded to manager 1: state kept
    stored = _stored_run(ms, run_id)
    assert stored["status"] == "interrupted" and "another manager took the session over" in stored["error"]["evalue"]
    assert _sql(ms, "SELECT COUNT(*) FROM runs WHERE run_id = %s", (run_id,))[0][0] == 1
    assert _sql(ms, "SELECT kernel_id, status FROM sessions WHERE session_id = 'frozen0'")[0] == (kernel, "idle")
    assert _owner_url(ms, "frozen0") == ms[1].url
    assert _audits(ms, "session_lease_lost", 0, session_id="frozen0", how="a write of its record was refused")
    assert not _audits(ms, "run", 0, run_id=run_id)  # manager 0 recorded nothing of its end
    ms.restart(0)  # its warm pool was shut down by manager 1 while it was frozen


def test_a_manager_frozen_past_its_lease_hands_no_dead_pool_kernel_to_its_next_create(ms: Managers) -> None:
    """SIGSTOP of a manager with a warm kernel, until the other found it dead and shut that
    kernel down; woken (SIGCONT), its next create gets a working kernel (its heartbeat found its
    row expired and dropped the pool; until then a create takes no pool kernel) and its session
    answers."""
    with ms.client(0) as c:
        wait_for(lambda: c.get("/readyz").json()["checks"]["pool"]["ready"] >= 1, "manager 0's pool kernel")
    pool = _pool_of(ms, 0)
    assert pool
    os.kill(ms[0].proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not pool & _gateway_kernels(ms), "manager 1 to shut manager 0's pool kernel down",
                 timeout=60)
    finally:
        os.kill(ms[0].proc.pid, signal.SIGCONT)
    with ms.client(0) as c:
        _create(c, "thawed0")
        assert _run(c, "thawed0", "t = 6 * 7\nt")["result"] == "42"
        assert _run(c, "thawed0", "t")["result"] == "42"
        kernel = c.get("/v1/sessions/thawed0").json()["kernel_id"]
        assert kernel not in pool
        # The pool is refilled with live kernels, and the next create works too.
        wait_for(lambda: c.get("/readyz").json()["checks"]["pool"]["ready"] >= 1, "manager 0's pool refilled")
        assert _pool_of(ms, 0) <= _gateway_kernels(ms)
        _create(c, "thawed1")
        assert _run(c, "thawed1", "1 + 1")["result"] == "2"
    assert _owner_url(ms, "thawed0") == ms[0].url


def test_sigterm_drains_the_run_in_flight_then_another_manager_serves_the_session(ms: Managers) -> None:
    """A rolling update's SIGTERM: the manager stops taking work (``/readyz`` 503, runs and
    creates 503 ``server_busy`` with Retry-After, a console's cell a failed cell), lets the run in
    flight finish with its real result, then gives its leases up; the other manager serves the
    session with its variables (the refused cell never ran)."""
    with ms.client(1) as c:
        _create(c, "drain1")
        assert _run(c, "drain1", "w = 11")["status"] == "ok"
    with ms.client(1) as c, _console(ms[1].url, "drain1", ms.token) as console:
        r = c.post("/v1/sessions/drain1/execute", json={
            "code": "print('started', flush=True)\nimport time\ntime.sleep(8)\nw += 1\n'finished'",
            "wait_seconds": 0})
        run_id = r.json()["run_id"]
        wait_for(lambda: c.get(f"/v1/runs/{run_id}").json()["events"], "the cell to start")
        ms[1].proc.send_signal(signal.SIGTERM)
        wait_for(lambda: c.get("/readyz").status_code == 503, "manager 1 to turn not ready")
        assert c.get("/readyz").json()["checks"]["drain"] == {"ok": False, "draining": True}
        refused = [c.post("/v1/sessions/drain1/execute", json={"code": "w"}), c.post("/v1/sessions", json={})]
        cell = console.execute("w += 100")  # on a websocket opened before the drain
        assert c.get(f"/v1/runs/{run_id}").json()["done"] is False  # all of this while the run ran
    assert cell["status"] == "error" and cell["ename"] == "ServerBusy", cell
    assert "stopping" in cell["evalue"] and "reconnect" in cell["evalue"], cell
    for r in refused:
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
        assert r.headers["Retry-After"] == "1" and "stopping" in r.json()["error"]["message"]
    assert ms[1].proc.wait(60) == 0
    run = _stored_run(ms, run_id)
    assert run["status"] == "ok" and run["result"] == "'finished'" and run["stdout"] == "started\n", run
    with ms.client(0) as c:
        result = wait_for(lambda: _answers(c, "drain1", "w"), "manager 0 to serve drain1", timeout=60)
        assert isinstance(result, dict) and result["result"] == "12", result
        assert c.get(f"/v1/runs/{run_id}").json()["result"]["status"] == "ok"
    assert _owner_url(ms, "drain1") == ms[0].url
    assert "drained in" in ms[1].log()
    ms.restart(1)


def test_a_restarted_manager_does_not_take_another_live_managers_sessions(ms: Managers) -> None:
    with ms.client(0) as c:
        _create(c, "stay0")
        assert _run(c, "stay0", "z = 3")["status"] == "ok"
    ms.kill(1)
    ms.restart(1)
    time.sleep(LEASE)  # a full lease period of heartbeats and scans on both
    assert _sql(ms, "SELECT status FROM sessions WHERE session_id = 'stay0'")[0][0] == "idle"
    with ms.client(0) as c:
        assert _run(c, "stay0", "z")["result"] == "3"
    assert _owner_url(ms, "stay0") == ms[0].url
    assert not _audits(ms, "sessions_taken_over", session_ids=["stay0"])


def test_an_idle_session_is_hibernated_and_reaped_once_across_managers(ms: Managers) -> None:
    with ms.client(0) as c:
        _create(c, "reap0", ttl_seconds=10)
        assert _run(c, "reap0", "w = 1")["status"] == "ok"
        wait_for(lambda: c.get("/v1/sessions/reap0").status_code == 404, "reap0 to be hibernated and deleted",
                 timeout=90)
    time.sleep(LEASE)  # every manager had its reaper rounds since
    assert len(_audits(ms, "session_hibernated", session_id="reap0")) == 1
    assert len(_audits(ms, "session_closed", session_id="reap0", reason="expired")) == 1
    # The store-wide pass (hibernated sessions past their time) ran on the reaper lease's holder.
    holder = _sql(ms, "SELECT m.url FROM leases l JOIN managers m USING (manager_id) WHERE l.session_id = ':reaper'")
    closed_by = [i for i in range(len(ms)) if _audits(ms, "session_closed", i, session_id="reap0")]
    assert holder and [ms[i].url for i in closed_by] == [holder[0][0]]
