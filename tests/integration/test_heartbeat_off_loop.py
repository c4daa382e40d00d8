"""The heartbeat's statements run off the event loop, on a connection of their own
(sessions/ownership.py): a real manager on the suite's PostgreSQL whose `managers` row another
connection holds locked has its heartbeat statement waiting in PostgreSQL (seen in
pg_stat_activity), and meanwhile it answers `/healthz` and a request that reads the store. The
answers are checked to have come while the heartbeat still waited: no timing is measured."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psycopg

from tests.support.managers import start_managers
from tests.support.postgres import PgCluster
from tests.support.server import wait_for

WAITING = ("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
           "AND query LIKE '%INSERT INTO managers%'")  # the heartbeat's beat


def test_a_heartbeat_blocked_in_postgresql_leaves_the_manager_answering(pg_cluster: PgCluster) -> None:
    url = pg_cluster.create_database("offloop")
    env = {"KERNELMODE_STORE__LEASE_SECONDS": "6", "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    with start_managers(1, url, env) as ms, psycopg.connect(url, autocommit=True) as look:
        row = look.execute("SELECT manager_id FROM managers WHERE url = %s", (ms[0].url,)).fetchone()
        assert row is not None
        with psycopg.connect(url) as holder:  # a transaction: the row stays locked until rollback
            holder.execute("SELECT 1 FROM managers WHERE manager_id = %s FOR UPDATE", (row[0],))
            blocked = wait_for(lambda: look.execute(WAITING).fetchall(), "the heartbeat to wait for the row lock")
            with ThreadPoolExecutor(2) as pool, ms.client(0) as c:
                health = pool.submit(c.get, "/healthz")
                listing = pool.submit(c.get, "/v1/sessions")  # the store, on the requests' connection
                assert health.result().status_code == 200
                assert listing.result().status_code == 200, listing.result().text
            # Both answered while the heartbeat still waited (before the change, the loop waited
            # with it: nothing answered until its statement gave up).
            assert look.execute(WAITING).fetchall() == blocked
            holder.rollback()
        wait_for(lambda: not look.execute(WAITING).fetchall(), "the heartbeat to go on")
        with ms.client(0) as c:
            wait_for(lambda: c.get("/readyz").status_code == 200, "the manager to stay ready")
