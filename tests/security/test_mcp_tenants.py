"""MCP connections belong to their tenant: another tenant's token naming a connection's
``Mcp-Session-Id`` is answered like an unknown id (404) and cannot end it; the cap on open MCP
connections is per tenant, so one tenant at its cap does not lock the others out; an oversized
request is answered (in the protocol) to the connection's owner only.

Attacks with raw HTTP against the real server's /mcp (the SDK client hides the session id),
and the real MCP SDK client for the tenant that must still get in.
"""

from __future__ import annotations

import json
import re
import secrets

import httpx

from tests.conftest import Server
from tests.mcp.conftest import mcp_client

from .conftest import ALPHA, BETA
from .conftest import MCP_PER_TENANT as PER_TENANT

ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
VERSION = "2025-06-18"


def rpc(method: str, params: dict | None = None, id_: int | None = 1) -> dict:
    msg: dict = {"jsonrpc": "2.0", "method": method, "params": params or {}}
    if id_ is not None:
        msg["id"] = id_
    return msg


def answer(r: httpx.Response) -> dict:
    """The JSON-RPC message of a response (an SSE event or plain JSON)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        return json.loads(next(d for d in data if d))
    return r.json()


def open_connection(tenant_server: Server, token: str) -> httpx.Response:
    """initialize (+ initialized) on a new MCP connection; the response carries its id."""
    with tenant_server.client(token) as c:
        r = c.post("/mcp", headers=ACCEPT, json=rpc("initialize", {
            "protocolVersion": VERSION, "capabilities": {},
            "clientInfo": {"name": "attacker", "version": "0"}}))
        if r.status_code == 200:
            sid = r.headers["mcp-session-id"]
            done = c.post("/mcp", headers={**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION},
                          json=rpc("notifications/initialized", id_=None))
            assert done.status_code == 202, done.text
        return r


def list_tools(tenant_server: Server, token: str, sid: str) -> httpx.Response:
    with tenant_server.client(token) as c:
        return c.post("/mcp", headers={**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION},
                      json=rpc("tools/list", id_=2))


def close(tenant_server: Server, token: str, sid: str) -> httpx.Response:
    with tenant_server.client(token) as c:
        return c.delete("/mcp", headers={"mcp-session-id": sid, "mcp-protocol-version": VERSION})


def test_another_tenant_cannot_use_or_end_a_connection(tenant_server: Server) -> None:
    r = open_connection(tenant_server, ALPHA)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    try:
        mine = list_tools(tenant_server, ALPHA, sid)
        assert mine.status_code == 200 and "run_python" in mine.text
        unknown = list_tools(tenant_server, BETA, secrets.token_hex(16))
        assert unknown.status_code == 404
        # beta naming alpha's connection: exactly the answer for an id nobody has.
        stolen = list_tools(tenant_server, BETA, sid)
        assert stolen.status_code == 404, stolen.text
        assert answer(stolen)["error"] == answer(unknown)["error"]
        assert "run_python" not in stolen.text
        assert close(tenant_server, BETA, sid).status_code == 404
        # The admin token is a tenant of its own here: it cannot take the connection over either.
        assert list_tools(tenant_server, tenant_server.token, sid).status_code == 404
        # alpha's connection is untouched.
        again = list_tools(tenant_server, ALPHA, sid)
        assert again.status_code == 200 and "run_python" in again.text
    finally:
        assert close(tenant_server, ALPHA, sid).status_code == 200
    assert list_tools(tenant_server, ALPHA, sid).status_code == 404  # ended by its owner


async def test_the_connection_cap_is_per_tenant(tenant_server: Server) -> None:
    held = []
    try:
        for _ in range(PER_TENANT):
            r = open_connection(tenant_server, ALPHA)
            assert r.status_code == 200, r.text
            held.append(r.headers["mcp-session-id"])
        refused = open_connection(tenant_server, ALPHA)
        assert refused.status_code == 503, refused.text
        assert "too many" in refused.text.lower()
        # beta still gets in, with the real SDK client, and works.
        async with mcp_client(tenant_server, token=BETA, close=False) as client:
            tools = await client.list_tools()
            assert "run_python" in {t.name for t in tools.tools}
        # alpha's connections still work, and closing one makes room for another.
        assert list_tools(tenant_server, ALPHA, held[0]).status_code == 200
        assert close(tenant_server, ALPHA, held.pop()).status_code == 200
        r = open_connection(tenant_server, ALPHA)
        assert r.status_code == 200, r.text
        held.append(r.headers["mcp-session-id"])
    finally:
        for sid in held:
            close(tenant_server, ALPHA, sid)


def fast_calls(tenant_server: Server) -> int:
    with tenant_server.client() as c:
        m = re.search(r"^kernelmode_mcp_fast_calls_total (\S+)$", c.get("/metrics").text, re.M)
    assert m is not None
    return int(float(m.group(1)))


def run_python(tenant_server: Server, token: str, sid: str, code: str, id_: int) -> httpx.Response:
    with tenant_server.client(token) as c:
        return c.post("/mcp", headers={**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION},
                      json=rpc("tools/call", {"name": "run_python", "arguments": {"code": code}}, id_=id_))


def test_the_direct_route_serves_no_other_tenant(tenant_server: Server) -> None:
    """run_python on alpha's connection is answered on the direct route (mcp.fast_calls) for
    alpha; beta (and the admin) naming that connection get the unknown-id 404 and reach neither
    alpha's kernel nor the route."""
    r = open_connection(tenant_server, ALPHA)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    try:
        before = fast_calls(tenant_server)
        mine = run_python(tenant_server, ALPHA, sid, "secret = 'alpha-' + 'xyz'; secret", 3)
        assert mine.status_code == 200 and "alpha-xyz" in mine.text, mine.text
        assert mine.headers["content-type"].startswith("application/json")
        assert fast_calls(tenant_server) == before + 1  # the route was taken
        unknown = run_python(tenant_server, BETA, secrets.token_hex(16), "1", 4)
        assert unknown.status_code == 404
        for token in (BETA, tenant_server.token):
            stolen = run_python(tenant_server, token, sid, "secret", 5)
            assert stolen.status_code == 404, stolen.text
            assert answer(stolen)["error"] == answer(unknown)["error"]
            assert "alpha-xyz" not in stolen.text
        # A forged tenant header changes nothing: the tenant comes from the token.
        with tenant_server.client(BETA) as c:
            forged = c.post("/mcp", headers={**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION,
                                             "x-kernelmode-tenant": "alpha"},
                            json=rpc("tools/call", {"name": "run_python", "arguments": {"code": "secret"}}, id_=6))
        assert forged.status_code == 404 and "alpha-xyz" not in forged.text
        assert fast_calls(tenant_server) == before + 1
        again = run_python(tenant_server, ALPHA, sid, "secret", 7)
        assert again.status_code == 200 and "alpha-xyz" in again.text
    finally:
        with tenant_server.client(ALPHA) as c:
            c.post("/mcp", headers={**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION},
                   json=rpc("tools/call", {"name": "close_session", "arguments": {}}, id_=8))
        assert close(tenant_server, ALPHA, sid).status_code == 200


