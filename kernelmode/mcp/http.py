"""Serve the MCP SDK's streamable-HTTP transport at /mcp on the REST port (tornado).

The SDK speaks ASGI; this handler hands it each request as an ASGI call, behind the same bearer
token as the REST API. The protocol itself (sessions, SSE framing, JSON-RPC) is all the SDK's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..api.handlers import BaseHandler
from ..errors import PayloadTooLarge
from .server import TENANT_HEADER, KernelmodeMCP


class McpHttp:
    """The streamable-HTTP session manager and the task that keeps it running."""

    def __init__(self, mcp: KernelmodeMCP, max_body_bytes: int) -> None:
        self.mcp = mcp
        self.max_body_bytes = max_body_bytes
        # The bearer token already stops DNS-rebinding pages (they cannot know it), and a Host
        # allow-list would break deployments behind a name (docker compose, a proxy).
        self.manager = StreamableHTTPSessionManager(
            app=mcp.server._lowlevel_server,  # what MCPServer.streamable_http_app() wraps
            json_response=False,  # SSE, so progress notifications reach the client mid-call
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=max_body_bytes,
        )
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

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")

    def prepare(self) -> None:
        self._closed = asyncio.Event()
        super().prepare()  # the bearer token, then prepare_body

    def prepare_body(self) -> None:
        cap = self.app.mcp_http.max_body_bytes
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
        if len(body) > self.app.mcp_http.max_body_bytes:
            raise PayloadTooLarge(f"the MCP request is over this server's limit of "
                                  f"{self.app.mcp_http.max_body_bytes} bytes")
        req = self.request
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
        }
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self._closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.set_status(message["status"])
                self.clear_header("Content-Type")
                for k, v in message.get("headers", []):
                    self.add_header(k.decode("latin-1"), v.decode("latin-1"))
            elif message["type"] == "http.response.body" and not self._closed.is_set():
                if message.get("body"):
                    self.write(message["body"])
                if message.get("more_body"):
                    try:
                        await self.flush()
                    except StreamClosedError:
                        self._closed.set()

        await self.app.mcp_http.manager.handle_request(scope, receive, send)
        if not self._finished and not self._closed.is_set():
            self.finish()
