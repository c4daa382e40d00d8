"""Tenants: each token sees only its own sessions, on every front door; quotas per tenant.

One server with an admin token and three tenant tokens; the attacks are made by a real client
of another tenant, against real sessions (REST, the console websocket, and MCP through the SDK).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import httpx
import httpx2
import pytest
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from kernelmode.config import load_settings
from kernelmode.errors import ConfigError
from tests.conftest import Server, start_server
from tests.mcp.conftest import mcp_client

ALPHA, BETA, GAMMA = (secrets.token_urlsafe(18) for _ in range(3))
TENANTS = (f"[{{name: alpha, token: '{ALPHA}', max_sessions: 2}}, {{name: beta, token: '{BETA}'}}, "
           f"{{name: gamma, token: '{GAMMA}', runs_per_minute: 3}}]")


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server({"KERNELMODE_SERVER__TENANTS": TENANTS, "KERNELMODE_SESSIONS__POOL_SIZE": "1"})
    yield s
    s.discard()


@pytest.fixture(scope="module")
def alpha(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(ALPHA) as c:
        yield c


@pytest.fixture(scope="module")
def beta(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(BETA) as c:
        yield c


@pytest.fixture(scope="module")
def alpha_sid(alpha: httpx.Client) -> Iterator[str]:
    """A session of alpha's with a variable, a workspace file and a finished run."""
    r = alpha.post("/v1/sessions", json={"session_id": "alpha-own"})
    assert r.status_code == 201, r.text
    assert r.json()["tenant"] == "alpha"
    res = alpha.post("/v1/sessions/alpha-own/execute", json={"code": "secret = 41\nsecret + 1"}).json()
    assert res["status"] == "ok" and res["result"] == "42", res
    assert alpha.put("/v1/sessions/alpha-own/files/data.txt", content=b"alpha only").status_code == 201
    yield "alpha-own"
    alpha.delete("/v1/sessions/alpha-own")


def _same_as_unknown(r: httpx.Response, unknown: httpx.Response, sid: str, other: str) -> None:
    """The answer for another tenant's id is the answer for an id nobody has (but for the id)."""
    assert r.status_code == unknown.status_code == 404, (r.text, unknown.text)
    assert r.json()["error"]["code"] == unknown.json()["error"]["code"]
    assert r.json()["error"]["message"].replace(sid, other) == unknown.json()["error"]["message"]


def test_another_tenants_session_is_an_unknown_id_on_every_route(
        srv: Server, alpha: httpx.Client, beta: httpx.Client, alpha_sid: str) -> None:
    routes = [("GET", ""), ("DELETE", ""), ("POST", "/execute"), ("POST", "/interrupt"),
              ("POST", "/restart"), ("GET", "/files"), ("GET", "/files/data.txt"),
              ("PUT", "/files/data.txt"), ("GET", "/artifacts"), ("GET", "/notebook")]
    for method, tail in routes:
        body = {"json": {"code": "secret"}} if tail == "/execute" else (
            {"content": b"overwritten"} if method == "PUT" else {})
        r = beta.request(method, f"/v1/sessions/{alpha_sid}{tail}", **body)
        unknown = beta.request(method, f"/v1/sessions/nobody-has-it{tail}", **body)
        _same_as_unknown(r, unknown, alpha_sid, "nobody-has-it")
    # The console websocket: refused before the upgrade, as for an unknown id.
    ws = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
          "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Authorization": f"Bearer {BETA}"}
    r = httpx.get(f"{srv.url}/v1/sessions/{alpha_sid}/channels", headers=ws)
    unknown = httpx.get(f"{srv.url}/v1/sessions/nobody-has-it/channels", headers=ws)
    _same_as_unknown(r, unknown, alpha_sid, "nobody-has-it")
    # Nothing of alpha's was touched: the variable, the file and the session are as they were.
    res = alpha.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": "secret"}).json()
    assert res["result"] == "41", res
    assert alpha.get(f"/v1/sessions/{alpha_sid}/files/data.txt").content == b"alpha only"
    assert alpha.get(f"/v1/sessions/{alpha_sid}").json()["status"] == "idle"


