"""Hibernation: an idle session is checkpointed and its kernel stopped, its record and workspace
kept (``status: hibernated``, no process left); its next use wakes it.

Waking reuses the path of a kernel's death: the session gets a Kernel in state ``hibernated``
with a restore pending, so its next run starts a fresh kernel on the same workspace (``Kernel.ensure_ready``)
and loads the latest checkpoint first (``Checkpoints.before_run``). A console attach does the
same at once (``SessionManager.resume``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from ..audit import audit
from ..config import Settings
from ..errors import KernelmodeError
from ..models import SessionInfo
from .checkpoints import Checkpoints
from .kernel_env import Kernels
from .kernels import Kernel, KernelState
from .live import LiveSession, LiveView, now
from .store import SessionStore

log = logging.getLogger("kernelmode.sessions")


class Hibernation:
    """``live``: the manager's live sessions, read only (the manager takes a hibernated session
    out of it, and puts a woken one in)."""

    def __init__(self, settings: Settings, store: SessionStore, checkpoints: Checkpoints,
                 kernels: Kernels, live: LiveView) -> None:
        self.cfg = settings.sessions
        self.store = store
        self.checkpoints = checkpoints
        self.kernels = kernels
        self.live = live

    @property
    def on(self) -> bool:
        return self.cfg.hibernate_after_seconds is not None

    def due(self, at: datetime) -> list[str]:
        """Live sessions idle past ``hibernate_after_seconds`` (or their own TTL), running nothing
        and with no console or Jupyter client attached (stopping the kernel would cut it off)."""
        assert self.cfg.hibernate_after_seconds is not None
        idle = timedelta(seconds=self.cfg.hibernate_after_seconds)
        return [s.info.session_id for s in self.live
                if not s.lock.locked() and s.console_cells == 0 and s.attached == 0
                and (s.info.last_activity + idle <= at or (s.info.expires_at is not None and s.info.expires_at <= at))]

    def expired(self, at: datetime) -> list[str]:
        """Hibernated sessions unused past ``hibernated_ttl_seconds``."""
        return [i.session_id for i in self.store.hibernated_expired(at) if i.session_id not in self.live]

    async def hibernate(self, s: LiveSession) -> bool:
        """Checkpoint the session and stop its kernel (the caller holds its lock, and takes it
        out of the live sessions on True); False (and it stays live) when its state could not
        be saved. A kernel never started since the session woke has nothing new: the session's
        latest checkpoint stands."""
        sid = s.info.session_id
        k = s.kernel
        if k.ready and not k.restore_pending:
            try:
                await self.checkpoints.take_if_changed(s)
            except KernelmodeError as e:
                log.warning("session %s: not hibernated, its checkpoint failed: %s", sid, e)
                return False
        await k.shutdown()
        k.to(KernelState.HIBERNATED)
        if self.kernels.egress is not None:
            await self.kernels.egress.detach(sid)
        # A hibernated session holds files only: its volume is detached (kept), no loop device.
        # A remote kernel's workspace went with it: its checkpoint holds the files.
        if not self.kernels.remote:
            await asyncio.to_thread(self.kernels.volumes.unmount, s.workspace)
        t = now()
        s.info.status = "hibernated"
        s.info.memory_bytes = None
        s.info.last_activity = t
        s.info.expires_at = t + timedelta(seconds=self.cfg.hibernated_ttl_seconds)
        self.store.save(s.info, k.kernel_id, s.workspace)
        log.info("session %s hibernated", sid)
        audit("session_hibernated", session_id=sid, tenant=s.info.tenant)
        return True

    def wake(self, info: SessionInfo) -> LiveSession:
        """The hibernated session, with a kernel to start at its next use (the manager makes it
        live)."""
        workspace = self.store.workspace(info.session_id)
        assert workspace is not None and info.kernel_id is not None
        # Mounted at once (a short subprocess): uploads and listings may come before any run.
        if not self.kernels.remote:
            self.kernels.volumes.attach(workspace)
        info.status = "idle"
        k = Kernel(self.kernels, info.kernel_id, workspace, info, KernelState.HIBERNATED)
        k.process_gone()
        s = LiveSession(kernel=k)
        s.changed_since_checkpoint = False  # its latest checkpoint is all it had
        s.touch()
        self.store.save(info, k.kernel_id, workspace)
        log.info("session %s wakes from hibernation", info.session_id)
        audit("session_woken", session_id=info.session_id, tenant=info.tenant)
        return s
