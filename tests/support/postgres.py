"""A real PostgreSQL server for the tests (Debian's postgresql, installed by `make setup`): one
throwaway cluster per pytest session, started on first use (initdb into a temp dir, as the
`postgres` user when the tests run as root), listening on a unix socket only, stopped at the end.
Each test module gets a database of its own (``pg_url``); ``store_on`` gives a test an empty
store of either backend.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmode.sessions.store import SessionStore, SqliteStore

BACKENDS = ("sqlite", "postgresql")


def _bin(name: str) -> str:
    """A PostgreSQL server program: Debian keeps them out of PATH, in /usr/lib/postgresql/N/bin."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                   key=lambda p: int(re.sub(r"\D", "", p.split("/")[4]) or 0))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: `make setup` installs it "
                    "(scripts/install-system-deps.sh --test)")
    return path


class PgCluster:
    """initdb + pg_ctl on a temp dir; ``url(db)`` reaches a database over the unix socket."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kmpg-", dir="/tmp"))
        self.data, self.socket_dir = self.root / "data", self.root / "sock"
        self.socket_dir.mkdir()
        # initdb refuses root: the cluster is the postgres user's (root reaches its socket still).
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for p in (self.root, self.socket_dir):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        self.user = pwd.getpwuid(self._as.get("user", os.geteuid())).pw_name
        self._pg([_bin("initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust", "--no-locale",
                  "-E", "UTF8", "--no-sync"])
        # No TCP; no durability (a test cluster): fsync off makes CREATE DATABASE cheap.
        options = (f"-c listen_addresses='' -k {self.socket_dir} -p 5432 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._pg([_bin("pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                  "-l", str(self.root / "log"), "-o", options])
        self._n = 0

    def _pg(self, argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=self.root, **self._as)
        if proc.returncode != 0:
            log = (self.root / "log").read_text() if (self.root / "log").exists() else ""
            raise RuntimeError(f"{argv[0]} failed: {proc.stderr}{log}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{dbname}?host={self.socket_dir}"

    def create_database(self, prefix: str = "km") -> str:
        """A new empty database: its URL."""
        import psycopg

        self._n += 1
        name = re.sub(r"[^a-z0-9_]", "_", f"{prefix}_{self._n}".lower())[:60]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg([_bin("pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-w"])
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    cluster = PgCluster()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def pg_url(pg_cluster: PgCluster, request: pytest.FixtureRequest) -> str:
    """A database of this test module's own (migrated by the first store that opens it)."""
    return pg_cluster.create_database(request.module.__name__.rsplit(".", 1)[-1])


def empty(store: SessionStore) -> None:
    """Every row of a PostgreSQL store gone (the schema stays): the next test's store is new."""
    store._run("TRUNCATE sessions, runs, owners, session_files, checkpoints, leases, managers, pool_kernels, mcp_sessions, egress_tokens")


def store_on(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionStore]:
    """An empty store of ``backend``; closed (and emptied) after the test."""
    if backend == "sqlite":
        store: SessionStore = SqliteStore(tmp_path / "sessions.sqlite3")
    else:
        from kernelmode.sessions.store.postgres import PostgresStore

        store = PostgresStore(request.getfixturevalue("pg_url"))
        empty(store)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=BACKENDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionStore]:
    """The test runs once on each backend."""
    yield from store_on(request.param, request, tmp_path)