def test_another_tenants_run_is_unknown(alpha: httpx.Client, beta: httpx.Client, alpha_sid: str) -> None:
    res = alpha.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": "'still mine'"}).json()
    run_id = res["run_id"]
    assert alpha.get(f"/v1/runs/{run_id}").status_code == 200
    r = beta.get(f"/v1/runs/{run_id}")
    unknown = beta.get(f"/v1/runs/{'0' * 32}")
    _same_as_unknown(r, unknown, run_id, "0" * 32)


def test_listing_is_per_tenant_and_admin_sees_all(
        srv: Server, alpha: httpx.Client, beta: httpx.Client, alpha_sid: str) -> None:
    r = beta.post("/v1/sessions", json={"session_id": "beta-own"})
    assert r.status_code == 201 and r.json()["tenant"] == "beta"
    try:
        beta_ids = {s["session_id"] for s in beta.get("/v1/sessions").json()["sessions"]}
        alpha_ids = {s["session_id"] for s in alpha.get("/v1/sessions").json()["sessions"]}
        assert "beta-own" in beta_ids and alpha_sid not in beta_ids
        assert alpha_sid in alpha_ids and "beta-own" not in alpha_ids
        with srv.client() as admin:
            every = {s["session_id"]: s["tenant"] for s in admin.get("/v1/sessions").json()["sessions"]}
            assert every[alpha_sid] == "alpha" and every["beta-own"] == "beta"
            # The admin reaches any tenant's session.
            before = admin.get("/metrics").text
            res = admin.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": "secret"}).json()
            assert res["result"] == "41"
            beta.post("/v1/sessions/beta-own/execute", json={"code": "1/0"})
            after = admin.get("/metrics")
            assert after.status_code == 200
            # Counted under the session's tenant (whoever sent the run).
            for labels in ('source="api",status="ok",tenant="alpha"', 'source="api",status="error",tenant="beta"'):
                assert _sample(after.text, "kernelmode_runs_total", labels) == \
                    _sample(before, "kernelmode_runs_total", labels) + 1, labels
            assert _sample(after.text, "kernelmode_sessions_created_total", 'from_pool="true",tenant="beta"') + \
                _sample(after.text, "kernelmode_sessions_created_total", 'from_pool="false",tenant="beta"') >= 1
        # Metrics span every tenant: the admin's only.
        r = beta.get("/metrics")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    finally:
        beta.delete("/v1/sessions/beta-own")


@pytest.fixture()
def beta_three(beta: httpx.Client) -> Iterator[list[str]]:
    """Three sessions of beta's, in creation order."""
    own = [f"beta-page-{i}" for i in range(3)]
    for sid in own:
        assert beta.post("/v1/sessions", json={"session_id": sid}).status_code == 201
    yield own
    for sid in own:
        beta.delete(f"/v1/sessions/{sid}")


def test_listing_pages_and_cursors_stay_within_the_tenant(
        alpha: httpx.Client, beta: httpx.Client, alpha_sid: str, beta_three: list[str]) -> None:
    walked, cursor, beta_cursor = [], None, None
    while True:
        body = beta.get("/v1/sessions", params={"limit": 1, **({"cursor": cursor} if cursor else {})}).json()
        walked += [s["session_id"] for s in body["sessions"]]
        cursor = beta_cursor = body["next_cursor"] or beta_cursor
        if body["next_cursor"] is None:
            break
    assert walked == beta_three  # beta's own, in creation order, each once; nothing of alpha's
    # beta's cursor is no position in alpha's listing: refused, and alpha's listing shows none of beta's.
    r = alpha.get("/v1/sessions", params={"cursor": beta_cursor})
    assert r.status_code == 422 and "another tenant" in r.json()["error"]["message"], r.text
    alpha_ids = [s["session_id"] for s in alpha.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]]
    assert alpha_sid in alpha_ids and not set(alpha_ids) & set(beta_three)


