"""Ownership: which manager acts for which session when several share one PostgreSQL store
(docs/high-availability.md).

A session is owned by the manager holding its lease (store/leases.py): the live-session map is
exactly the sessions this manager holds leases on (``LiveSessions`` takes one on each add and
gives it up on each remove). A manager's row in ``managers`` says where the others reach it
(``url``) and that it is alive. One heartbeat task renews the row and every lease in two
statements each third of ``store.lease_seconds``; a session whose lease could not be renewed (it
expired, and another manager took it) is dropped from the map at once, its kernel and record
left to the new owner; so is one whose record or run the store refused to write because the lease
is gone (the fence: this manager is the store's ``fence``, checked in each such statement). Every kernel this manager starts is marked with its id first (so a dead
manager's pool kernels are found and shut down by one survivor, takeover.py). Time is the
database's. On a SQLite store (one manager) nothing is taken or renewed: ``active`` is False.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..audit import audit
from ..config import Settings
from ..errors import SessionOwnedElsewhere
from ..models import SessionInfo
from .kernel_env import Kernels
from .live import LiveSessions
from .store import SessionStore, new_manager_id

log = logging.getLogger("kernelmode.sessions")
T = TypeVar("T")
# How often a manager looks for expired leases: two indexed statements, so often enough that
# failover waits mostly for the lease itself (a dead manager's sessions are adopted within
# store.lease_seconds + this of its death).
SCAN_SECONDS = 1.0


class Ownership:
    """This manager's name (``manager_id``), address (``url``), leases and kernel marks."""

    def __init__(self, store: SessionStore, settings: Settings, manager_id: str | None = None,
                 url: str = "", home: str = "") -> None:
        self.store = store
        self.manager_id = manager_id or new_manager_id()
        self.url = url  # this manager's advertised base URL (server.advertise_url, or host:port)
        self.home = home or self.manager_id  # host and data dir (managers.py: predecessors)
        self.ttl = settings.store.lease_seconds
        self.active = store.shared
        self.live: LiveSessions | None = None  # the manager's map (``attach``)
        self.scan: Callable[[], Awaitable[object]] | None = None  # takeover.py's pass
        self.rebalance: Callable[[], Awaitable[object]] | None = None  # rebalance.py's round
        self.adopting: set[str] = set()  # leases taken for sessions not live yet (renewed too)
        self.side = store  # the heartbeat's and scan's connection (``start``: a second one)
        self._thread: ThreadPoolExecutor | None = None  # ``side``'s one user (``off_loop``)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: set[asyncio.Task[None]] = set()
        # When the last beat that wrote this manager's row began (monotonic; it keeps counting
        # through a SIGSTOP): its row lives until at least then + ttl (``fresh``).
        self._beat_at: float | None = None
        # Called when a beat found this manager's row expired (a freeze past its lease): another
        # manager may have shut its warm kernels down as a dead manager's (the manager drops its pool).
        self.revived: Callable[[], Awaitable[object]] | None = None

    def attach(self, live: LiveSessions, kernels: Kernels) -> None:
        """The manager's map (its adds take leases), kernels (their starts are marked) and the
        store's writes of sessions' records and runs (fenced by the leases: ``lost``)."""
        self.live = live
        if self.active:
            live.leases = kernels.marks = self.store.fence = self

    # -- who owns a session ------------------------------------------------------------------------
    def owner_url(self, session_id: str) -> str | None:
        """The base URL of another live manager that holds an unexpired lease on the session;
        None when the session is this manager's, or nobody's."""
        if not self.active:
            return None
        return self.store.leases.owner_url(session_id, self.manager_id)

    def take(self, session_id: str) -> bool:
        """The session's lease, for this manager (extended if it has it): False if another
        manager holds it. Atomic: of two managers asking at once, one gets it."""
        return not self.active or self.store.leases.acquire(session_id, self.manager_id, self.ttl)

    def claim(self, session_id: str) -> None:
        """``take``, or SessionOwnedElsewhere (503: retry) when another manager holds it."""
        if not self.take(session_id):
            raise SessionOwnedElsewhere(f"session {session_id!r} is owned by another manager right now; "
                                        "retry in a moment")

    def release(self, session_id: str) -> None:
        if self.active:
            self.store.leases.release(session_id, self.manager_id)

    def refusal(self, info: SessionInfo) -> SessionOwnedElsewhere | None:
        """Why a session that should be live somewhere is not live here: another manager owns
        it, or its owner died and it is adopted within a lease period. None on one manager, and
        for a session that is lost (or has no owner, alive or dead: the start made it lost)."""
        if not self.active or info.status in ("lost", "hibernated"):
            return None
        if (url := self.owner_url(info.session_id)) is not None:
            return SessionOwnedElsewhere(f"session {info.session_id!r} is owned by the manager at {url}; "
                                         "send its requests there, or retry in a moment")
        return SessionOwnedElsewhere(
            f"session {info.session_id!r} is being taken over, from a manager that stopped (within "
            f"{self.ttl + SCAN_SECONDS:g} s of its death) or handed over by one to even the load; "
            "retry in a moment")

    # -- the kernels this manager started ----------------------------------------------------------
    def mark(self, kernel_id: str) -> None:
        """Before a kernel is started: it is this manager's (a pool kernel's owner mark)."""
        if self.active:
            self.store.managers.add_pool(kernel_id, self.manager_id)

    def unmark(self, kernel_id: str) -> None:
        if self.active:
            self.store.managers.drop_pool(kernel_id)

    # -- heartbeat ---------------------------------------------------------------------------------
    # The heartbeat's and the takeover scan's statements run in a thread of their own on a
    # connection of their own (``side``, SessionStore.background; ``off_loop``): a slow PostgreSQL
    # (a lock, a network stall) then holds neither the event loop nor the connection requests use
    # (psycopg serializes a shared connection's users: a stalled heartbeat on it would stall them).
    # One thread, so the connection has one user and is closed after its last statement. Not
    # psycopg's AsyncConnection: these are the same sync Leases/Managers statements as the rest of
    # the store's, with no second, async copy of their SQL to keep in step.
    async def off_loop(self, work: Callable[..., T], *args: object) -> T:
        """``work(*args)`` in the heartbeat's thread (at once where there is none: SQLite)."""
        if self._thread is None:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(work, *args))

    async def beat(self) -> list[str]:
        """This manager is alive for one more lease period, and so are its leases: the sessions
        whose lease was lost meanwhile, dropped from the live map (kernel and record untouched)."""
        if not self.active:
            return []
        held = sorted({*(self.live.ids() if self.live is not None else ()), *self.adopting})
        first, at = self._beat_at is None, time.monotonic()
        alive, renewed = await self.off_loop(self._renew, held)
        self._beat_at = at
        if not alive and not first:
            log.warning("this manager's row in the store had expired (it was frozen or cut off from the "
                        "store longer than store.lease_seconds): its warm kernels may have been shut down "
                        "by another manager; the pool is dropped and refilled")
            audit("manager_row_expired", manager_id=self.manager_id)
            if self.revived is not None:
                await self.revived()
        # Still held here after the statement: one given up meanwhile (a delete) is not lost, and
        # one taken again meanwhile (a wake) has a fresh lease, which owner() shows.
        maybe = [sid for sid in held if sid not in renewed
                 and (sid in self.adopting or (self.live is not None and sid in self.live))]
        lost = [sid for sid in maybe
                if await self.off_loop(self.side.leases.owner, sid) != self.manager_id]
        for sid in lost:
            self._lose(sid, "its lease could not be renewed")
        return lost

    def _renew(self, held: list[str]) -> tuple[bool, set[str]]:
        """The heartbeat's two statements (in a thread): whether this manager's row was alive
        until now, and the ids of ``held`` still this manager's."""
        alive = self.side.managers.beat(self.manager_id, self.url, self.home, self.ttl)
        return alive, self.side.leases.renew_all(self.manager_id, held, self.ttl) if held else set()

    def fresh(self) -> bool:
        """Whether this manager's row is surely unexpired now (its last beat began less than a
        lease ago): otherwise its warm kernels may be a dead manager's to the others, and none
        is handed out until a beat has said (a manager just woken from a freeze)."""
        return not self.active or (self._beat_at is not None and time.monotonic() - self._beat_at < self.ttl)

    def lost(self, session_id: str) -> None:
        """The store refused a write of the session: its lease is another manager's now (the
        store's fence, store/postgres.py)."""
        self._lose(session_id, "a write of its record was refused")

    def _lose(self, sid: str, how: str) -> None:
        """Stop acting for ``sid`` at once: dropped from the live map, its kernel websocket
        closed; its kernel and record are the new owner's."""
        self.adopting.discard(sid)
        s = self.live.drop(sid) if self.live is not None else None
        if s is not None and s.conn is not None:  # the new owner talks to the kernel now
            self._later(s.conn.close())
        log.warning("session %s: its lease was lost (%s; another manager owns it now); this manager "
                    "stops acting for it, leaving its kernel and record alone", sid, how)
        audit("session_lease_lost", session_id=sid, manager_id=self.manager_id, how=how)

    def _later(self, work: Awaitable[object]) -> None:
        async def run() -> None:
            with contextlib.suppress(Exception):
                await work
        task = asyncio.create_task(run())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def start(self) -> None:
        """The first beat now (before this manager starts or takes anything), then one every
        third of a lease; a predecessor on this data dir (it died: this process holds the data
        dir's lock) leaves its leases, for this start to adopt."""
        if not self.active:
            return
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="heartbeat")
        self.side = await self.off_loop(self.store.background)
        await self.beat()
        self._tasks.append(asyncio.create_task(self._every("heartbeat", self.ttl / 3, self.beat)))
        if gone := self.store.managers.predecessors(self.manager_id, self.home):
            log.info("the previous manager(s) of this data dir (%s) are gone: their sessions are "
                     "taken over now", ", ".join(gone))

    def run(self) -> None:
        """The takeover scan (every second, or half a lease if shorter) and the rebalancing
        rounds (rebalance.py, every third of a lease), once the start is done."""
        if self.active and self.scan is not None:
            self._tasks.append(asyncio.create_task(self._every("takeover scan", min(SCAN_SECONDS, self.ttl / 2),
                                                                 self.scan)))
        if self.active and self.rebalance is not None:  # at the heartbeat's pace
            self._tasks.append(asyncio.create_task(self._every("rebalance", self.ttl / 3, self.rebalance)))

    @staticmethod
    async def _every(name: str, interval: float, work: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                done = work()
                if asyncio.iscoroutine(done):
                    await done
            except Exception:  # the store did not answer, say: the next round tries again
                log.exception("ownership: the %s failed (again in %g s)", name, interval)

    async def drain(self) -> None:
        """This manager is draining: marked so in the store, so that no other manager hands it
        sessions from now on (rebalance.py). A store that does not answer: as before the mark
        (a handed lease then waits out a lease before another manager adopts it)."""
        if self.active:
            try:
                await self.off_loop(self.side.managers.drain, self.manager_id)
            except Exception:
                log.exception("ownership: the draining mark could not be written")

    async def stop(self) -> None:
        """Stop beating, and leave: this manager's row goes and its leases expire now, so that
        another manager adopts its sessions (their kernels outlive it) at its next scan."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.active:
            with contextlib.suppress(Exception):  # a store that does not answer: they expire
                self.store.leases.expire_all(self.manager_id)
                self.store.managers.leave(self.manager_id)
        if self._thread is not None:  # closed after the statement under way, if one is
            if self.side is not self.store:
                self._thread.submit(self.side.close)
            self._thread.shutdown(wait=False)
            self._thread, self.side = None, self.store
