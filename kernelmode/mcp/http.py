"""Serve the MCP SDK's streamable-HTTP transport at /mcp on the REST port (tornado).

The SDK speaks ASGI; this handler hands it each request as an ASGI call, behind the same bearer
token as the REST API. The protocol itself (sessions, SSE framing, JSON-RPC) is all the SDK's.

Each MCP connection (``Mcp-Session-Id``) belongs to the tenant that opened it: the request's
ASGI scope carries the tenant as the SDK's authenticated user, and the SDK answers another
tenant's request for that id exactly like an unknown id (404, so no DELETE either). The number
of open connections is capped per tenant as well as in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import MutableMapping
from typing import Any

from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    AuthorizationContext,
    authorization_context,
)
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..api.handlers import BaseHandler
from ..errors import PayloadTooLarge
from ..services import Services
from .connections import SESSION_HEADER, TENANT_HEADER
from .fastcall import FastCall, FastCalls
from .plain import PlainClients, plain_client, sse_answer, wants_stream
from .server import KernelmodeMCP

log = logging.getLogger("kernelmode.mcp")


def tenant_user(tenant: str) -> AuthenticatedUser:
    """The SDK's authenticated user for a tenant: the SDK binds each MCP connection to the user
    that opened it (its ``client_id``). No token in it: tools never need the caller's secret."""
    return AuthenticatedUser(AccessToken(token="", client_id=tenant, scopes=[]))


@functools.lru_cache(maxsize=1024)
def _owner(tenant: str) -> AuthorizationContext:
    """The owner record the SDK keeps for the connections a tenant opened (compared on every
    fast call: built once per tenant; only ever compared, never changed)."""
    return authorization_context(tenant_user(tenant))


class TenantSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager with a cap on open MCP connections per tenant besides its
    overall ``max_sessions``: one tenant at its cap cannot keep another from connecting.

    Admission is the SDK's ``_admit_session`` (mcp 2.3), called under its creation lock, so
    concurrent openings are counted exactly; None is the SDK's refusal (503 "Too many open
    sessions"). tests/security/test_mcp_tenants.py fails if the SDK stops calling it."""

    def __init__(self, *args: Any, max_sessions_per_tenant: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_sessions_per_tenant = max_sessions_per_tenant

    def open_sessions(self, tenant: str) -> int:
        return sum(1 for owner in self._session_owners.values() if owner["client_id"] == tenant)

    def _admit_session(self, requestor: AuthorizationContext | None) -> StreamableHTTPServerTransport | None:
        if requestor is None or self.open_sessions(requestor["client_id"]) >= self.max_sessions_per_tenant:
            return None  # McpHandler always sets the user; none would be a bug: refuse
        return super()._admit_session(requestor)


class McpHttp:
    """The streamable-HTTP session manager and the task that keeps it running."""

    def __init__(self, mcp: KernelmodeMCP, max_body_bytes: int) -> None:
        self.mcp = mcp
        self.max_body_bytes = max_body_bytes
        # The bearer token already stops DNS-rebinding pages (they cannot know it), and a Host
        # allow-list would break deployments behind a name (docker compose, a proxy).
        self.manager = TenantSessionManager(
            app=mcp.server._lowlevel_server,  # what MCPServer.streamable_http_app() wraps
            json_response=False,  # SSE, so progress notifications reach the client mid-call
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=max_body_bytes,
            max_sessions=mcp.cfg.max_sessions,
            max_sessions_per_tenant=mcp.cfg.max_sessions_per_tenant,
        )
        # Connections answered as plain JSON when the SSE stream would carry only the answer.
        self.plain = PlainClients(mcp.cfg.max_sessions) if mcp.cfg.json_answers else None
        # run_python/get_run of those connections answered without the SDK's machinery (fastcall.py).
        self.fast = FastCalls(mcp, self.manager, self.plain, _owner
                              ) if self.plain is not None and mcp.cfg.fast_calls else None
        if self.fast is not None and not FastCalls.fits(mcp, self.manager):
            log.warning("mcp.fast_calls: this mcp release keeps its connections elsewhere; "
                        "every call goes through the SDK")
            self.fast = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()

        async def run() -> None:
            async with self.manager.run():
                ready.set()
                await self._stop.wait()

        self._task = asyncio.create_task(run(), name="mcp-http")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task.done():
            self._task.result()  # raise what stopped it

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)


