"""The session store: SQLite in the data dir (the default) or PostgreSQL (``store.url``), one
interface (base.SessionStore). ``open_store`` picks the backend; the PostgreSQL driver is imported
only when it is used."""

from __future__ import annotations

from pathlib import Path

from .base import SessionStore, micros, storable
from .leases import Leases, new_manager_id
from .sqlite import SqliteStore

__all__ = ["Leases", "SessionStore", "SqliteStore", "micros", "new_manager_id", "open_store", "storable"]


def open_store(url: str | None, data_dir: Path) -> SessionStore:
    """The store of ``url`` (``postgresql://...``), or with none the SQLite file of ``data_dir``."""
    if url is None:
        return SqliteStore(data_dir / "sessions.sqlite3")
    from .postgres import PostgresStore

    return PostgresStore(url)
