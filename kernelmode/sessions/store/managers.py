"""Managers: which `kernelmode serve` processes share the store, where each is reached, and the
warm-pool kernels each holds on the shared gateway (ownership.py reads and writes them).

A manager's row is renewed by its heartbeat with its leases; a row past ``expires_at`` is a
dead manager's. Time is the database server's (``now()``) on PostgreSQL, this host's on SQLite.
``home`` is the host and data dir: a manager that starts on the data dir of one that died (it
holds the data dir's lock, so the other is gone) knows those sessions are free at once.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod

from .leases import Rows


class Managers(ABC):
    """Rows (manager_id, url, home, expires_at, draining), and pool kernels (kernel_id, manager_id)."""

    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    @abstractmethod
    def beat(self, manager_id: str, url: str, home: str, ttl: float) -> bool:
        """This manager is alive for ``ttl`` seconds more, reached at ``url``. Whether it was alive
        until now (its row there and unexpired, read in the same statement): False at its first
        beat, and after a freeze past its expiry, when another manager may have taken its pool
        kernels' marks (``orphaned_pool``) and shut those kernels down."""

    @abstractmethod
    def live(self) -> dict[str, str]:
        """The managers alive now: id -> url."""

    @abstractmethod
    def predecessors(self, manager_id: str, home: str) -> list[str]:
        """Forget the other managers of ``home`` (dead: the caller holds its data dir's lock)
        and expire their leases now: their ids."""

    @abstractmethod
    def orphaned_pool(self) -> list[str]:
        """Take the pool kernels of managers no longer alive: exactly one caller gets each
        (the rows are deleted as they are returned)."""

    def drain(self, manager_id: str) -> None:
        """``manager_id`` is draining (stopping): no longer chosen to receive sessions
        (leases.py ``counts`` and ``hand_over`` pass it by). Its row keeps the mark until it
        leaves; a beat does not clear it."""
        self._rows("UPDATE managers SET draining = TRUE WHERE manager_id=? RETURNING manager_id", (manager_id,))

    def leave(self, manager_id: str) -> None:
        """A manager stops: its row and pool rows go (its leases are released by the caller)."""
        self._rows("DELETE FROM managers WHERE manager_id=? RETURNING manager_id", (manager_id,))
        self._rows("DELETE FROM pool_kernels WHERE manager_id=? RETURNING kernel_id", (manager_id,))

    def add_pool(self, kernel_id: str, manager_id: str) -> None:
        """A pool kernel of ``manager_id`` (written before it starts: nothing can find it unowned)."""
        self._rows("INSERT INTO pool_kernels (kernel_id, manager_id) VALUES (?, ?) "
                   "ON CONFLICT(kernel_id) DO NOTHING RETURNING kernel_id", (kernel_id, manager_id))

    def drop_pool(self, kernel_id: str) -> None:
        """The kernel left the pool (claimed by a session, or shut down)."""
        self._rows("DELETE FROM pool_kernels WHERE kernel_id=? RETURNING kernel_id", (kernel_id,))

    def pool_kernels(self) -> set[str]:
        """Every manager's pool kernels (a starting manager leaves the live ones alone)."""
        return {r[0] for r in self._rows("SELECT kernel_id FROM pool_kernels", ())}


class SqliteManagers(Managers):
    def drain(self, manager_id: str) -> None:
        """One manager on SQLite: nobody rebalances, so no mark (and no column) is needed."""

    def beat(self, manager_id: str, url: str, home: str, ttl: float) -> bool:
        alive = bool(self._rows("SELECT 1 FROM managers WHERE manager_id=? AND expires_at > ?",
                                (manager_id, time.time())))  # one manager: nobody writes between
        self._rows("INSERT INTO managers (manager_id, url, home, expires_at) VALUES (?, ?, ?, ?) "
                   "ON CONFLICT(manager_id) DO UPDATE SET url=excluded.url, expires_at=excluded.expires_at "
                   "RETURNING manager_id", (manager_id, url, home, time.time() + ttl))
        return alive

    def live(self) -> dict[str, str]:
        return dict(self._rows("SELECT manager_id, url FROM managers WHERE expires_at > ?", (time.time(),)))

    def predecessors(self, manager_id: str, home: str) -> list[str]:
        gone = [r[0] for r in self._rows("DELETE FROM managers WHERE home=? AND manager_id<>? "
                                         "RETURNING manager_id", (home, manager_id))]
        self._rows("UPDATE leases SET expires_at=? WHERE manager_id IN (SELECT value FROM json_each(?)) "
                   "RETURNING session_id", (time.time(), json.dumps(gone)))
        return sorted(gone)

    def orphaned_pool(self) -> list[str]:
        return sorted(r[0] for r in self._rows(
            "DELETE FROM pool_kernels WHERE manager_id NOT IN (SELECT manager_id FROM managers "
            "WHERE expires_at > ?) RETURNING kernel_id", (time.time(),)))


class PostgresManagers(Managers):
    def beat(self, manager_id: str, url: str, home: str, ttl: float) -> bool:
        # The CTE reads the row as it was before this statement's upsert.
        rows = self._rows("WITH before AS (SELECT expires_at > now() AS alive FROM managers WHERE manager_id=?) "
                          "INSERT INTO managers (manager_id, url, home, expires_at) "
                          "VALUES (?, ?, ?, now() + make_interval(secs => ?)) "
                          "ON CONFLICT(manager_id) DO UPDATE SET url=excluded.url, expires_at=excluded.expires_at "
                          "RETURNING COALESCE((SELECT alive FROM before), FALSE)",
                          (manager_id, manager_id, url, home, float(ttl)))
        return bool(rows and rows[0][0])

    def live(self) -> dict[str, str]:
        return dict(self._rows("SELECT manager_id, url FROM managers WHERE expires_at > now()", ()))

    def predecessors(self, manager_id: str, home: str) -> list[str]:
        gone = [r[0] for r in self._rows("DELETE FROM managers WHERE home=? AND manager_id<>? "
                                         "RETURNING manager_id", (home, manager_id))]
        self._rows("UPDATE leases SET expires_at=now() WHERE manager_id = ANY(?) RETURNING session_id", (gone,))
        return sorted(gone)

    def orphaned_pool(self) -> list[str]:
        return sorted(r[0] for r in self._rows(
            "DELETE FROM pool_kernels WHERE manager_id NOT IN (SELECT manager_id FROM managers "
            "WHERE expires_at > now()) RETURNING kernel_id", ()))
