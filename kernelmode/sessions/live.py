"""A live session: its kernel, the lock that queues its runs, and what the manager remembers of
its workspace and of an attached console; and ``LiveSessions``, the one map of them by id.

The map has one owner, the SessionManager: it alone adds and removes (a create, in creation.py;
an adoption at start, a wake; a delete, a hibernation, a stop), but for ownership.py, which drops a session
whose lease was lost, takeover.py, which adds those it adopts from a dead manager (or that
another handed over), and rebalance.py, which drops those it hands to another manager. Its rooms
get the read-only ``LiveView`` in their constructors (mypy keeps them from writing) and see every
change at once. With several managers on one store (``leases`` set) the map is exactly the
sessions this manager holds leases on: an add takes the lease, a remove gives it up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Protocol

from ..errors import SessionExists
from ..gateway.client import KernelConnection
from ..models import SessionInfo
from .kernels import Kernel


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class LiveSession:
    kernel: Kernel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # runs in arrival order (FIFO)
    console_cells: int = 0  # cells a console attached to the session has running or queued
    attached: int = 0  # consoles and Jupyter clients attached now (a kernel's "connections")
    # A run finished since the latest checkpoint: a restore from it may miss what that run made.
    changed_since_checkpoint: bool = True
    last_checkpoint: float = 0.0  # monotonic time of the latest checkpoint (automatic ones wait)
    auto_checkpoint: asyncio.Task[None] | None = None  # an automatic checkpoint under way

    @property
    def info(self) -> SessionInfo:
        return self.kernel.info

    @property
    def kernel_id(self) -> str:
        return self.kernel.kernel_id

    @property
    def conn(self) -> KernelConnection | None:
        return self.kernel.conn

    @property
    def workspace(self) -> Path:
        return self.kernel.workspace

    @property
    def egress_dir(self) -> Path | None:
        """The host directory mounted at /run/kernelmode/egress in this session's kernel, where
        the egress proxy puts the session's ``proxy.sock`` (and ``ca-bundle.pem``); None when
        the kernel has none (unsandboxed, or on a gateway elsewhere). A replaced kernel (after a
        death or a wake) has a new one; a restarted kernel keeps its own."""
        env = self.kernel.env
        if env.egress is None or env.remote:
            return None
        return env.egress.dir_of(self.kernel_id)

    def touch(self) -> None:
        t = now()
        self.info.last_activity = t
        self.info.expires_at = t + timedelta(seconds=self.info.ttl_seconds)


class LiveView:
    """The live sessions, read only: what the manager's rooms are given."""

    def __init__(self) -> None:
        self._by_id: dict[str, LiveSession] = {}
        self._elsewhere: set[str] = set()  # dropped for a lost lease (rare: a frozen manager)

    def get(self, session_id: str) -> LiveSession | None:
        return self._by_id.get(session_id)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[LiveSession]:
        """The sessions live now (a copy: the caller may await while it walks them)."""
        return iter(list(self._by_id.values()))

    def ids(self) -> list[str]:
        return list(self._by_id)

    def taken_elsewhere(self, session_id: str) -> bool:
        """Whether the session stopped being live here because another manager took its lease
        (not a delete): what is still running for it answers ``session_owned_elsewhere``."""
        return session_id in self._elsewhere


class Leases(Protocol):
    """What the map needs of ownership.py: a session's lease taken (raising if another manager
    holds it) and given up."""

    def claim(self, session_id: str) -> None: ...

    def release(self, session_id: str) -> None: ...


class LiveSessions(LiveView):
    """The live sessions by id, and the only way to change which are live."""

    leases: Leases | None = None  # several managers on one store: ownership.attach sets it

    def add(self, s: LiveSession) -> None:
        """``s`` is live from now (SessionExists if another session holds its id;
        SessionOwnedElsewhere if another manager holds its lease)."""
        sid = s.info.session_id
        if sid in self._by_id:
            raise SessionExists(f"session {sid!r} is live already")
        if self.leases is not None:
            self.leases.claim(sid)
        self._by_id[sid] = s
        self._elsewhere.discard(sid)

    def remove(self, session_id: str) -> LiveSession | None:
        """``session_id`` is no longer live (its lease given up); the session it was, if any."""
        s = self._by_id.pop(session_id, None)
        if s is not None and self.leases is not None:
            self.leases.release(session_id)
        return s

    def drop(self, session_id: str) -> LiveSession | None:
        """``session_id`` is no longer live here because another manager took its lease: the
        lease is not touched."""
        self._elsewhere.add(session_id)
        return self._by_id.pop(session_id, None)

    def clear(self) -> list[LiveSession]:
        """None is live any more (a stop); those that were."""
        gone, self._by_id = list(self._by_id.values()), {}
        return gone
