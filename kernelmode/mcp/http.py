"""Serve the MCP SDK's streamable-HTTP transport at /mcp on the REST port (tornado).

The SDK speaks ASGI; this handler hands it each request as an ASGI call to its session
manager's public ``handle_request`` (the manager made by ``MCPServer.streamable_http_app``),
behind the same bearer token as the REST API. The protocol itself (sessions, SSE framing,
JSON-RPC) is all the SDK's; no attribute of the SDK that starts with ``_`` is touched
(tests/unit/test_mcp_public_api.py).

Each MCP connection (``Mcp-Session-Id``) belongs to the tenant that opened it: the request's
ASGI scope carries the tenant as the SDK's authenticated user, and the SDK answers another
tenant's request for that id exactly like an unknown id (404, so no DELETE either). The number
of open connections is capped per tenant as well as in all, and idle connections are closed,
by this front door's own table (open_connections.py), since the SDK's is private.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.transport_security import TransportSecuritySettings
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..api.forwarding import FORWARDED_HEADER
from ..api.handlers import BaseHandler
from ..errors import ManagerGone, PayloadTooLarge
from ..services import Services
from . import oversize
from .app import KernelmodeMCP
from .connections import SESSION_HEADER, TENANT_HEADER
from .fastcall import FastCall, FastCalls
from .open_connections import OpenConnections
from .plain import plain_client, sse_answer, wants_stream

log = logging.getLogger("kernelmode.mcp")

# The SDK's own answer when no more connections may open (mcp.server.streamable_http_manager).
_TOO_MANY = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"Too many open sessions"}}'
# ... and for an id it does not hold: the client opens a new connection (MCP spec, session management).
_UNKNOWN = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Session not found"}}'


def tenant_user(tenant: str) -> AuthenticatedUser:
    """The SDK's authenticated user for a tenant: the SDK binds each MCP connection to the user
    that opened it (its ``client_id``). No token in it: tools never need the caller's secret."""
    return AuthenticatedUser(AccessToken(token="", client_id=tenant, scopes=[]))


class McpHttp:
    """The SDK's streamable-HTTP session manager, the task that keeps it running, the table of
    open connections and the task that closes idle ones."""

    def __init__(self, mcp: KernelmodeMCP, max_body_bytes: int) -> None:
        self.mcp = mcp
        self.max_body_bytes = max_body_bytes
        # An oversized body is read to its end (and dropped) up to this, so that the answer can
        # be an MCP one on a connection the client keeps (oversize.py); beyond, it is cut off.
        self.drain_limit = max(4 * max_body_bytes, 256 << 20)
        # The bearer token already stops DNS-rebinding pages (they cannot know it), and a Host
        # allow-list would break deployments behind a name (docker compose, a proxy).
        mcp.server.streamable_http_app(
            json_response=False,  # SSE, so progress notifications reach the client mid-call
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=max_body_bytes,
            max_sessions=mcp.cfg.max_sessions,
            session_idle_timeout=None,  # OpenConnections keeps the countdown (fast calls hold it too)
        )
        self.manager = mcp.server.session_manager
        self.conns = OpenConnections(mcp.cfg.max_sessions, mcp.cfg.max_sessions_per_tenant)
        # run_python/get_run of plain connections answered without the SDK's machinery (fastcall.py).
        self.fast = FastCalls(mcp) if mcp.cfg.json_answers and mcp.cfg.fast_calls else None
        # Several managers: where each connection opened here is recorded (api/forwarding.py).
        self.record: Callable[[str], None] | None = None
        self.forget: Callable[[str], None] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None

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
        self._reaper = asyncio.create_task(self._close_idle(), name="mcp-idle")

    async def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.cancel()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)

    async def _close_idle(self) -> None:
        """Close idle connections through the SDK, as their owner's DELETE would."""
        period = min(60.0, self.conns.idle_seconds / 4)
        while not self._stop.is_set():
            await asyncio.sleep(period)
            for sid, tenant in self.conns.idle():
                try:
                    await self.close(sid, tenant)
                except Exception:  # one connection's failure must not stop the reaper
                    log.exception("could not close idle MCP connection %s", sid[:16])
                    self.gone(sid)

    async def close(self, sid: str, tenant: str) -> int | None:
        """End a connection with a DELETE of its owner, through the SDK's public entry point;
        the HTTP status the SDK answered."""
        status: int | None = None
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "DELETE",
            "scheme": "http", "path": "/mcp", "raw_path": b"/mcp", "query_string": b"", "root_path": "",
            "headers": [(SESSION_HEADER.encode(), sid.encode())], "client": None, "server": None,
            "state": {}, "user": tenant_user(tenant)}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await self.manager.handle_request(scope, receive, send)
        self.gone(sid)
        return status

    def gone(self, sid: str) -> None:
        """A connection ended (its owner's DELETE, idle, or unknown to the SDK)."""
        self.conns.gone(sid)
        if self.forget is not None:
            self.forget(sid)


