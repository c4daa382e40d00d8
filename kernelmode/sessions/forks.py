"""Forks and resume: a checkpoint taken on demand, a new session started from a checkpoint or from
another session (``fork_of``, ``from_checkpoint``), and a woken or dead session's kernel started
and its latest checkpoint restored at once (a console attaches to a kernel, not to a plan for one).
The saving and loading themselves are checkpoints.py's; here is when and for which session.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ..audit import audit
from ..egress.policy import narrowing_of
from ..errors import CheckpointFailed, InvalidRequest, SessionNotFound
from ..models import CheckpointInfo, LimitsPatch, SessionCreate
from ..tenants import Principal
from .live import LiveSession
from .readying import RestartCut, restart_in_place

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager


class Forks:
    """``manager``: the SessionManager whose sessions these are (its lookups, delete, rooms)."""

    def __init__(self, manager: SessionManager) -> None:
        self.m = manager

    async def checkpoint(self, session_id: str, auto: bool = False) -> CheckpointInfo:
        """Save the session's variables and files now (after the runs queued before it)."""
        s = self.m.live_session(session_id)
        if s.kernel.restore_pending:  # woken from hibernation: its kernel and state first
            s = await self.resume(session_id)
        async with s.lock:
            if self.m.peek(session_id) is not s:  # deleted, or hibernated, while we waited
                raise CheckpointFailed(f"session {session_id!r} was deleted or hibernated meanwhile")
            if s.kernel.state_lost or s.kernel.needs_ready:
                raise CheckpointFailed(f"session {session_id!r}: its kernel died since the last run; "
                                       "run code first (the next run restores the latest checkpoint)")
            return await self.m.checkpoints.take(s, auto=auto)

    async def resume(self, session_id: str) -> LiveSession:
        """The live session with its kernel running: a woken or dead one is started and restored
        now."""
        s = self.m.live_session(session_id)
        if s.kernel.ready and not s.kernel.restore_pending:
            return s
        async with s.lock:
            try:
                await self.m.runner.readying.run(session_id, self._ready(s))
            except RestartCut:  # a restart came meanwhile: done here, the console gets a fresh kernel
                try:
                    await restart_in_place(s.kernel)
                finally:
                    self.m.runner.readying.done(session_id)
            self.m.store.save(s.info, s.kernel_id, s.workspace)
        return s

    async def _ready(self, s: LiveSession) -> None:
        await s.kernel.ensure_ready()
        await s.kernel.install_preamble(self.m.kernels.start_timeout)
        await self.m.checkpoints.before_run(s)

    async def source(self, req: SessionCreate, principal: Principal) -> CheckpointInfo | None:
        """The checkpoint a new session starts from: ``from_checkpoint``, or a fresh one of ``fork_of``."""
        if req.fork_of is not None and req.from_checkpoint is not None:
            raise InvalidRequest("give fork_of or from_checkpoint, not both")
        if req.from_checkpoint is not None:
            return self.m.checkpoints.find(req.from_checkpoint, principal)
        if req.fork_of is not None:
            self.m.authorize(principal, req.fork_of)
            return await self.checkpoint(req.fork_of)
        return None

    def like_source(self, req: SessionCreate, source_id: str) -> SessionCreate:
        """A fork is a copy: its source's tools, limits and egress (within the caller's), unless
        the request names its own; the source's state may need that much memory and disk."""
        try:
            src = self.m.get(source_id)
        except SessionNotFound:
            return req
        update: dict[str, Any] = {}
        if req.tools is None:
            update["tools"] = src.tools
        if req.limits is None:
            update["limits"] = LimitsPatch(**src.limits.model_dump())
        if req.egress is None:  # the source's hosts (none if it had no egress), not the tenant's
            update["egress"] = narrowing_of(src.egress)
        return req.model_copy(update=update)

    async def start_from(self, s: LiveSession, source: CheckpointInfo) -> None:
        """A fork: the source's files, then its variables (a failed restore deletes the new session)."""
        sid = s.info.session_id
        try:
            if source.packages:  # first: the restore re-imports modules that may come from them
                await self.m.packages.copy_in(s, source.packages)
            await self.m.checkpoints.start_from(s, source)
        except BaseException:
            with contextlib.suppress(SessionNotFound):
                await self.m.delete(sid, keep_notebook=False, reason="fork_failed")
            raise
        audit("session_forked", session_id=sid, tenant=s.info.tenant, checkpoint_id=source.checkpoint_id,
              source=source.session_id)
