"""A kernel's state and the transitions it may make, in one table (cf. jupyter_client's
restarter: state changes in one place, each named).

::

    STARTING ──► IDLE ◄──► BUSY
       │  ▲       │  ▲      │
       │  │       ▼  │      ▼
       │  │     RESTARTING ◄┘      (the gateway restarts it, a restart asked for,
       │  │       │                 or a run saw it die / its websocket close)
       ▼  │       ▼
      DEAD / LOST / HIBERNATED ──► STARTING   (a fresh kernel on the same workspace;
                                               also from RESTARTING, and a cut-short STARTING)
    any state ──► CLOSED                      (torn down; nothing leaves it)

``DEAD``: the gateway gave it up (or a restart failed); ``LOST``: the manager gave it up (the
liveness probe, a gateway that went away), with a cause; ``HIBERNATED``: stopped on purpose,
its checkpoint kept. All three are replaced by a fresh kernel at the session's next use.

A transition the table does not allow raises ``IllegalTransition`` (logged): a bug, never a
silent change. Moving to the state a kernel is in is no transition (a reconnect of an idle
kernel stays idle).
"""

from __future__ import annotations

import enum
import logging

from ..errors import IllegalTransition

log = logging.getLogger("kernelmode.sessions")


class KernelState(enum.Enum):
    STARTING = "starting"  # launched or being connected; its preamble not installed yet
    IDLE = "idle"  # connected, preamble installed, no run of the manager's in its cell
    BUSY = "busy"  # a run's cell was sent and has not ended
    RESTARTING = "restarting"  # its process is (being) restarted: reconnect before use
    DEAD = "dead"  # the gateway gave it up, or a restart failed
    LOST = "lost"  # the manager gave it up (no answer, gateway gone); ``Kernel.cause`` says why
    HIBERNATED = "hibernated"  # stopped on purpose; its session's checkpoint holds its state
    CLOSED = "closed"  # torn down: nothing may wait on it or bring it back


S = KernelState
# Which state may follow which. CLOSED is reachable from every state and leads nowhere.
TRANSITIONS: dict[KernelState, frozenset[KernelState]] = {
    S.STARTING: frozenset({S.IDLE, S.RESTARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED}),
    S.IDLE: frozenset({S.BUSY, S.RESTARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED}),
    S.BUSY: frozenset({S.IDLE, S.RESTARTING, S.DEAD, S.LOST, S.CLOSED}),
    S.RESTARTING: frozenset({S.IDLE, S.STARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED}),
    S.DEAD: frozenset({S.STARTING, S.LOST, S.HIBERNATED, S.CLOSED}),
    S.LOST: frozenset({S.STARTING, S.HIBERNATED, S.CLOSED}),
    S.HIBERNATED: frozenset({S.STARTING, S.LOST, S.CLOSED}),
    S.CLOSED: frozenset(),
}

# No process of its own that answers: the liveness probe skips them, the gateway's word about
# them is not taken, and a kernel that finishes connecting in one of them stays there.
GONE = frozenset({S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED})
# Replaced by a fresh kernel at the next use (CLOSED is never used again; STARTING here is a
# start that was cut short: its half-started kernel is DELETEd in the background).
NEEDS_NEW = frozenset({S.STARTING, S.DEAD, S.LOST, S.HIBERNATED})
# Not ready for a run as they are: reconnected (RESTARTING) or replaced (NEEDS_NEW) first.
UNREADY = GONE | {S.STARTING, S.RESTARTING}


def check(kernel_id: str, old: KernelState, new: KernelState) -> None:
    """Refuse a transition the table does not allow (IllegalTransition, logged with both ends)."""
    if new is old or new in TRANSITIONS[old]:
        return
    log.error("kernel %s: illegal transition %s -> %s", kernel_id, old.value, new.value)
    raise IllegalTransition(f"kernel {kernel_id}: illegal transition {old.value} -> {new.value}",
                            details={"from": old.value, "to": new.value})
