"""A live session: its kernel, the lock that queues its runs, and what the manager remembers of
its workspace and of an attached console."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

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
