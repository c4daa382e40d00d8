"""The manager's start and stop. Start: the sessions of a previous run are adopted (their kernels
outlived it) or marked ``lost``, interrupted runs ended, left-over kernels and workspaces cleared,
then the reaper, the liveness probes and the warm pool begin. Stop: the reverse, leaving live
sessions' kernels running (a successor may adopt them).

Beside other live managers on one store (ownership.py), a start touches only what no live manager
owns: a session another holds the lease of is neither adopted nor marked lost, nor are its runs
ended or its kernel shut down, and no manager's marked (pool) kernel is taken for a stray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ..errors import KernelmodeError
from ..models import RunResult
from . import recovery
from .live import LiveSession, LiveView

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager

log = logging.getLogger("kernelmode.sessions")


class Lifecycle:
    """``manager``: whose rooms start and stop; ``live``: its live sessions, read only (the
    manager puts the adopted ones in, and empties it at the stop)."""

    def __init__(self, manager: SessionManager, live: LiveView) -> None:
        self.m = manager
        self.live = live
        self._strays: asyncio.Task[None] | None = None
        self._in_flight: dict[str, RunResult] = {}  # runs the previous manager left running
        self._theirs: set[str] = set()  # kernels of sessions another live manager owns

    async def adopt(self, running_kernels: set[str] | frozenset[str]) -> list[LiveSession]:
        """Start's first half: the sessions of ``running_kernels`` (kernels of an adopted
        gateway, left by a crashed manager), taken over with their variables (the manager makes
        them live); the rest become ``lost``."""
        m, store, own = self.m, self.m.store, self.m.ownership
        found = recovery.adoptable(store, running_kernels)
        adoptable = [i for i in found if own.take(i.session_id)]  # of two managers, one takes each
        self._theirs = {str(i.kernel_id) for i in found} - {str(i.kernel_id) for i in adoptable}
        adopted_ids = {i.session_id for i in adoptable}
        own.adopting |= adopted_ids  # renewed by the heartbeat until they are live
        lost = store.mark_all_lost(keep=adopted_ids, manager_id=own.manager_id if own.active else None)
        if lost:  # named: the operator (and the sessions' owners) learn which did not survive
            log.info("%d session(s) of a previous run are marked lost: %s", len(lost), ", ".join(lost))
        m.workspaces.mkdir(parents=True, exist_ok=True)
        m.workspaces.chmod(0o711)
        keep_mounted = {w for i in adoptable if (w := store.workspace(i.session_id)) is not None}
        m.quota = await asyncio.to_thread(m.volumes.start, keep_mounted)
        log.info("workspace quota: %s", m.quota)
        self._in_flight = {r.session_id: r for r in store.runs_in_flight()}
        if own.active:  # read after the runs: a run started since is of a session leased before it
            theirs = store.leases.held_elsewhere(own.manager_id)
            self._in_flight = {sid: r for sid, r in self._in_flight.items() if sid not in theirs}
        return await recovery.adopt(m.kernels, store, adoptable, self._in_flight)

    async def begin(self, running_kernels: set[str] | frozenset[str]) -> None:
        """Start's second half, with the adopted sessions live: interrupted runs ended, stray
        kernels and litter cleared, the reaper, the liveness probes and the warm pool begun."""
        m, store = self.m, self.m.store
        for s in list(self.live):  # its proxy's socket again, for a kernel that kept running
            await m.egress.attach(s.kernel)
        m.ownership.adopting.clear()  # live now, or lost (the takeover scan starts after this)
        recovery.end_interrupted_runs(store, self._in_flight, set(self.live.ids()))
        self._in_flight = {}
        strays = running_kernels - {s.kernel_id for s in self.live} - self._theirs
        if m.ownership.active:  # marked kernels: a live manager's stay; a dead one's (one taker) go
            dead = set(store.managers.orphaned_pool())
            strays = ((strays | dead) - store.managers.pool_kernels()
                      - {str(i.kernel_id) for i in store.with_kernels(dead)})
        if strays:  # pool kernels of the dead manager, and the like: after start, in the background
            self._strays = asyncio.create_task(self._shut_down(strays), name="strays")
        # Workspaces of kernels that belong to no session (a previous run's pool) are litter.
        keep = store.workspaces()
        for d in m.workspaces.iterdir():
            if d.suffix != ".img" and d not in keep:
                await asyncio.to_thread(m.volumes.destroy, d)
        await asyncio.to_thread(m.packages.service.sweep, {w.name for w in keep})
        m.reaper.start()
        m.liveness.start()
        m.pool.refill()

    async def stop(self, keep_sessions: bool) -> None:
        """``keep_sessions``: their kernels outlive this manager (an external gateway keeps them),
        so they stay adoptable by the next `serve` instead of being marked lost."""
        m, store = self.m, self.m.store
        m.pool.halt()  # first: the steps below may free or evict kernels, which would refill
        await m.reaper.stop()
        await m.liveness.stop()
        if self._strays is not None:
            self._strays.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._strays
        for s in self.live:
            if not keep_sessions:
                store.mark_lost(s.info)
        # At once, not one by one: an MCP client gives its stdio server 2 s to exit. The kernels
        # of live sessions keep running (a successor may adopt them); only pool kernels go.
        await asyncio.gather(*(s.conn.close() for s in self.live if s.conn),
                             m.pool.stop(), return_exceptions=True)
        await asyncio.to_thread(m.volumes.sweep,
                                {s.workspace for s in self.live} | store.hibernated_workspaces())
        await m.egress.stop()  # kept kernels meet the bridge's "not answering" until a successor adopts them

    async def _shut_down(self, kernel_ids: set[str] | frozenset[str]) -> None:
        for kernel_id in kernel_ids:
            with contextlib.suppress(KernelmodeError):
                await self.m.gateway.shutdown_kernel(kernel_id)
        # Their workspaces are no session's: the start-up sweep of workspaces/ removed them.
