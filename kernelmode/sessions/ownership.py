"""Ownership: which manager acts for which session when several share one PostgreSQL store
(docs/high-availability.md).

A session is owned by the manager holding its lease (store/leases.py); a manager's own row in
``managers`` says where the others reach it (``url``) and that it is alive. One heartbeat task
renews both every third of ``store.lease_seconds``. On a SQLite store (one manager) nothing is
taken or renewed: ``active`` is False and every session is this manager's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..config import Settings
from .store import SessionStore, new_manager_id

log = logging.getLogger("kernelmode.sessions")


class Ownership:
    """This manager's name (``manager_id``), address (``url``) and leases."""

    def __init__(self, store: SessionStore, settings: Settings, manager_id: str | None = None,
                 url: str = "", home: str = "") -> None:
        self.store = store
        self.manager_id = manager_id or new_manager_id()
        self.url = url  # this manager's advertised base URL (server.advertise_url, or host:port)
        self.home = home or self.manager_id  # host and data dir (managers.py: predecessors)
        self.ttl = settings.store.lease_seconds
        self.active = store.shared
        self._heartbeat: asyncio.Task[None] | None = None

    def owner_url(self, session_id: str) -> str | None:
        """The base URL of another live manager that holds an unexpired lease on the session;
        None when the session is this manager's, or nobody's."""
        if not self.active:
            return None
        return self.store.leases.owner_url(session_id, self.manager_id)

    def beat(self) -> None:
        """This manager is alive for one more lease period (its row in ``managers``)."""
        if self.active:
            self.store.managers.beat(self.manager_id, self.url, self.home, self.ttl)

    def leave(self) -> None:
        """This manager stops: its row goes, the others stop forwarding to it."""
        if self.active:
            self.store.managers.leave(self.manager_id)

    def start(self) -> None:
        """The first beat now (before this manager starts anything), then the heartbeat."""
        if self.active:
            self.beat()
            self._heartbeat = asyncio.create_task(self._beating(), name="ownership-heartbeat")

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        with contextlib.suppress(Exception):  # a store that does not answer: the row expires
            self.leave()

    async def _beating(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                self.beat()
            except Exception:
                log.exception("heartbeat failed (the leases expire unless a later one succeeds)")
