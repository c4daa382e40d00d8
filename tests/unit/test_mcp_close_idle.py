"""McpHttp closes a connection (the idle reaper's way) through the SDK's public entry point, as its
owner's DELETE would: afterwards the SDK answers 404 for the id, and the table frees its place.
In process, with the real SDK session manager; no kernel is needed for initialize."""

from __future__ import annotations

import json
from typing import Any

from kernelmode.config import Settings
from kernelmode.mcp.app import KernelmodeMCP
from kernelmode.mcp.http import McpHttp, tenant_user
from kernelmode.tools.registry import ToolRegistry

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}


async def request(http: McpHttp, method: str, body: dict[str, Any] | None, sid: str | None) -> tuple[int, dict[str, str]]:
    headers = [(b"accept", b"application/json, text/event-stream"), (b"content-type", b"application/json")]
    if sid is not None:
        headers.append((b"mcp-session-id", sid.encode()))
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": "/mcp", "raw_path": b"/mcp", "query_string": b"", "root_path": "",
             "headers": headers, "client": None, "server": None, "state": {}, "user": tenant_user("alpha")}
    answer: dict[str, Any] = {}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {k.decode(): v.decode() for k, v in message.get("headers", [])}

    await http.manager.handle_request(scope, receive, send)
    return answer["status"], answer["headers"]


async def no_services() -> Any:
    raise AssertionError("initialize needs no service")


async def test_close_ends_the_connection_in_the_sdk_and_frees_its_place() -> None:
    kmcp = KernelmodeMCP(Settings(), ToolRegistry(), no_services)
    http = McpHttp(kmcp, 1 << 20)
    await http.start()
    try:
        assert http.conns.admit("alpha")
        status, headers = await request(http, "POST", INIT, None)
        assert status == 200
        sid = headers["mcp-session-id"]
        http.conns.opened(sid, "alpha", plain=True)
        assert http.conns.open_count("alpha") == 1
        assert await http.close(sid, "alpha") == 200
        assert http.conns.open_count("alpha") == 0
        status, _ = await request(http, "POST", {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid)
        assert status == 404  # the SDK no longer knows it
    finally:
        await http.stop()
