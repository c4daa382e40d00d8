"""Several managers on one PostgreSQL store and one external Kernel Gateway (real parts: the
suite's PostgreSQL, a real gateway, real `serve` processes, bubblewrap): ownership by leases,
start-up beside live managers, failover after a `kill -9` (docs/high-availability.md)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from tests.support.managers import Managers, start_managers
from tests.support.postgres import PgCluster


@pytest.fixture(scope="module")
def two(pg_cluster: PgCluster) -> Iterator[Managers]:
    with start_managers(2, pg_cluster.create_database("managers"), {"KERNELMODE_STORE__LEASE_SECONDS": "3"}) as ms:
        yield ms


def _sql(ms: Managers, query: str, args: tuple = ()) -> list[tuple]:
    with psycopg.connect(ms.env["KERNELMODE_STORE__URL"], autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def test_each_manager_is_in_the_store_with_its_url(two: Managers) -> None:
    rows = dict(_sql(two, "SELECT url, manager_id FROM managers WHERE expires_at > now()"))
    assert set(rows) == {two[0].url, two[1].url}
