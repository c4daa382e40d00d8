"""The direct route for run_python/get_run (kernelmode/mcp/fastcall.py): a plain client's calls
take it (counted by ``kernelmode_mcp_fast_calls_total``), its answers are the SDK route's answers,
and what it does not recognise exactly (bad arguments, a progress token, other tools) still goes
through the SDK. The tenant check of the route is attacked in tests/security/test_mcp_tenants.py."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx2
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Server, start_server
from tests.mcp.conftest import Connect, mcp_client

VOLATILE = {"run_id", "duration_ms", "execution_count", "started_at", "ended_at", "created_at"}


def fast_calls(server: Server) -> int:
    """kernelmode_mcp_fast_calls_total of the server (the admin token reads /metrics)."""
    with server.client() as c:
        text = c.get("/metrics").text
    m = re.search(r"^kernelmode_mcp_fast_calls_total (\S+)$", text, re.M)
    assert m is not None, "the counter is exported"
    return int(float(m.group(1)))


def masked(text: str) -> str:
    """Text without what differs between two runs of the same code: ids, counts, times."""
    return re.sub(r"\d+", "N", re.sub(r"[0-9a-f]{32}", "ID", text))


def steady(structured: dict[str, Any] | None) -> str:
    return masked(json.dumps({k: v for k, v in (structured or {}).items() if k not in VOLATILE}, sort_keys=True))


async def _noop_progress(*_: Any) -> None:
    return None


async def test_plain_client_calls_take_the_direct_route(server: Server, mcp_connect: Connect) -> None:
    before = fast_calls(server)
    async with mcp_connect() as c:
        r = await c.call_tool("run_python", {"code": "x = 20"})
        assert r.structured_content and r.structured_content["status"] == "ok"
        r = await c.call_tool("run_python", {"code": "x + 22", "wait_seconds": 5})
        assert r.structured_content and r.structured_content["result"] == "42"
        run_id = r.structured_content["run_id"]
        g = await c.call_tool("get_run", {"run_id": run_id, "wait_seconds": 0})
        assert g.structured_content and g.structured_content["status"] == "ok"
        await c.call_tool("list_sessions", {})  # another tool: the SDK's route
        after = fast_calls(server)
    assert after - before == 3


async def test_answers_are_the_sdk_routes_answers(server: Server, mcp_connect: Connect) -> None:
    code = "print('out'); import sys; print('err', file=sys.stderr); {'k': [1, 2]}"
    async with mcp_connect() as c:
        before = fast_calls(server)
        fast = await c.call_tool("run_python", {"code": code})
        # A progress token sends the call the SDK's way (an SSE answer that can carry progress).
        via_sdk = await c.call_tool("run_python", {"code": code}, progress_callback=_noop_progress)
        assert fast_calls(server) - before == 1
        failing_fast = await c.call_tool("run_python", {"code": "1/0"})
        failing_sdk = await c.call_tool("run_python", {"code": "1/0"}, progress_callback=_noop_progress)
    assert isinstance(fast, type(via_sdk))
    assert fast.is_error is False and via_sdk.is_error is False
    assert steady(fast.structured_content) == steady(via_sdk.structured_content)
    assert [b.type for b in fast.content] == [b.type for b in via_sdk.content]
    # The text differs only in the run's id (and any count): equal once ids and numbers are masked.
    mask = lambda r: [masked(getattr(b, "text", "")) for b in r.content]  # noqa: E731
    assert mask(fast) == mask(via_sdk)
    assert failing_fast.is_error and failing_sdk.is_error
    assert steady(failing_fast.structured_content) == steady(failing_sdk.structured_content)
    assert mask(failing_fast) == mask(failing_sdk)


async def test_what_it_does_not_recognise_goes_to_the_sdk(server: Server, mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        before = fast_calls(server)
        bad = await c.call_tool("run_python", {"code": ""})  # the schema refuses it: the SDK answers
        assert bad.is_error
        text = " ".join(getattr(b, "text", "") for b in bad.content)
        assert "code" in text and "Error executing tool run_python" in text
        unknown = await c.call_tool("run_python", {"code": "1", "session_id": "nope"})  # the tool refuses
        assert unknown.is_error and "unknown session" in " ".join(getattr(b, "text", "") for b in unknown.content)
        assert fast_calls(server) - before == 1  # only the second (valid arguments) came the direct way


async def test_a_client_that_can_be_asked_never_takes_it(server: Server) -> None:
    async def elicit(*_: Any) -> Any:
        raise AssertionError("no elicitation expected")

    before = fast_calls(server)
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {server.token}"}, timeout=httpx2.Timeout(30, read=300))
    try:
        async with Client(streamable_http_client(server.url + "/mcp", http_client=http),
                          elicitation_callback=elicit) as c:
            r = await c.call_tool("run_python", {"code": "6 * 7"})
            assert r.structured_content and r.structured_content["result"] == "42"
            await c.call_tool("close_session", {})
    finally:
        await http.aclose()
    assert fast_calls(server) == before


async def test_the_route_can_be_switched_off() -> None:
    srv = start_server({"KERNELMODE_MCP__FAST_CALLS": "false", "KERNELMODE_SESSIONS__POOL_SIZE": "0"})
    try:
        async with mcp_client(srv) as c:
            assert isinstance(c, Client)
            r = await c.call_tool("run_python", {"code": "6 * 7"})
            assert r.structured_content and r.structured_content["result"] == "42"
        assert fast_calls(srv) == 0
    finally:
        srv.discard()
