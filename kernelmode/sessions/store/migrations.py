"""The PostgreSQL schema, as numbered migrations run once each.

A database records the migrations it has had in ``kernelmode_schema``. A manager that opens it
takes a session-level advisory lock first, so of several managers starting together one migrates
and the others wait, then find nothing left to do (``CREATE TABLE IF NOT EXISTS`` alone is not
safe under concurrency in PostgreSQL: two creators can both fail on the catalog's unique index).
Each migration and its version row commit together. Add a migration at the end; never edit one
that has shipped.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .egress_tokens import SCHEMA as EGRESS_TOKENS

# pg_advisory_lock's key: a constant every kernelmode shares ("kernelmd" in ASCII, fit to an int8).
LOCK_KEY = int.from_bytes(b"kernelmd", "big") >> 1

MIGRATIONS: tuple[str, ...] = (
    # 1: sessions, runs, owners, session files, checkpoints and leases.
    """
    CREATE TABLE sessions (
        -- Byte order, as SQLite's and Python's: pages and their cursors sort ids the same
        -- whatever the database's default collation.
        session_id TEXT COLLATE "C" PRIMARY KEY,
        kernel_id TEXT,
        workspace TEXT,
        info TEXT NOT NULL,              -- the SessionInfo record (JSON, validated by pydantic)
        tenant TEXT,                     -- copies of the record's fields that listings select and
        created_us BIGINT NOT NULL,      -- order by, written with it by every writer (store)
        status TEXT NOT NULL,
        expires_us BIGINT                -- when a hibernated record expires (microseconds)
    );
    CREATE INDEX sessions_by_created ON sessions (created_us, session_id);
    CREATE INDEX sessions_by_tenant ON sessions (tenant, created_us, session_id);
    CREATE INDEX sessions_by_status ON sessions (status, tenant);
    CREATE INDEX sessions_by_kernel ON sessions (kernel_id);
    CREATE INDEX sessions_hibernated_by_expiry ON sessions (expires_us) WHERE status = 'hibernated';
    CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        code TEXT NOT NULL,
        result TEXT NOT NULL,
        events TEXT,
        running BOOLEAN NOT NULL
    );
    CREATE INDEX runs_by_session ON runs (session_id, seq);
    CREATE INDEX runs_running ON runs (run_id) WHERE running;
    CREATE TABLE owners (
        session_id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL
    );
    CREATE TABLE session_files (
        session_id TEXT NOT NULL,
        name TEXT NOT NULL,
        artifact TEXT NOT NULL,
        added BIGSERIAL,                 -- the order of the last writes (a rewrite takes a new one)
        PRIMARY KEY (session_id, name)
    );
    CREATE TABLE checkpoints (
        checkpoint_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        info TEXT NOT NULL
    );
    CREATE INDEX checkpoints_by_session ON checkpoints (session_id, created);
    CREATE TABLE leases (
        session_id TEXT COLLATE "C" PRIMARY KEY,  -- expired() sorts as Python does
        manager_id TEXT NOT NULL,
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE INDEX leases_by_expiry ON leases (expires_at);
    """,
    # 2: remote kernels' egress credentials (a hash of each kernel's token).
    EGRESS_TOKENS,
    # 3: the managers sharing the store (ownership.py), and the pool kernels each holds.
    """
    CREATE TABLE managers (
        manager_id TEXT PRIMARY KEY,
        url TEXT NOT NULL,               -- where the other managers reach it (server.advertise_url)
        home TEXT NOT NULL,              -- host and data dir (managers.py: predecessors)
        expires_at TIMESTAMPTZ NOT NULL
    );
    CREATE TABLE pool_kernels (
        kernel_id TEXT PRIMARY KEY,
        manager_id TEXT NOT NULL
    );
    CREATE INDEX leases_by_manager ON leases (manager_id);
    """,
    # 4: which manager holds each MCP connection (api/forwarding.py routes its requests there).
    """
    CREATE TABLE mcp_sessions (
        mcp_session_id TEXT PRIMARY KEY,
        manager_id TEXT NOT NULL
    );
    """,
    # 5: a lease handed to another manager to even the load (sessions/rebalance.py): the giver's
    # id until the receiver has adopted the session (its acquire clears it).
    """
    ALTER TABLE leases ADD COLUMN handed_from TEXT;
    """,
    # 6: a manager that is draining (a stop's first step, sessions/drain.py) is no rebalancing
    # receiver: it would adopt nothing, and the leases handed to it would wait out a lease.
    """
    ALTER TABLE managers ADD COLUMN draining BOOLEAN NOT NULL DEFAULT FALSE;
    """,
)


def migrate(conn: Any) -> int:
    """Bring the database of ``conn`` (a psycopg connection in autocommit) to the newest schema:
    the version it is at after."""
    conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS kernelmode_schema ("
                     "version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM kernelmode_schema").fetchone()
        version = int(row[0])
        if version > len(MIGRATIONS):
            raise ConfigError(f"store.url: the database's schema is version {version}, newer than this "
                              f"kernelmode's ({len(MIGRATIONS)}): upgrade kernelmode, or use another database")
        for number in range(version + 1, len(MIGRATIONS) + 1):
            with conn.transaction():
                conn.execute(MIGRATIONS[number - 1])
                conn.execute("INSERT INTO kernelmode_schema (version) VALUES (%s)", (number,))
        return len(MIGRATIONS)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
