"""The PostgreSQL store's own: migrations (sessions/store/migrations.py), managers starting
together on a fresh database migrate it once, without an error; a database from a newer
kernelmode is refused; a server that cannot be reached is said in words naming store.url, without
the password; a connection cut under the store costs one call (503), not the manager."""

from __future__ import annotations

import multiprocessing
import threading

import psycopg
import pytest

from kernelmode.errors import ConfigError, SessionStoreUnavailable
from kernelmode.sessions.store.migrations import MIGRATIONS
from kernelmode.sessions.store.postgres import PostgresStore, probe
from tests.support.postgres import PgCluster

MANAGERS = 4


def _open_at_once(url: str, start: threading.Barrier) -> None:
    start.wait(timeout=60)
    PostgresStore(url).close()


def test_managers_starting_together_migrate_a_fresh_database_once(pg_cluster: PgCluster) -> None:
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):  # each round a fresh database, every manager opening it at once
        url = pg_cluster.create_database(f"migrate_race_{round_}")
        start = ctx.Barrier(MANAGERS)
        procs = [ctx.Process(target=_open_at_once, args=(url, start)) for _ in range(MANAGERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0] * MANAGERS  # a failed open exits 1 (traceback)
        with psycopg.connect(url) as conn:
            assert [r[0] for r in conn.execute("SELECT version FROM kernelmode_schema ORDER BY version")] \
                == list(range(1, len(MIGRATIONS) + 1))
            tables = {r[0] for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}
        assert tables == {"kernelmode_schema", "sessions", "runs", "owners", "session_files", "checkpoints",
                          "leases", "egress_tokens", "managers", "pool_kernels", "mcp_sessions"}


def test_a_database_of_a_newer_kernelmode_is_refused(pg_cluster: PgCluster) -> None:
    url = pg_cluster.create_database("newer")
    PostgresStore(url).close()
    assert probe(url).endswith(f"schema version {len(MIGRATIONS)} (current)")  # what doctor says
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO kernelmode_schema (version) VALUES (%s)", (len(MIGRATIONS) + 1,))
    with pytest.raises(ConfigError, match="newer than this kernelmode's"):
        PostgresStore(url)
    with pytest.raises(ConfigError, match="newer than this kernelmode's"):
        probe(url)


def test_an_unreachable_server_is_named_without_its_password(pg_cluster: PgCluster) -> None:
    url = f"postgresql://km:s3cret-pw@/nodb?host={pg_cluster.root}/nowhere&connect_timeout=2"
    with pytest.raises(ConfigError, match="store.url: cannot connect to PostgreSQL at km@") as e:
        PostgresStore(url)
    assert "s3cret-pw" not in str(e.value)


def test_a_cut_connection_fails_one_call_and_the_next_connects_again(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    try:
        store.take_id("s", "acme")
        with psycopg.connect(pg_url, autocommit=True) as admin:  # as a server restart would
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with pytest.raises(SessionStoreUnavailable, match="did not answer.*retry") as e:
            store.owner("s")
        assert e.value.http_status == 503
        assert store.owner("s") == "acme"
    finally:
        store.close()
