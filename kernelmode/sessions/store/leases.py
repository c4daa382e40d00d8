"""Leases: which manager owns a session, for how long (the ground of several managers on one
PostgreSQL store, docs/high-availability.md); ownership.py takes, renews and gives them up.

Each operation is one statement, atomic on its own: taking a lease is an upsert that replaces the
row only when it has expired or is already the taker's, so of two managers asking at once exactly
one gets it. PostgreSQL reads the time of the database server (``now()``): the managers' clocks
need not agree. SQLite, one host's file, reads the host's clock.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

Rows = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]


class Fence(Protocol):
    """The manager a shared store writes sessions' records and runs for (ownership.py): a write
    of a session whose lease it no longer holds is refused, and ``lost`` told."""

    manager_id: str

    def lost(self, session_id: str) -> None:
        """A write found the session's lease gone: stop acting for the session."""


def new_manager_id() -> str:
    """An id for this manager process, unique across hosts and restarts: host, pid, random."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Leases(ABC):
    """A lease per session: (session_id, manager_id, expiry)."""

    def __init__(self, rows: Rows) -> None:
        self._rows = rows  # the store's: one statement, its rows (``?`` placeholders)

    @abstractmethod
    def acquire(self, session_id: str, manager_id: str, ttl: float) -> bool:
        """Take the session's lease for ``ttl`` seconds: True if it was free, expired or already
        ``manager_id``'s (then it is extended); False if another manager holds it."""

    @abstractmethod
    def renew(self, session_id: str, manager_id: str, ttl: float) -> bool:
        """Extend a lease ``manager_id`` holds and that has not expired; False if it is lost
        (expired, or taken since): the manager must stop acting for the session."""

    @abstractmethod
    def expired(self) -> list[str]:
        """The sessions whose lease has expired (their manager stopped renewing), sorted."""

    @abstractmethod
    def owner(self, session_id: str) -> str | None:
        """The manager holding an unexpired lease on the session, or None."""

    @abstractmethod
    def renew_all(self, manager_id: str, session_ids: list[str], ttl: float) -> set[str]:
        """``renew`` of each of ``session_ids`` in one statement: the ids renewed (the others
        are lost)."""

    @abstractmethod
    def held_elsewhere(self, manager_id: str) -> set[str]:
        """The sessions another manager holds an unexpired lease on."""

    @abstractmethod
    def owner_url(self, session_id: str, manager_id: str) -> str | None:
        """The URL of the live manager other than ``manager_id`` that holds an unexpired lease
        on the session, or None."""

    @abstractmethod
    def expire_all(self, manager_id: str) -> None:
        """Every lease of ``manager_id`` expires now (it stops: the others adopt at once)."""

    # -- rebalancing (sessions/rebalance.py): a shared store's; one manager has nobody to hand to --
    def hand_over(self, session_id: str, manager_id: str, receiver: str, ttl: float) -> bool:
        """Give ``manager_id``'s unexpired lease to ``receiver`` for ``ttl`` seconds, marked
        handed (``handed``), in one statement: True if it was ``manager_id``'s to give and the
        receiver is alive and not draining (one that began its drain since ``counts`` was read
        would adopt nothing)."""
        return False

    def expire(self, session_id: str, manager_id: str) -> bool:
        """``manager_id``'s lease on the session expires now (a handover refused by the store:
        any manager's next scan adopts it, not a lease later): True if it was its."""
        return False

    def handed(self, manager_id: str) -> list[str]:
        """The sessions handed to ``manager_id`` that it has not adopted yet, sorted."""
        return []

    def counts(self) -> dict[str, int]:
        """Each live manager's id -> the sessions it holds unexpired leases on (handed ones
        included; singletons such as ``:reaper`` not). A draining manager is left out: it is no
        receiver, and its sessions are about to be adopted by the others."""
        return {}

    def release(self, session_id: str, manager_id: str) -> bool:
        """Give the lease up (only ``manager_id``'s own): True if it held it."""
        return bool(self._rows("DELETE FROM leases WHERE session_id=? AND manager_id=? RETURNING session_id",
                               (session_id, manager_id)))


