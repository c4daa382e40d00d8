"""The drain: a manager that is asked to stop (SIGTERM, a rolling update) first lets its runs in
flight finish and be recorded, then stops as always (docs/scaling.md "Stopping a manager").

``begin`` refuses what would start new work here from then on — a run, a create, the wake of a
hibernated session — with 503 ``server_busy`` and a Retry-After, which every client sends again
(to another manager, once the load balancer sees this one's ``/readyz`` fail); ``wait`` returns
once no run is in flight, at ``server.drain_seconds`` at the latest. The leases are given up
after it (ownership.py), so another manager adopts the sessions at once with their variables.
Before it begins, the manager's row is marked draining in a shared store (ownership.py
``drain``): no other manager hands it sessions to even the load (rebalance.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..errors import ServerBusy
from .runs import RunRegistry

log = logging.getLogger("kernelmode.sessions")
RETRY_AFTER_SECONDS = 1  # another manager takes the request at once; this one's sessions after the drain


class Drain:
    """``runs``: the manager's runs in flight (runs.py)."""

    def __init__(self, runs: RunRegistry) -> None:
        self.runs = runs
        self.draining = False

    def begin(self) -> None:
        self.draining = True

    def check(self, what: str) -> None:
        """ServerBusy (503, Retry-After) for ``what`` while draining; nothing otherwise."""
        if self.draining:
            raise ServerBusy(f"this manager is stopping (a rolling update): {what} is not started here; "
                             "send the request again, another manager takes it",
                             details={"retry_after_seconds": RETRY_AFTER_SECONDS})

    def cell_refusal(self) -> str | None:
        """Why a console's or a Jupyter client's cell is not run while draining (None: it may
        be). Such a cell is no run the drain waits for: it would be cut off by the stop."""
        if not self.draining:
            return None
        return ("this manager is stopping (a rolling update): the cell was not run; reconnect (another "
                "manager serves this session within seconds, with its variables) and send it again")

    async def wait(self, seconds: float, cut: asyncio.Event | None = None) -> int:
        """Until no run is in flight (each one's end recorded), ``seconds`` at most, or until
        ``cut`` is set (a second signal); the runs still in flight then (they end ``interrupted``
        at the manager that adopts their sessions)."""
        deadline = time.monotonic() + seconds
        t0 = time.monotonic()
        log.info("draining: no new runs or sessions here; waiting up to %g s for %d run(s) in flight",
                 seconds, len(self.runs.in_flight()))
        cutting = asyncio.ensure_future(cut.wait()) if cut is not None else None
        try:
            while (left := deadline - time.monotonic()) > 0 and not (cut is not None and cut.is_set()):
                tasks = {r.task for r in self.runs.in_flight() if r.task is not None}
                if not tasks:
                    break
                await asyncio.wait({*tasks, *([cutting] if cutting else [])}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            if cutting is not None:
                cutting.cancel()
        still = len(self.runs.in_flight())
        log.info("drained in %.1f s (%d run(s) still in flight)", time.monotonic() - t0, still)
        return still
