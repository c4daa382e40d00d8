"""Who calls an MCP tool, over which connection, and which session is that connection's own.

Every connection gets its own session on first use (keyed by the stdio process, or by the
streamable-HTTP ``Mcp-Session-Id``); naming a ``session_id`` reaches any session the token may
see, as over REST. Over HTTP the caller's tenant comes from the ``/mcp`` handler
(``TENANT_HEADER``, set from the bearer token); over stdio the caller is the admin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from mcp.server.mcpserver import Context
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER

from ..errors import KernelmodeError, SessionNotFound, Unauthorized
from ..models import SessionCreate, SessionInfo
from ..services import Services
from ..tenants import ADMIN, Principal

_STDIO = "stdio"
# Set by the /mcp handler from the bearer token (a client's own header of this name is dropped).
TENANT_HEADER = "x-kernelmode-tenant"
SESSION_HEADER = MCP_SESSION_ID_HEADER  # the SDK's: names the client's MCP session


class Connections:
    """The session of each MCP connection, made on first use and made again when it is gone."""

    def __init__(self, services: Callable[[], Services]) -> None:
        """``services``: the running service's parts (called per use: they exist once it started)."""
        self._services = services
        self.own: dict[str, str] = {}  # connection key -> its session id
        self._own_locks: dict[str, asyncio.Lock] = {}

    def principal(self, ctx: Context[Any]) -> Principal:
        headers: Mapping[str, str] | None = ctx.headers
        if headers is None:
            return ADMIN  # stdio: whoever started the process owns the server
        principal = self._services().tenants.get(headers.get(TENANT_HEADER, ""))
        if principal is None:  # cannot happen behind McpHandler; refuse rather than guess
            raise Unauthorized("this request carries no tenant")
        return principal

    @staticmethod
    def key(ctx: Context[Any]) -> str | None:
        """The connection's key, or None for a stateless request (no MCP session)."""
        headers: Mapping[str, str] | None = ctx.headers
        if headers is None:
            return _STDIO  # one stdio process serves one client
        mcp_session = headers.get(SESSION_HEADER)  # checked by the SDK: it names a live MCP session
        # The tenant is part of the key: another tenant's request naming this MCP session id
        # never reaches this connection's kernel.
        return f"http:{headers.get(TENANT_HEADER, '')}:{mcp_session}" if mcp_session else None

    def own_session(self, ctx: Context[Any]) -> str | None:
        key = self.key(ctx)
        return self.own.get(key) if key else None

    def closed(self, ctx: Context[Any], session_id: str) -> None:
        """The session was closed: if it was the connection's own, the next use makes a new one."""
        key = self.key(ctx)
        if key is not None and self.own.get(key) == session_id:
            del self.own[key]

    async def session(self, ctx: Context[Any], session_id: str | None) -> tuple[str, str | None]:
        """(session id, a note for the model or None)."""
        principal = self.principal(ctx)
        sessions = self._services().sessions
        if session_id:
            try:
                sessions.authorize(principal, session_id)
                status = sessions.status(session_id)
            except SessionNotFound as e:
                raise SessionNotFound(f"unknown session {session_id!r}: omit session_id to use this "
                                      "connection's own session, or call list_sessions") from e
            if status == "lost":
                raise SessionNotFound(f"session {session_id!r} is lost (its kernel ended with a "
                                      "previous server run); omit session_id to get a fresh session")
            return session_id, None
        key = self.key(ctx)
        if key is None:
            info = await self._create(principal)
            return info.session_id, (
                f"NOTE: this connection is stateless, so a new session was made. Pass "
                f"session_id={info.session_id!r} in later calls to keep these variables.")
        lock = self._own_locks.setdefault(key, asyncio.Lock())
        async with lock:
            sid = self.own.get(key)
            if sid is not None:
                try:
                    if sessions.status(sid) != "lost":
                        return sid, None
                except SessionNotFound:
                    pass
            info = await self._create(principal)
            self._forget_gone_connections()
            self.own[key] = info.session_id
            note = None if sid is None else (
                "NOTE: this connection's previous session was closed or expired; this is a new "
                "session, so earlier variables are gone.")
            return info.session_id, note

    def _forget_gone_connections(self) -> None:
        """Drop the entries of connections whose session is gone (closed, reaped, lost): each
        entry's session looked up by its id, not a listing of every stored session."""
        sessions = self._services().sessions

        def gone(sid: str) -> bool:
            if sessions.peek(sid) is not None:
                return False
            try:
                return sessions.status(sid) == "lost"
            except SessionNotFound:
                return True

        for key in [k for k, sid in self.own.items() if gone(sid)]:
            del self.own[key]
            lock = self._own_locks.get(key)
            if lock is not None and not lock.locked():
                del self._own_locks[key]

    async def _create(self, principal: Principal) -> SessionInfo:
        try:
            return await self._services().sessions.create(SessionCreate(), principal)
        except KernelmodeError as e:  # the same error (its code), saying what was being done
            e.message = f"could not start a session: {e.message}"
            e.args = (e.message,)
            raise