class SqliteLeases(Leases):
    """Expiry as seconds since the epoch by this host's clock."""

    def acquire(self, session_id: str, manager_id: str, ttl: float) -> bool:
        now = time.time()
        return bool(self._rows(
            "INSERT INTO leases (session_id, manager_id, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET manager_id=excluded.manager_id, expires_at=excluded.expires_at "
            "WHERE leases.expires_at <= ? OR leases.manager_id = excluded.manager_id RETURNING session_id",
            (session_id, manager_id, now + ttl, now)))

    def renew(self, session_id: str, manager_id: str, ttl: float) -> bool:
        now = time.time()
        return bool(self._rows(
            "UPDATE leases SET expires_at=? WHERE session_id=? AND manager_id=? AND expires_at > ? "
            "RETURNING session_id", (now + ttl, session_id, manager_id, now)))

    def expired(self) -> list[str]:
        return [r[0] for r in self._rows(
            "SELECT session_id FROM leases WHERE expires_at <= ? ORDER BY session_id", (time.time(),))]

    def owner(self, session_id: str) -> str | None:
        rows = self._rows("SELECT manager_id FROM leases WHERE session_id=? AND expires_at > ?",
                          (session_id, time.time()))
        return rows[0][0] if rows else None


    def renew_all(self, manager_id: str, session_ids: list[str], ttl: float) -> set[str]:
        now = time.time()
        return {r[0] for r in self._rows(
            "UPDATE leases SET expires_at=? WHERE manager_id=? AND expires_at > ? "
            "AND session_id IN (SELECT value FROM json_each(?)) RETURNING session_id",
            (now + ttl, manager_id, now, json.dumps(session_ids)))}

    def expire_all(self, manager_id: str) -> None:
        self._rows("UPDATE leases SET expires_at=? WHERE manager_id=? RETURNING session_id",
                   (time.time(), manager_id))

    def held_elsewhere(self, manager_id: str) -> set[str]:
        return {r[0] for r in self._rows("SELECT session_id FROM leases WHERE manager_id<>? AND expires_at > ?",
                                         (manager_id, time.time()))}

    def owner_url(self, session_id: str, manager_id: str) -> str | None:
        now = time.time()
        rows = self._rows("SELECT m.url FROM leases l JOIN managers m ON m.manager_id = l.manager_id "
                          "WHERE l.session_id=? AND l.manager_id<>? AND l.expires_at > ? AND m.expires_at > ?",
                          (session_id, manager_id, now, now))
        return rows[0][0] if rows else None


class PostgresLeases(Leases):
    """Expiry as a timestamptz by the database server's clock."""

    def acquire(self, session_id: str, manager_id: str, ttl: float) -> bool:
        return bool(self._rows(
            "INSERT INTO leases (session_id, manager_id, expires_at) "
            "VALUES (?, ?, now() + make_interval(secs => ?)) "
            "ON CONFLICT (session_id) DO UPDATE SET manager_id=excluded.manager_id, expires_at=excluded.expires_at, "
            "handed_from=NULL "
            "WHERE leases.expires_at <= now() OR leases.manager_id = excluded.manager_id RETURNING session_id",
            (session_id, manager_id, float(ttl))))

    def hand_over(self, session_id: str, manager_id: str, receiver: str, ttl: float) -> bool:
        return bool(self._rows(
            "UPDATE leases SET manager_id=?, handed_from=?, expires_at = now() + make_interval(secs => ?) "
            "WHERE session_id=? AND manager_id=? AND expires_at > now() AND EXISTS (SELECT 1 FROM managers "
            "WHERE manager_id=? AND expires_at > now() AND NOT draining) RETURNING session_id",
            (receiver, manager_id, float(ttl), session_id, manager_id, receiver)))

    def expire(self, session_id: str, manager_id: str) -> bool:
        return bool(self._rows("UPDATE leases SET expires_at=now() WHERE session_id=? AND manager_id=? "
                               "AND expires_at > now() RETURNING session_id", (session_id, manager_id)))

    def handed(self, manager_id: str) -> list[str]:
        return [r[0] for r in self._rows(
            "SELECT session_id FROM leases WHERE manager_id=? AND handed_from IS NOT NULL AND expires_at > now() "
            "ORDER BY session_id", (manager_id,))]

    def counts(self) -> dict[str, int]:
        return {mid: int(n) for mid, n in self._rows(
            "SELECT m.manager_id, COUNT(l.session_id) FROM managers m LEFT JOIN leases l "
            "ON l.manager_id = m.manager_id AND l.expires_at > now() AND l.session_id NOT LIKE ':%' "
            "WHERE m.expires_at > now() AND NOT m.draining GROUP BY m.manager_id", ())}

    def renew(self, session_id: str, manager_id: str, ttl: float) -> bool:
        return bool(self._rows(
            "UPDATE leases SET expires_at = now() + make_interval(secs => ?) "
            "WHERE session_id=? AND manager_id=? AND expires_at > now() RETURNING session_id",
            (float(ttl), session_id, manager_id)))

    def expired(self) -> list[str]:
        return [r[0] for r in self._rows(
            "SELECT session_id FROM leases WHERE expires_at <= now() ORDER BY session_id", ())]

    def owner(self, session_id: str) -> str | None:
        rows = self._rows("SELECT manager_id FROM leases WHERE session_id=? AND expires_at > now()",
                          (session_id,))
        return rows[0][0] if rows else None

    def renew_all(self, manager_id: str, session_ids: list[str], ttl: float) -> set[str]:
        return {r[0] for r in self._rows(
            "UPDATE leases SET expires_at = now() + make_interval(secs => ?) "
            "WHERE manager_id=? AND expires_at > now() AND session_id = ANY(?) RETURNING session_id",
            (float(ttl), manager_id, session_ids))}

    def expire_all(self, manager_id: str) -> None:
        self._rows("UPDATE leases SET expires_at=now() WHERE manager_id=? RETURNING session_id", (manager_id,))

    def held_elsewhere(self, manager_id: str) -> set[str]:
        return {r[0] for r in self._rows(
            "SELECT session_id FROM leases WHERE manager_id<>? AND expires_at > now()", (manager_id,))}

    def owner_url(self, session_id: str, manager_id: str) -> str | None:
        rows = self._rows("SELECT m.url FROM leases l JOIN managers m ON m.manager_id = l.manager_id "
                          "WHERE l.session_id=? AND l.manager_id<>? AND l.expires_at > now() "
                          "AND m.expires_at > now()", (session_id, manager_id))
        return rows[0][0] if rows else None
