"""MCP at the wire, for tests that must send bytes the SDK client would not (a lone surrogate
escape, a malformed body): one initialized connection and the answers read back."""

from __future__ import annotations

import json

import httpx

MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def rpc_answer(r: httpx.Response) -> dict:
    """The JSON-RPC message of an MCP answer (plain JSON or one server-sent event)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        return dict(json.loads(data[-1]))
    return dict(r.json())


def initialize(c: httpx.Client) -> dict[str, str]:
    """Open an MCP connection on ``c`` (initialize, then initialized); its session header."""
    r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}})
    assert r.status_code == 200, r.text
    sess = {"Mcp-Session-Id": r.headers["mcp-session-id"]}
    c.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=sess)
    return sess
