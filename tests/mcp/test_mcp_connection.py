"""/mcp answers a call as plain JSON when its SSE stream would carry only the answer, so the SDK
client keeps its TCP connection (it closes an SSE answer before its end, which drops it); a
client that asks for progress, or declared elicitation, still gets SSE."""

from __future__ import annotations

import json
from typing import Any

import httpx2
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Server


def _recorder(seen: list[tuple[str, str, Any]]) -> Any:
    """A response hook noting (JSON-RPC method, Content-Type, local address) of each POST."""

    async def hook(response: httpx2.Response) -> None:
        if response.request.method != "POST":
            return
        try:
            method = json.loads(response.request.content).get("method", "")
        except (ValueError, AttributeError):
            method = ""
        stream = response.extensions.get("network_stream")
        local = stream.get_extra_info("client_addr") if stream is not None else None
        seen.append((method, response.headers.get("content-type", ""), local))

    return hook


async def _calls(server: Server, **client_kw: Any) -> list[tuple[str, str, Any]]:
    seen: list[tuple[str, str, Any]] = []
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {server.token}"},
                              timeout=httpx2.Timeout(30, read=300),
                              event_hooks={"response": [_recorder(seen)]})
    try:
        async with Client(streamable_http_client(server.url + "/mcp", http_client=http), **client_kw) as c:
            r = await c.call_tool("run_python", {"code": "x = 20"})
            assert r.structured_content and r.structured_content["status"] == "ok"
            for i in range(3):
                r = await c.call_tool("run_python", {"code": f"x + {i}"})
                assert r.structured_content and r.structured_content["result"] == str(20 + i)
            await c.call_tool("close_session", {})
    finally:
        await http.aclose()
    return [s for s in seen if s[0] == "tools/call"]


async def test_plain_client_keeps_one_connection(server: Server) -> None:
    calls = await _calls(server)
    assert len(calls) == 5
    assert all(ctype.startswith("application/json") for _, ctype, _ in calls), calls
    # One TCP connection for the calls after the first: the same local address each time (the
    # first may take another pooled connection while the client still sets up its event stream).
    assert len({local for _, _, local in calls[1:]}) == 1, calls


async def test_client_that_can_be_asked_gets_sse(server: Server) -> None:
    async def elicit(*_: Any) -> Any:  # never called here: declaring it is what counts
        raise AssertionError("no elicitation expected")

    calls = await _calls(server, elicitation_callback=elicit)
    assert len(calls) == 5
    assert all(ctype.startswith("text/event-stream") for _, ctype, _ in calls), calls
