"""A create: a new session's id and caps admitted, its request checked (tools, packages,
limits, egress), a kernel taken from the warm pool or started, the session made live (its lease
taken) and recorded; then its packages installed and, for a fork, its source's state restored.
A draining manager (drain.py) takes no create: the client is sent to another manager."""

from __future__ import annotations

import contextlib
import logging
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from ..audit import audit
from ..egress.policy import egress_info, session_policy
from ..errors import KernelmodeError
from ..models import SessionCreate, SessionInfo
from ..packages.policy import parse_requirement
from ..tenants import ADMIN, Principal
from .live import LiveSession, now

if TYPE_CHECKING:  # the manager passes itself in; importing it would be a cycle
    from .manager import SessionManager

log = logging.getLogger("kernelmode.sessions")


async def create(m: SessionManager, req: SessionCreate, principal: Principal = ADMIN) -> SessionInfo:
    """A new live session for ``principal`` (a fork of ``req.fork_of`` / ``from_checkpoint``)."""
    m.drain.check("a new session")
    sid = req.session_id or uuid.uuid4().hex
    tenant = principal.tenant
    m.admission.check_room(sid, principal)
    source = await m.forks.source(req, principal)
    if source is not None:
        req = m.forks.like_source(req, source.session_id)
        m.admission.check_room(sid, principal)  # the source was awaited: another create may have the id now
    m.broker.registry.check_allow_list(req.tools)
    for r in req.packages or []:
        parse_requirement(r)  # a bad requirement is refused before a kernel is taken
    limits = principal.limits(req.limits, m.settings.sandbox)  # 422 above a ceiling
    egress = session_policy(m.settings.egress, principal.tenant, principal.egress, req.egress,  # 403 if wider
                            remote=m.kernels.remote)
    ttl = req.ttl_seconds or m.settings.sessions.ttl_seconds
    t = now()
    info = SessionInfo(
        session_id=sid, status="idle", created_at=t, last_activity=t,
        expires_at=t + timedelta(seconds=ttl), ttl_seconds=ttl, limits=limits,
        sandbox=m.sandbox, tools=req.tools, tenant=tenant, egress=egress_info(egress),
    )
    m.creating[sid] = tenant
    try:
        k = await m.pool.claim(limits, tenant)
        if k is not None:
            info.from_pool = True
            k.info = info
            m.pool.refill(delay=m.settings.sessions.pool_refill_delay_seconds)
            try:
                if req.tools is not None:  # the pool kernel's preamble offers every tool
                    await k.install_preamble(m.kernels.start_timeout)
                await m.egress.attach(k)  # its session's proxy, in the kernel's egress dir
            except BaseException:
                await k.discard()
                raise
        else:
            k = await m.pool.start_for(info)  # in its turn; 503 server_busy if too late
    finally:
        m.creating.pop(sid, None)
    info.kernel_id = k.kernel_id
    s = LiveSession(kernel=k)
    try:
        m.live.add(s)  # its lease first (another manager may have made this id meanwhile)
    except KernelmodeError:
        await k.discard()
        raise
    m.metrics.sessions_created.labels("true" if info.from_pool else "false", tenant).inc()
    m.store.take_id(sid, tenant)  # runs of an earlier session with this id are not this one's
    m.store.save(info, s.kernel_id, s.workspace)
    log.info("session %s created (kernel %s, tenant %s)", sid, s.kernel_id, tenant)
    audit("session_created", session_id=sid, tenant=tenant, kernel_id=s.kernel_id,
          from_pool=info.from_pool, sandbox=m.sandbox)
    if req.packages:
        try:
            await m.packages.install(s, req.packages, "session_create")
        except BaseException:  # the session was asked for with them: none without them
            with contextlib.suppress(KernelmodeError):
                await m.delete(sid, keep_notebook=False, reason="packages_refused")
            raise
    if source is not None:
        await m.forks.start_from(s, source)
    return info

