"""Rebalancing between managers (sessions/rebalance.py; docs/high-availability.md
"Rebalancing"), with real parts: the suite's PostgreSQL, one external Kernel Gateway, real
`kernelmode serve` processes. Six sessions on manager A; manager B joins; A hands idle sessions
to B a few per round until each holds three. Meanwhile runs go on through the Python client,
alternating between the managers: each completes exactly once (a request that meets a session
in its handover is refused 503 ``session_owned_elsewhere`` before anything ran, and the client
sends it again), none is interrupted, and every session keeps its variables."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import psycopg
import pytest

from kernelmode.client import Client
from tests.integration.test_managers import _audits
from tests.support.managers import Managers, start_managers
from tests.support.postgres import PgCluster
from tests.support.server import wait_for

LEASE = 3  # a rebalancing round every second
ENV = {
    "KERNELMODE_STORE__LEASE_SECONDS": str(LEASE),
    "KERNELMODE_SESSIONS__POOL_SIZE": "0",  # no warm kernels: less CPU, and nothing else to count
    "KERNELMODE_SERVER__DRAIN_SECONDS": "120",  # a stop waits for its runs (the draining test)
}
SESSIONS = [f"bal{i}" for i in range(6)]


@pytest.fixture(scope="module")
def ms(pg_cluster: PgCluster) -> Iterator[Managers]:
    with start_managers(2, pg_cluster.create_database("rebalance"), ENV, started=1) as managers:
        yield managers


def _sql(ms: Managers, query: str, args: tuple = ()) -> list[tuple]:
    with psycopg.connect(ms.env["KERNELMODE_STORE__URL"], autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def _owned(ms: Managers) -> dict[str, int]:
    """Each live manager's URL -> the sessions of this test it holds, adopted (not handed only)."""
    rows = _sql(ms, "SELECT m.url, COUNT(*) FROM leases l JOIN managers m USING (manager_id) WHERE "
                "l.expires_at > now() AND m.expires_at > now() AND l.handed_from IS NULL AND "
                "l.session_id = ANY(%s) GROUP BY m.url", (SESSIONS,))
    return {url: int(n) for url, n in rows}


def test_a_manager_that_joins_gets_half_the_sessions_with_their_variables_and_no_run_is_lost(
        ms: Managers) -> None:
    a = Client(ms[0].url, ms.token, timeout=120, retries=30)
    sent = dict.fromkeys(SESSIONS, 0)
    for i, sid in enumerate(SESSIONS):
        a.create_session(sid)
        assert a.execute(sid, f"v = {i}\nn = 0").status == "ok"
    assert _owned(ms) == {ms[0].url: 6}

    ms.add()  # B joins: it owns nothing, and gets sessions without any being created through it
    b = Client(ms[1].url, ms.token, timeout=120, retries=30)
    clients = [a, b]
    deadline, rounds, even_since = time.monotonic() + 180, 0, None
    while True:  # runs all along, through either manager, until the load is even for a while
        for sid in SESSIONS:
            sent[sid] += 1
            r = clients[rounds % 2].execute(sid, "n += 1\nn")
            assert r.status == "ok" and r.result == str(sent[sid]), (sid, r)  # each run once, in order
        rounds += 1
        if _owned(ms) == {ms[0].url: 3, ms[1].url: 3}:
            even_since = even_since or rounds
            if rounds - even_since >= 3:  # stays even: nothing handed back and forth
                break
        else:
            even_since = None
        assert time.monotonic() < deadline, f"not even after {rounds} rounds: {_owned(ms)}"

    for c in clients:  # every session answers through either manager, its variables kept
        for i, sid in enumerate(SESSIONS):
            r = c.execute(sid, "(v, n)")
            assert r.status == "ok" and r.result == str((i, sent[sid])), (sid, r)
    statuses = [json.loads(row[0])["status"] for row in
                _sql(ms, "SELECT result FROM runs WHERE session_id = ANY(%s)", (SESSIONS,))]
    assert statuses.count("ok") == len(statuses) == 6 + sum(sent.values()) + 12, statuses
    handed = [sid for e in _audits(ms, "session_handed_over", 0) for sid in [e["session_id"]]]
    received = [sid for e in _audits(ms, "sessions_received", 1) for sid in e["session_ids"]]
    assert len(handed) >= 3 and sorted(set(handed)) == sorted(set(received)), (handed, received)
    assert not _audits(ms, "sessions_taken_over")  # nobody died: nothing was taken over
    a.close()
    b.close()


def test_a_draining_manager_is_handed_no_sessions(ms: Managers) -> None:
    """B is stopping (SIGTERM) and drains a run in flight: from its drain's start it is marked in
    the store, and A, far above the fair share meanwhile, hands it nothing (it would adopt
    nothing, and the handed leases would wait out a lease). Its sessions go to A when it stops."""
    if len(ms) < 2:
        ms.add()
    a = Client(ms[0].url, ms.token, timeout=120, retries=30)
    b = Client(ms[1].url, ms.token, timeout=120, retries=30)
    handed_before = len(_audits(ms, "session_handed_over", 0))
    b.create_session("drainb")
    # The drain's length: the run in flight it waits for (A's rounds, one a second, meanwhile).
    assert b.execute("drainb", "import time; time.sleep(12); 'slept'", wait_seconds=0).status == "running"
    ms[1].proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _sql(ms, "SELECT draining FROM managers WHERE url=%s", (ms[1].url,)) == [(True,)],
             "B's draining mark in the store")
    # A now holds far more than B (every session idle): B would be the receiver if not draining.
    for sid in ("drain0", "drain1", "drain2", "drain3"):
        a.create_session(sid)
    assert ms[1].proc.wait(120) == 0  # drained (the run ended and was recorded) and stopped
    assert len(_audits(ms, "session_handed_over", 0)) == handed_before, _audits(ms, "session_handed_over", 0)
    ran = [json.loads(r[0]) for r in _sql(ms, "SELECT result FROM runs WHERE session_id='drainb'")]
    assert [(r["status"], r["result"]) for r in ran] == [("ok", "'slept'")], ran
    assert a.execute("drainb", "1 + 1").result == "2"  # B's sessions are A's now
    a.close()
    b.close()