def test_an_oversized_request_is_answered_in_the_protocol_to_its_owner_only(tenant_server: Server) -> None:
    """A body over mcp.max_request_bytes is read and dropped, then answered as MCP (issue 32):
    to the connection's owner with its JSON-RPC id; to another token naming that connection with
    the unknown-id 404, as the SDK would; nothing of it runs."""
    r = open_connection(tenant_server, ALPHA)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    big = (b'{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"upload_file",'
           b'"arguments":{"filename":"x.bin","content_base64":"' + b"A" * (33 << 20) + b'"}}}')
    headers = {**ACCEPT, "mcp-session-id": sid, "mcp-protocol-version": VERSION}
    try:
        with tenant_server.client(BETA) as c:
            stolen = c.post("/mcp", headers=headers, content=big)
        assert stolen.status_code == 404, stolen.text
        assert "upload_file" not in stolen.text and "max_request_bytes" not in stolen.text
        with tenant_server.client(ALPHA) as c:
            mine = c.post("/mcp", headers=headers, content=big)
        assert mine.status_code == 200, mine.text
        msg = answer(mine)
        assert msg["id"] == 11 and msg["result"]["isError"] is True
        assert "max_request_bytes" in msg["result"]["content"][0]["text"]
        assert list_tools(tenant_server, ALPHA, sid).status_code == 200  # the connection goes on
    finally:
        close(tenant_server, ALPHA, sid)