class McpHandler(BaseHandler):
    """One ASGI call per HTTP request: POST (JSON-RPC in, JSON or SSE out), GET (the server's
    event stream), DELETE (end the MCP session)."""

    _closed: asyncio.Event
    mcp_http: McpHttp

    def initialize(self, services: Services, mcp_http: McpHttp | None = None) -> None:
        super().initialize(services)
        assert mcp_http is not None, "the /mcp route is given its McpHttp"
        self.mcp_http = mcp_http

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")

    def prepare(self) -> None:
        self._closed = asyncio.Event()
        # SSE answers are several writes: Nagle would hold the later ones for the client's ACK.
        # (tornado turns it back on after each request.)
        self.request.connection.stream.set_nodelay(True)  # type: ignore[union-attr]
        super().prepare()  # the bearer token, then prepare_body

    def prepare_body(self) -> None:
        cap = self.mcp_http.max_body_bytes
        length = int(self.request.headers.get("Content-Length", "0") or 0)
        if length > cap:
            raise PayloadTooLarge(f"the MCP request is {length} bytes, over this server's limit of {cap}")
        if isinstance(self.request.connection, HTTP1Connection):
            self.request.connection.set_max_body_size(cap + 1)

    def on_connection_close(self) -> None:
        self._closed.set()

    async def get(self) -> None:
        await self._asgi()

    async def post(self) -> None:
        await self._asgi()

    async def delete(self) -> None:
        await self._asgi()

    async def _asgi(self) -> None:
        body = self.body  # at most max_body_bytes + 1 (the connection's cap)
        if len(body) > self.mcp_http.max_body_bytes:
            raise PayloadTooLarge(f"the MCP request is over this server's limit of "
                                  f"{self.mcp_http.max_body_bytes} bytes")
        req = self.request
        fast = self.mcp_http.fast
        if fast is not None and req.method == "POST":
            call = fast.match(req.headers, body, self.principal.tenant)
            if call is not None:
                await self._fast_answer(fast, call)
                return
        host, _, port = (req.host or "").rpartition(":")
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": req.protocol, "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query.encode("latin-1"), "root_path": "",
            # The caller's tenant, from its token; never a header the client sent itself.
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers.get_all()
                        if k.lower() != TENANT_HEADER] + [(TENANT_HEADER.encode(), self.principal.tenant.encode())],
            "client": (req.remote_ip, 0), "server": (host or req.host, int(port) if port.isdigit() else 80),
            "state": {},
            # The SDK binds the MCP connection to this user and serves it to no other.
            "user": tenant_user(self.principal.tenant),
        }
        body_sent = False
        plain = self.mcp_http.plain
        opening = plain_client(body) if plain is not None and req.method == "POST" else None
        mcp_sid = req.headers.get(SESSION_HEADER)
        # Buffer the SSE answer and send its response as JSON: the client then keeps the connection.
        buffered: list[bytes] | None = (
            [] if plain is not None and req.method == "POST" and mcp_sid in plain and not wants_stream(body)
            else None)
        if plain is not None and req.method == "DELETE" and mcp_sid:
            plain.discard(mcp_sid)

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self._closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.set_status(message["status"])
                self.clear_header("Content-Type")
                for k, v in message.get("headers", []):
                    self.add_header(k.decode("latin-1"), v.decode("latin-1"))
                    if opening and k.lower() == SESSION_HEADER.encode() and plain is not None:
                        plain.add(v.decode("latin-1"), self.mcp_http.manager._server_instances)
            elif message["type"] == "http.response.body" and buffered is not None:
                buffered.append(message.get("body") or b"")
                if not message.get("more_body"):
                    self._send_plain(b"".join(buffered))
            elif message["type"] == "http.response.body" and not self._closed.is_set():
                if message.get("body"):
                    self.write(message["body"])
                if message.get("more_body"):
                    try:
                        await self.flush()
                    except StreamClosedError:
                        self._closed.set()

        await self.mcp_http.manager.handle_request(scope, receive, send)
        if not self._finished and not self._closed.is_set():
            self.finish()

    async def _fast_answer(self, fast: FastCalls, call: FastCall) -> None:
        """A fast call's answer: one JSON body, with the connection's id as the SDK sends it."""
        answer = await fast.answer(call, self.principal.tenant)
        self.services.metrics.mcp_fast_calls.inc()
        if self._closed.is_set():
            return
        self.set_header("Content-Type", "application/json")
        self.set_header(SESSION_HEADER, call.mcp_session)
        self.finish(answer)

    def _send_plain(self, stream: bytes) -> None:
        """Write a buffered answer: an SSE stream's one JSON-RPC response as a JSON body, anything
        else (an error body, a stream without a single response) as it came."""
        if self._closed.is_set():
            return
        answer = sse_answer(stream) if self._headers.get("Content-Type", "").startswith("text/event-stream") else None
        if answer is None:
            self.write(stream)
            return
        self.set_header("Content-Type", "application/json")
        self.clear_header("Connection")  # the SSE answer's "keep-alive": HTTP/1.1 keeps it anyway
        self.write(answer)