async def test_mcp_list_sessions_pages_within_the_tenant(srv: Server, alpha_sid: str, beta_three: list[str]) -> None:
    async with mcp_client(srv, token=BETA) as client:
        seen, args, answers = [], {"limit": 2}, 0
        while True:
            text = (await client.call_tool("list_sessions", args)).content[0].text
            answers += 1
            assert alpha_sid not in text
            seen += [sid for sid in re.findall(r"^- (\S+):", text, re.M) if sid in beta_three]
            if "More sessions remain" not in text:
                break
            args = {"limit": 2, "cursor": text.split("cursor='")[1].split("'")[0]}
        # beta's three, newest first (an agent's latest sessions on the first page): two pages.
        assert seen == beta_three[::-1] and answers == 2
        refused = await client.call_tool("list_sessions", {"limit": 0})
        assert refused.is_error


def test_closed_session_records_stay_the_tenants(alpha: httpx.Client, beta: httpx.Client) -> None:
    assert alpha.post("/v1/sessions", json={"session_id": "alpha-closed"}).status_code == 201
    alpha.post("/v1/sessions/alpha-closed/execute", json={"code": "open('/mnt/data/r.txt','w').write('x')"})
    assert alpha.delete("/v1/sessions/alpha-closed").status_code == 204
    assert alpha.get("/v1/sessions/alpha-closed/artifacts").status_code == 200
    assert alpha.get("/v1/sessions/alpha-closed/notebook").status_code == 200
    for tail in ("/artifacts", "/notebook"):
        _same_as_unknown(beta.get(f"/v1/sessions/alpha-closed{tail}"),
                         beta.get(f"/v1/sessions/nobody-has-it{tail}"), "alpha-closed", "nobody-has-it")
    # Another tenant cannot take the id over (which would hide alpha's history from alpha).
    r = beta.post("/v1/sessions", json={"session_id": "alpha-closed"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_exists"
    assert alpha.get("/v1/sessions/alpha-closed/notebook").status_code == 200
    # Its owner can.
    assert alpha.post("/v1/sessions", json={"session_id": "alpha-closed"}).status_code == 201
    alpha.delete("/v1/sessions/alpha-closed")


def test_session_quota_is_per_tenant(alpha: httpx.Client, beta: httpx.Client, alpha_sid: str) -> None:
    """alpha may hold 2 sessions (it holds alpha_sid already); beta has no quota of its own."""
    assert alpha.post("/v1/sessions", json={"session_id": "alpha-2"}).status_code == 201
    try:
        r = alpha.post("/v1/sessions", json={"session_id": "alpha-3"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert "alpha" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1  # a hint: sessions free as they are deleted or reaped
        r = alpha.post("/v1/execute", json={"code": "1"})  # a one-shot run needs a session too
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded"
        r = beta.post("/v1/sessions", json={"session_id": "beta-2"})
        assert r.status_code == 201
        beta.delete("/v1/sessions/beta-2")
    finally:
        alpha.delete("/v1/sessions/alpha-2")
    r = alpha.post("/v1/sessions", json={"session_id": "alpha-3"})
    assert r.status_code == 201
    alpha.delete("/v1/sessions/alpha-3")


def test_runs_per_minute_quota(srv: Server) -> None:
    with srv.client(GAMMA) as gamma:
        assert gamma.post("/v1/sessions", json={"session_id": "gamma-own"}).status_code == 201
        try:
            for i in range(3):
                res = gamma.post("/v1/sessions/gamma-own/execute", json={"code": f"{i}"})
                assert res.status_code == 200 and res.json()["result"] == str(i)
            r = gamma.post("/v1/sessions/gamma-own/execute", json={"code": "'one too many'"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
            retry = r.json()["error"]["details"]["retry_after_seconds"]
            assert 1 <= retry <= 61
            assert r.headers["Retry-After"] == str(retry)  # the same figure, for HTTP clients
            # The refused run never reached the kernel, and the session is fine.
            info = gamma.get("/v1/sessions/gamma-own").json()
            assert info["execution_count"] == 3 and info["status"] == "idle"
        finally:
            gamma.delete("/v1/sessions/gamma-own")


async def test_mcp_is_tenant_scoped(srv: Server, alpha_sid: str) -> None:
    async with mcp_client(srv, token=BETA) as client:
        listed = await client.call_tool("list_sessions", {})
        assert alpha_sid not in listed.content[0].text
        for tool, args in [("run_python", {"code": "secret", "session_id": alpha_sid}),
                           ("list_files", {"session_id": alpha_sid}),
                           ("read_artifact", {"path_or_artifact": "data.txt", "session_id": alpha_sid}),
                           ("interrupt", {"session_id": alpha_sid}),
                           ("close_session", {"session_id": alpha_sid})]:
            res = await client.call_tool(tool, args)
            assert res.is_error, (tool, res)
            assert f"unknown session {alpha_sid!r}" in res.content[0].text, (tool, res.content[0].text)
        # Its own session works, and is beta's.
        res = await client.call_tool("run_python", {"code": "'beta here'"})
        assert not res.is_error and "beta here" in res.content[0].text
        with srv.client() as admin:
            tenants = {s["tenant"] for s in admin.get("/v1/sessions").json()["sessions"]}
        assert "beta" in tenants
    # A header that claims another tenant is dropped: the token decides.
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {BETA}", "X-Kernelmode-Tenant": "alpha"},
                              timeout=httpx2.Timeout(30, read=120))
    try:
        async with Client(streamable_http_client(srv.url + "/mcp", http_client=http)) as client:
            res = await client.call_tool("run_python", {"code": "secret", "session_id": alpha_sid})
            assert res.is_error and "unknown session" in res.content[0].text
            listed = await client.call_tool("list_sessions", {})
            assert alpha_sid not in listed.content[0].text
    finally:
        await http.aclose()
    # alpha itself reaches its session over MCP.
    async with mcp_client(srv, token=ALPHA, close=False) as client:
        res = await client.call_tool("run_python", {"code": "secret", "session_id": alpha_sid})
        assert not res.is_error and "41" in res.content[0].text


def test_tenant_config_is_validated() -> None:
    ok = {"KERNELMODE_TOKEN": "a" * 20}

    def load(tenants: str) -> None:
        load_settings(environ={**ok, "KERNELMODE_SERVER__TENANTS": tenants})

    load("[{name: t1, token: 'tttttttttttttttt1'}]")
    for bad, says in [
        ("[{name: admin, token: 'tttttttttttttttt1'}]", "admin token"),
        ("[{name: t1, token: short}]", "at least 16"),
        ("[{name: 'Bad Name', token: 'tttttttttttttttt1'}]", "pattern"),
        ("[{name: t1, token: 'tttttttttttttttt1'}, {name: t1, token: 'tttttttttttttttt2'}]", "same name"),
        ("[{name: t1, token: 'tttttttttttttttt1'}, {name: t2, token: 'tttttttttttttttt1'}]", "tokens"),
        (f"[{{name: t1, token: '{'a' * 20}'}}]", "tokens"),
        ("[{name: t1, token: 'tttttttttttttttt1', max_sessions: 0}]", "greater than or equal"),
        ("[{name: t1, token: 'tttttttttttttttt1', quota: 3}]", "unknown key"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(bad)
        assert says in e.value.message, (bad, e.value.message)


def _sample(text: str, name: str, labels: str) -> float:
    """The value of ``name{labels}`` (labels sorted by name, as prometheus_client writes them)."""
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
