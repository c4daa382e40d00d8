"""A one-shot run: code in a fresh kernel (from the warm pool when there is one), then the
session is discarded. The result's artifacts stay in the store under the throw-away session's id."""

from __future__ import annotations

import contextlib
import io
import uuid
from typing import TYPE_CHECKING

from ..errors import SessionNotFound
from ..models import EgressNarrowing, RunResult, SessionCreate
from ..protocol.frames import refuse_lone_surrogates
from ..tenants import ADMIN, Principal

if TYPE_CHECKING:
    from .manager import SessionManager


async def one_shot(m: SessionManager, code: str, files: list[tuple[str, bytes]],
                   timeout_seconds: float | None = None, tools: list[str] | None = None,
                   principal: Principal = ADMIN, egress: EgressNarrowing | None = None) -> RunResult:
    m.runner.timeout(timeout_seconds)  # refuse a bad timeout or code before taking a kernel
    refuse_lone_surrogates(code, "code")
    info = await m.create(SessionCreate(session_id=f"oneshot-{uuid.uuid4().hex[:20]}", tools=tools,
                                        egress=egress), principal)
    sid = info.session_id
    try:
        for path, data in files:
            await m.upload(sid, path, io.BytesIO(data), len(data), overwrite=False)
        # Nobody could answer an approval of a throw-away run: such calls are denied.
        return await m.execute(sid, code, timeout_seconds, approvals=False)
    finally:
        with contextlib.suppress(SessionNotFound):
            await m.delete(sid)
