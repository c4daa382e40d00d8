"""Takeover: every second (ownership.SCAN_SECONDS), a manager sharing the store with others adopts what a dead
manager left (docs/high-availability.md).

- Sessions whose lease expired (their manager stopped renewing): each is taken by one atomic
  acquire, so exactly one manager wins it; the winner takes the kernel over through the gateway
  with its variables (recovery.adopt, as a restarted manager does), and a run that was in flight
  is interrupted in the kernel and ends ``interrupted`` with its cause (never run again). A
  session whose kernel is gone is marked ``lost``; a hibernated, lost or deleted one only has its
  stale lease removed.
- Sessions another manager handed to this one to even the load (rebalance.py): their leases
  are this manager's already (marked handed); each is adopted the same way (no run is in flight).
- Kernels a dead manager marked (its warm pool, a start under way): deleted by the one survivor
  whose statement removed their marks; a kernel that turned out to be a session's is left for
  the session's adoption.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..audit import audit
from ..errors import KernelmodeError, SessionOwnedElsewhere
from . import recovery
from .live import LiveSessions

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager

log = logging.getLogger("kernelmode.sessions")


class Takeover:
    def __init__(self, manager: SessionManager, live: LiveSessions) -> None:
        self.m = manager
        self.live = live
        self.adopted = 0  # sessions taken over from dead managers (tests, logs)

    async def scan(self) -> list[str]:
        """One pass: the sessions adopted from dead managers."""
        if self.m.drain.draining:  # stopping: what it adopted now it would give up at once
            return []
        await self._orphaned_kernels()
        return await self._expired_sessions() + await self._handed_sessions()

    async def _orphaned_kernels(self) -> None:
        m = self.m
        # Off the loop on the heartbeat's connection, as the next pass's statements (ownership.py).
        orphans = set(await m.ownership.off_loop(m.ownership.side.managers.orphaned_pool))
        if not orphans:
            return
        orphans -= {str(i.kernel_id) for i in m.store.with_kernels(orphans)}  # sessions': adopted
        for kernel_id in sorted(orphans):
            with contextlib.suppress(KernelmodeError):
                await m.gateway.shutdown_kernel(kernel_id)
        if orphans:
            log.info("shut down %d kernel(s) of managers that stopped: %s", len(orphans), ", ".join(sorted(orphans)))
            audit("orphan_kernels_removed", kernel_ids=sorted(orphans))

    async def _expired_sessions(self) -> list[str]:
        own = self.m.ownership
        t0 = time.monotonic()
        taken = await own.off_loop(self._take_expired)
        won = [sid for sid in taken if sid not in self.live]  # one of ours, late: taken back above
        if not won:
            return []
        own.adopting.update(won)  # renewed by the heartbeat while the kernels are reached
        try:
            return await self._adopt(won, t0)
        finally:
            own.adopting.difference_update(won)

    async def _handed_sessions(self) -> list[str]:
        own = self.m.ownership
        if not self.m.rebalance.enabled:
            return []
        t0 = time.monotonic()
        handed = await own.off_loop(own.side.leases.handed, own.manager_id)
        won = [sid for sid in handed if sid not in self.live and sid not in own.adopting]
        if not won:
            return []
        own.adopting.update(won)
        try:
            return await self._adopt(won, t0, "handed over by another manager to even the load",
                                     "sessions_received")
        finally:
            own.adopting.difference_update(won)

    def _take_expired(self) -> list[str]:
        """(In a thread.) The expired sessions' leases this manager took: one statement when
        none expired, one more per expired session."""
        own = self.m.ownership
        side = own.side
        return [sid for sid in side.leases.expired()
                if not sid.startswith(":")  # a singleton's (the reaper's), not a session's
                and side.leases.acquire(sid, own.manager_id, own.ttl)]

    async def _adopt(self, won: list[str], t0: float, why: str = "from a manager that stopped",
                     event: str = "sessions_taken_over") -> list[str]:
        m, own, store = self.m, self.m.ownership, self.m.store
        infos = []
        for sid in won:
            info = store.get(sid)
            if info is None or info.status in ("lost", "hibernated"):
                own.release(sid)  # nothing runs for it: the lease goes (a wake takes a new one)
            else:
                infos.append(info)
        if not infos:
            return []
        running = {str(k["id"]) for k in await m.gateway.list_kernels(
            timeout=m.settings.gateway.probe_timeout_seconds)}
        ids = {i.session_id for i in infos}
        in_flight = {r.session_id: r for r in store.runs_in_flight() if r.session_id in ids}
        for info in infos:
            if info.kernel_id not in running:
                log.warning("session %s: its manager stopped and its kernel is gone: lost", info.session_id)
                store.mark_lost(info)
        adopted = await recovery.adopt(m.kernels, store, [i for i in infos if i.kernel_id in running], in_flight)
        kept = set()
        for s in adopted:
            try:
                self.live.add(s)  # its lease again: lost meanwhile (a slow kernel), another has it
            except SessionOwnedElsewhere:
                if s.conn is not None:
                    await s.conn.close()
                continue
            await m.egress.attach(s.kernel)
            kept.add(s.info.session_id)
        elsewhere = {s.info.session_id for s in adopted} - kept  # the new owner ends their runs
        lost = ids - kept - elsewhere
        for sid in lost:
            own.release(sid)
        recovery.end_interrupted_runs(store, {sid: r for sid, r in in_flight.items() if sid not in elsewhere},
                                      kept, recovery.TAKEN_OVER)
        self.adopted += len(kept)
        log.info("took over %d session(s) %s, in %.2f s (lost: %s)", len(kept), why,
                 time.monotonic() - t0, ", ".join(sorted(lost)) or "none")
        audit(event, session_ids=sorted(kept), lost=sorted(lost), manager_id=own.manager_id)
        return sorted(kept)
