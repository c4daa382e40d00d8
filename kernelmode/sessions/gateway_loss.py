"""The gateway's failures as the sessions see them: a gateway that died (every kernel with it),
one that answers again, and an external gateway that restarted between two looks. Sessions whose
kernels are gone are marked ``dead`` (their next run gets a fresh kernel on the same workspace and
reports ``state_lost``); the warm pool is dropped and refilled. The watch that notices is in
server.py; this room only says what a loss means to the sessions.
"""

from __future__ import annotations

import contextlib

from ..errors import SessionOwnedElsewhere
from ..models import DeathCause
from .kernel_state import KernelState
from .live import LiveSession, LiveView
from .pool import WarmPool
from .store import SessionStore


class GatewayLoss:
    """``live``: the manager's live sessions (read only)."""

    def __init__(self, live: LiveView, pool: WarmPool, store: SessionStore) -> None:
        self.live = live
        self.pool = pool
        self.store = store

    async def _lose(self, s: LiveSession, cause: DeathCause) -> None:
        s.kernel.lose(cause)
        if s.conn is not None:
            await s.conn.close()
        with contextlib.suppress(SessionOwnedElsewhere):  # another manager's now (the store's fence)
            self.store.save(s.info, s.kernel_id, s.workspace)

    async def lost(self) -> None:
        """The Kernel Gateway died, and every kernel with it: each session is marked ``dead``, and
        the warm pool is dropped (refilled once a new gateway answers: ``back``)."""
        gone = DeathCause(kind="lost", detail="the kernel gateway exited, and its kernels with it")
        for s in self.live:
            await self._lose(s, gone)
        await self.pool.drop(shutdown=False)

    def back(self) -> None:
        """A new gateway answers: the warm pool fills again."""
        self.pool.refill()

    def vanished(self, running: set[str]) -> bool:
        """Whether a live session's kernel is gone from an external gateway's list with its
        websocket closed (a gateway restarted between two looks)."""
        return any(s.kernel_id not in running and (s.conn is None or not s.conn.is_open)
                   and s.kernel.state in (KernelState.IDLE, KernelState.BUSY) for s in self.live)

    async def external_back(self, running: set[str]) -> tuple[list[str], list[str]]:
        """An external gateway answers again after it did not: the sessions whose kernels it no
        longer runs are marked ``dead`` as in ``lost``; returns the session ids that survived and
        those lost."""
        survived, lost = [], []
        for s in self.live:
            if s.kernel_id in running:
                survived.append(s.info.session_id)
                continue
            lost.append(s.info.session_id)
            await self._lose(s, DeathCause(kind="lost", detail="the gateway no longer runs this kernel "
                                           "(it was restarted, or lost the kernel's node)"))
        await self.pool.drop(shutdown=False)  # its kernels may be gone too: start afresh
        self.pool.refill()
        return sorted(survived), sorted(lost)
