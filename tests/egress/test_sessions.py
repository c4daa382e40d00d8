"""The session contract of egress on a real `kernelmode serve`: a session's `egress` narrows its
tenant's (a wider one is 403 egress_refused naming the host, and nothing is left), session info
shows the effective policy without secret values, forks inherit it, one-shot runs and the Python
client take it. (No kernel reaches the proxy here: that is the bridge's part.)"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from kernelmode import Client
from kernelmode.errors import EgressRefused
from kernelmode.models import EgressUse, RunResult
from tests.support.server import Server, start_server

TEAM = secrets.token_urlsafe(18)
SECRET_VALUE = "sekrit-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server({
        "KERNELMODE_SESSIONS__POOL_SIZE": "0",
        "KERNELMODE_EGRESS__ALLOW": '["*.example.test", "api.github.com"]',
        "KERNELMODE_EGRESS__DENY": '["bad.example.test"]',
        "KERNELMODE_EGRESS__SECRETS": f'[{{host: api.github.com, header: Authorization, value: "Bearer {SECRET_VALUE}"}}]',
        "KERNELMODE_SERVER__TENANTS": f"[{{name: team, token: '{TEAM}', egress: {{allow: ['*.example.test'], "
                                      "max_connections_per_session: 4}}]",
    })
    yield s
    s.discard()


@pytest.fixture(scope="module")
def admin(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


def _create(c: httpx.Client, **body: object) -> dict:
    r = c.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_a_session_narrows_and_shows_its_policy_without_secret_values(srv: Server, admin: httpx.Client) -> None:
    info = _create(admin, egress={"allow": ["a.example.test", "api.github.com"], "deny": ["x.example.test"]})
    try:
        assert info["egress"]["allow"] == ["a.example.test", "api.github.com"]
        assert info["egress"]["deny"] == ["bad.example.test", "x.example.test"]
        assert info["egress"]["secrets"] == [{"host": "api.github.com", "header": "Authorization"}]
        got = admin.get(f"/v1/sessions/{info['session_id']}")
        assert got.json()["egress"] == info["egress"]
        assert SECRET_VALUE not in got.text + admin.get("/v1/sessions").text
    finally:
        admin.delete(f"/v1/sessions/{info['session_id']}")


def test_a_wider_request_is_403_naming_the_host_and_leaves_nothing(admin: httpx.Client) -> None:
    for asked, host in (({"allow": ["evil.test"]}, "evil.test"), ({"allow": ["*.test"]}, "*.test"),
                        ({"allow": ["api.github.com:8443"]}, "api.github.com:8443"),
                        ({"allow": ["bad.example.test"]}, "bad.example.test")):
        r = admin.post("/v1/sessions", json={"session_id": "wider", "egress": asked})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "egress_refused" and host in r.json()["error"]["message"]
    assert admin.get("/v1/sessions/wider").status_code == 404
    r = admin.post("/v1/sessions", json={"egress": {"allow": ["http://x"]}})
    assert r.status_code == 422 and "host pattern" in r.text


def test_tenant_narrows_the_server(srv: Server) -> None:
    with srv.client(TEAM) as c:
        info = _create(c)
        try:
            assert info["egress"]["allow"] == ["*.example.test"]
            assert info["egress"]["max_connections_per_session"] == 4
        finally:
            c.delete(f"/v1/sessions/{info['session_id']}")
        r = c.post("/v1/sessions", json={"egress": {"allow": ["api.github.com"]}})
        assert r.status_code == 403 and "api.github.com" in r.json()["error"]["message"]
        r = c.post("/v1/execute", json={"code": "1", "egress": {"allow": ["api.github.com"]}})
        assert r.status_code == 403 and r.json()["error"]["code"] == "egress_refused"


def test_no_egress_is_none(admin: httpx.Client) -> None:
    info = _create(admin, egress={"allow": []})
    admin.delete(f"/v1/sessions/{info['session_id']}")
    assert info["egress"] is None


def test_a_fork_inherits_its_sources_policy(admin: httpx.Client) -> None:
    src = _create(admin, egress={"allow": ["a.example.test"]})
    bare = _create(admin, egress={"allow": []})
    made = [src["session_id"], bare["session_id"]]
    try:
        fork = _create(admin, fork_of=src["session_id"])
        made.append(fork["session_id"])
        assert fork["egress"] == src["egress"]
        fork = _create(admin, fork_of=bare["session_id"])  # no egress stays no egress, not the tenant's
        made.append(fork["session_id"])
        assert fork["egress"] is None
    finally:
        for sid in made:
            admin.delete(f"/v1/sessions/{sid}")


def test_python_client_passes_egress(srv: Server) -> None:
    with Client(srv.url, TEAM) as c:
        with pytest.raises(EgressRefused, match="api.github.com"):
            c.create_session(egress={"allow": ["api.github.com"]})
        with c.create_session(egress={"allow": ["files.example.test"]}) as s:
            assert s.info.egress is not None and s.info.egress.allow == ["files.example.test"]
        with pytest.raises(EgressRefused):
            c.run_once("1", egress={"allow": ["nope.test"]})


def test_run_result_egress_is_left_out_when_empty() -> None:
    bare = RunResult(run_id="r", session_id="s", status="ok")
    assert "egress" not in bare.model_dump() and "egress" not in bare.model_dump_json()
    used = bare.model_copy(update={"egress": [EgressUse(host="a.test", port=443, allowed=False, requests=1, bytes=0)]})
    assert used.model_dump()["egress"] == [{"host": "a.test", "port": 443, "allowed": False, "requests": 1, "bytes": 0}]
