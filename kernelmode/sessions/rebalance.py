"""Rebalancing: a manager that holds more than its fair share of the sessions hands a few idle
ones to the manager holding the fewest (docs/high-availability.md "Rebalancing"), so that a
manager that restarts or joins gets sessions without new ones being created through it.

Each round (every third of ``store.lease_seconds``, the heartbeat's pace) may read, in one
statement, each live manager's number of leased sessions: a round that finds nothing to hand
(the load even, or no session idle) skips the next ``QUIET_ROUNDS - 1``, while one that handed
looks again next round. ``plan`` decides: hand over only while this manager is above the fair
share (total / managers, rounded up), the receiver below it, and the two more than a slack apart
(1, or a tenth of the fair share); at most ``store.rebalance_per_round`` sessions, never taking
this manager below the share or the receiver above it. So counts converge and never oscillate.

The handover is targeted: the lease is given to the receiver in one statement (``hand_over``:
still the giver's, it becomes the receiver's, marked handed), and only the receiver adopts it
(its takeover scan, takeover.py), through the gateway with its variables, as after a death. A
free-for-all (the lease expired for whoever scans first) would let a third manager, or the giver
itself, take it back, and would wait a lease for nothing. Only an idle session is handed: no
run in flight or queued, no console or Jupyter websocket attached, no MCP connection of this
manager using it as its own, no automatic checkpoint under way, its kernel connected and idle.
The giver stops serving it first (out of the live map: its requests are refused 503
``session_owned_elsewhere`` with Retry-After, or forwarded to the receiver once it owns it), then
closes its websocket to the kernel (which keeps running); the kernel is reached by one manager
at a time. If the receiver dies before adopting, the lease expires and any manager adopts it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..audit import audit
from .kernel_state import KernelState
from .live import LiveSession, LiveSessions

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager

log = logging.getLogger("kernelmode.sessions")
# The counts statement (a join of the managers and their leases) is sent by every manager on the
# shared database: each beat, N managers ask it, and nearly always the load is even. So after a
# round that handed nothing a manager waits this many rounds before it asks again (a manager
# that joins is seen within a lease period); while it is handing, every round, so a join is
# filled as fast as ``rebalance_per_round`` allows.
QUIET_ROUNDS = 3


def plan(counts: dict[str, int], me: str, per_round: int) -> tuple[str, int] | None:
    """(receiver, how many to hand it) for this round, or None: ``counts`` is each live
    manager's number of sessions, ``me`` this manager's id."""
    if me not in counts or len(counts) < 2:
        return None
    fair = math.ceil(sum(counts.values()) / len(counts))
    slack = max(1, math.ceil(fair / 10))
    theirs, receiver = min((n, mid) for mid, n in counts.items() if mid != me)
    mine = counts[me]
    if mine <= fair or theirs >= fair or mine - theirs <= slack:
        return None
    return receiver, min(per_round, mine - fair, fair - theirs)


class Rebalance:
    """``manager``: whose sessions, store and settings; ``live``: its map (a handed session is
    dropped from it, its lease given, not released)."""

    def __init__(self, manager: SessionManager, live: LiveSessions) -> None:
        self.m = manager
        self.live = live
        # Sessions a front door holds in this manager's memory (an MCP connection's own session:
        # its tool calls run here and are not forwarded): never handed over.
        self.pinned: Callable[[], Iterable[str]] = lambda: ()
        self.handed = 0  # sessions handed to other managers (tests, logs)
        self.asked = 0  # counts statements sent (tests)
        self._skip = 0  # rounds to pass before the counts are read again (QUIET_ROUNDS)

    @property
    def enabled(self) -> bool:
        """On a shared store, with kernels on a gateway every manager reaches."""
        s = self.m.settings
        return self.m.ownership.active and s.store.rebalance and s.gateway.url is not None

    def idle(self, s: LiveSession) -> bool:
        """Whether ``s`` can be handed over now without cutting anything short."""
        sid = s.info.session_id
        return (s.info.status == "idle" and s.kernel.state is KernelState.IDLE and s.kernel.ready
                and not s.lock.locked() and not s.attached and not s.console_cells
                and (s.auto_checkpoint is None or s.auto_checkpoint.done())
                and not self.m.runs.in_flight(sid) and sid not in self.m.ownership.adopting)

    async def round(self) -> list[str]:
        """One round: the sessions handed over (none when the load is even enough)."""
        own = self.m.ownership
        if not self.enabled or self.m.drain.draining:
            return []
        if self._skip > 0:
            self._skip -= 1
            return []
        self._skip = QUIET_ROUNDS - 1  # unless this round hands some
        self.asked += 1
        counts = await own.off_loop(own.side.leases.counts)
        decided = plan(counts, own.manager_id, self.m.settings.store.rebalance_per_round)
        if decided is None:
            return []
        receiver, n = decided
        pinned = set(self.pinned())
        chosen = sorted((s for s in self.live if s.info.session_id not in pinned and self.idle(s)),
                        key=lambda s: (s.info.last_activity, s.info.session_id))[:n]
        handed = [s.info.session_id for s in chosen if await self._hand(s, receiver)]
        if handed:
            self._skip = 0
            self.handed += len(handed)
            log.info("handed %d session(s) to manager %s to even the load (%s): %s", len(handed), receiver,
                     ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), ", ".join(handed))
        return handed

    async def _hand(self, s: LiveSession, receiver: str) -> bool:
        own, sid = self.m.ownership, s.info.session_id
        if self.live.get(sid) is not s or not self.idle(s):  # changed while an earlier one was handed
            return False
        # No await from the check to here: no run can have started. Requests from now on are
        # refused here (session_owned_elsewhere, retried) or forwarded to the receiver.
        self.live.drop(sid)
        if s.conn is not None:
            await s.conn.close()  # the kernel keeps running; the receiver connects to it
        await self.m.egress.detach(sid)  # before the receiver opens the session's proxy
        try:
            given = await own.off_loop(own.side.leases.hand_over, sid, own.manager_id, receiver, own.ttl)
        except Exception:  # the store did not answer: the lease runs out, and any manager adopts
            log.exception("session %s: its lease could not be handed to %s; it is adopted once it expires",
                          sid, receiver)
            return False
        if not given:  # lost meanwhile (a freeze: the new owner has it), or the receiver began
            # its drain (or died) since the counts: the lease, if still ours, is adoptable at once.
            mine = await own.off_loop(own.side.leases.expire, sid, own.manager_id)
            log.warning("session %s: %s", sid, f"manager {receiver} no longer takes sessions (draining or gone): "
                        "it is adopted anew by the next takeover scan" if mine else
                        "its lease was gone before it could be handed over")
            return False
        audit("session_handed_over", session_id=sid, tenant=s.info.tenant, manager_id=own.manager_id,
              to=receiver)
        return True