class McpHandler(BaseHandler):
    """One ASGI call per HTTP request: POST (JSON-RPC in, JSON or SSE out), GET (the server's
    event stream), DELETE (end the MCP session)."""

    _closed: asyncio.Event
    _oversize: oversize.OversizeBody | None
    _received: int
    mcp_http: McpHttp

    def initialize(self, services: Services, mcp_http: McpHttp | None = None) -> None:
        super().initialize(services)
        assert mcp_http is not None, "the /mcp route is given its McpHttp"
        self.mcp_http = mcp_http

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")

    def prepare(self) -> None:
        self._closed = asyncio.Event()
        self._oversize = None
        self._received = 0
        # SSE answers are several writes: Nagle would hold the later ones for the client's ACK.
        # (tornado turns it back on after each request.)
        self.request.connection.stream.set_nodelay(True)  # type: ignore[union-attr]
        super().prepare()  # the bearer token, then prepare_body

    def prepare_body(self) -> None:
        limit = self.mcp_http.drain_limit
        length = int(self.request.headers.get("Content-Length", "0") or 0)
        if length > limit:
            raise PayloadTooLarge(f"the MCP request is {length} bytes, over this server's limit of "
                                  f"{self.mcp_http.max_body_bytes}")
        if isinstance(self.request.connection, HTTP1Connection):
            self.request.connection.set_max_body_size(limit)

    def forward_target(self) -> str | None:
        """Another manager's connection (its id recorded in the store): its URL. A forwarded
        request is served here, where the SDK answers an id it does not hold with a 404."""
        router, sid = self.services.router, self.request.headers.get(SESSION_HEADER)
        if router is None or sid is None or self.mcp_http.conns.get(sid) is not None \
                or FORWARDED_HEADER in self.request.headers:
            return None
        return router.for_mcp(sid)

    def forward_body_limit(self) -> int | None:
        return self.mcp_http.drain_limit

    async def _answer_from_owner(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super()._answer_from_owner(*args, **kwargs)
        except ManagerGone:  # its manager died with the connection: the client opens a new one
            sid, router = self.request.headers.get(SESSION_HEADER), self.services.router
            if sid is not None and router is not None:
                router.forget_mcp(sid)
            if not self._headers_written:
                self._answer(404, _UNKNOWN)

    def data_received(self, chunk: bytes) -> Any:
        if self.relay is not None:
            return self.relay.feed(chunk)
        if self.rejected:
            return None
        self._received += len(chunk)
        if self._oversize is None and self._received > self.mcp_http.max_body_bytes:
            self._oversize = oversize.OversizeBody()  # from here on only its ends are kept
            for kept in self._body_chunks:
                self._oversize.feed(kept)
            self._body_chunks = []
        if self._oversize is not None:
            self._oversize.feed(chunk)
        else:
            self._body_chunks.append(chunk)
        return None

    def on_connection_close(self) -> None:
        self._closed.set()
        super().on_connection_close()

    async def get(self) -> None:
        await self._asgi()

    async def post(self) -> None:
        await self._asgi()

    async def delete(self) -> None:
        await self._asgi()

    async def _asgi(self) -> None:
        req = self.request
        tenant = self.principal.tenant
        conns = self.mcp_http.conns
        sid = req.headers.get(SESSION_HEADER)
        conn = conns.get(sid)
        own = sid if conn is not None and conn.tenant == tenant else None  # else the SDK's 404
        if self._oversize is not None:
            self._answer_oversize(sid, own)
            return
        body = self.body
        fast = self.mcp_http.fast
        if fast is not None and own is not None and req.method == "POST":
            call = fast.match(req.headers, body, conn)
            if call is not None:
                with conns.using(own):
                    await self._fast_answer(fast, call)
                return
        if sid is None and not conns.admit(tenant):
            log.warning("refusing a new MCP connection for tenant %r: at its cap", tenant)
            self._answer(503, _TOO_MANY)
            return
        with conns.using(own):
            status = await self._through_sdk(body, sid, own is not None and conn is not None and conn.plain)
        if own is not None and (status == 404 or (req.method == "DELETE" and status == 200)):
            self.mcp_http.gone(own)  # ended by its owner, or no longer known to the SDK

    async def _through_sdk(self, body: bytes, sid: str | None, plain_conn: bool) -> int | None:
        """Hand the request to the SDK; the HTTP status it answered."""
        req = self.request
        tenant = self.principal.tenant
        host, _, port = (req.host or "").rpartition(":")
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": req.protocol, "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query.encode("latin-1"), "root_path": "",
            # The caller's tenant, from its token; never a header the client sent itself.
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers.get_all()
                        if k.lower() != TENANT_HEADER] + [(TENANT_HEADER.encode(), tenant.encode())],
            "client": (req.remote_ip, 0), "server": (host or req.host, int(port) if port.isdigit() else 80),
            "state": {},
            # The SDK binds the MCP connection to this user and serves it to no other.
            "user": tenant_user(tenant),
        }
        body_sent = False
        json_answers = self.mcp_http.mcp.cfg.json_answers
        opening = sid is None
        plain = opening and json_answers and req.method == "POST" and bool(plain_client(body))
        new_sid: str | None = None
        status: int | None = None
        content_type = ""
        # Buffer the SSE answer and send its response as JSON: the client then keeps the connection.
        buffered: list[bytes] | None = (
            [] if json_answers and plain_conn and req.method == "POST" and not wants_stream(body) else None)

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self._closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal new_sid, status, content_type
            if message["type"] == "http.response.start":
                status = message["status"]
                self.set_status(message["status"])
                self.clear_header("Content-Type")
                for k, v in message.get("headers", []):
                    key, value = k.decode("latin-1"), v.decode("latin-1")
                    self.add_header(key, value)
                    if key.lower() == SESSION_HEADER:
                        new_sid = value
                    elif key.lower() == "content-type":
                        content_type = value
            elif message["type"] == "http.response.body" and buffered is not None:
                buffered.append(message.get("body") or b"")
                if not message.get("more_body"):
                    self._send_plain(b"".join(buffered), content_type)
            elif message["type"] == "http.response.body" and not self._closed.is_set():
                if message.get("body"):
                    self.write(message["body"])
                if message.get("more_body"):
                    try:
                        await self.flush()
                    except StreamClosedError:
                        self._closed.set()

        try:
            await self.mcp_http.manager.handle_request(scope, receive, send)
        finally:
            if opening:  # the SDK keeps a connection it answered below 400 (its `established`)
                if new_sid is not None and status is not None and status < 400:
                    self.mcp_http.conns.opened(new_sid, tenant, plain)
                    if self.mcp_http.record is not None:
                        self.mcp_http.record(new_sid)
                else:
                    self.mcp_http.conns.not_opened(tenant)
        if not self._finished and not self._closed.is_set():
            self.finish()
        return status

    def _answer(self, status: int, body: bytes, sid: str | None = None) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        if sid is not None:
            self.set_header(SESSION_HEADER, sid)
        self.finish(body)

    def _answer_oversize(self, sid: str | None, own: str | None) -> None:
        """An oversized request's MCP answer (oversize.py); its body was read and dropped."""
        assert self._oversize is not None
        if sid is not None and own is None:  # what the SDK answers for an id this caller has not
            self._answer(404, _UNKNOWN)
            return
        with self.mcp_http.conns.using(own):  # activity: the idle countdown starts again
            status, body = oversize.answer(self._oversize, self.mcp_http.max_body_bytes)
        log.info("oversized MCP request (%d bytes) answered in the protocol", self._oversize.size)
        self._answer(status, body, own)

    async def _fast_answer(self, fast: FastCalls, call: FastCall) -> None:
        """A fast call's answer: one JSON body, with the connection's id as the SDK sends it."""
        answer = await fast.answer(call, self.principal.tenant, self.request.headers.get("Authorization", ""))
        self.services.metrics.mcp_fast_calls.inc()
        if self._closed.is_set():
            return
        self._answer(200, answer, call.mcp_session)

    def _send_plain(self, stream: bytes, content_type: str) -> None:
        """Write a buffered answer: an SSE stream's one JSON-RPC response as a JSON body, anything
        else (an error body, a stream without a single response) as it came."""
        if self._closed.is_set():
            return
        answer = sse_answer(stream) if content_type.startswith("text/event-stream") else None
        if answer is None:
            self.write(stream)
            return
        self.set_header("Content-Type", "application/json")
        self.clear_header("Connection")  # the SSE answer's "keep-alive": HTTP/1.1 keeps it anyway
        self.write(answer)
