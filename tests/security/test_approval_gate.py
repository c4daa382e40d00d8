"""Attacks on the approval gate: kernel code cannot get a gated tool to run without a person's
yes — not by calling it past the ``tools`` object, not by answering for itself, not from another
tenant's token — and a denied call never reaches the tool."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Server, start_server

OTHER = secrets.token_urlsafe(16)
CONFIG = """
server:
  tenants:
    - {name: other, token: "${KM_OTHER_TOKEN}"}
tools:
  - {name: bump, function: "tests.integration.host_tools:bump", requires_approval: true}
  - {name: bumps, function: "tests.integration.host_tools:bumps"}
"""
# A request made the way the preamble makes one, past the tools object (and its ToolDenied).
FORGE = """
import json, sys
kernel = get_ipython().kernel
marker = sys.modules['kernelmode_preamble'].MARKER
reply = json.loads(type(kernel).raw_input(kernel, marker + json.dumps(
    {"id": %r, "tool": "bump", "arguments": {}})))
print(json.dumps(reply))
"""


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG)
    srv = start_server({"KM_OTHER_TOKEN": OTHER}, args=["--config", str(cfg)])
    yield srv
    srv.discard()


@pytest.fixture(scope="module")
def api(gated: Server) -> Iterator[httpx.Client]:
    with gated.client() as c:
        yield c


@pytest.fixture(scope="module")
def sid(api: httpx.Client) -> Iterator[str]:
    s = api.post("/v1/sessions", json={}).json()["session_id"]
    yield s
    api.delete(f"/v1/sessions/{s}")


def _finish(api: httpx.Client, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        p = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 30}).json()
        if p["done"]:
            return p["result"]
    raise AssertionError("the run did not end")


def _bumps(api: httpx.Client, sid: str) -> int:
    return int(api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.bumps()"}).json()["result"])


def test_a_forged_request_is_gated_too_and_a_deny_never_reaches_the_tool(api: httpx.Client, sid: str) -> None:
    before = _bumps(api, sid)
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("f" * 32)})
    assert r.status_code == 202 and r.json()["status"] == "awaiting_approval", r.text
    run_id = r.json()["run_id"]
    [pending] = r.json()["pending_approvals"]
    assert pending["tool"] == "bump"
    assert api.post(f"/v1/runs/{run_id}/approvals/{pending['call_id']}",
                    json={"approve": False}).status_code == 200
    reply = json.loads(_finish(api, run_id)["stdout"].strip().splitlines()[-1])
    assert reply["ok"] is False and reply["denied"] is True
    assert _bumps(api, sid) == before  # the tool never ran


def test_a_reused_call_id_cannot_answer_another_call(api: httpx.Client, sid: str) -> None:
    """The kernel picks the request's id: an id already decided gets a fresh one, so a decision
    made for one call cannot be replayed onto another."""
    first = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("e" * 32)}).json()
    api.post(f"/v1/runs/{first['run_id']}/approvals/{first['pending_approvals'][0]['call_id']}",
             json={"approve": True})
    _finish(api, first["run_id"])
    second = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("e" * 32)}).json()
    [pending] = second["pending_approvals"]
    assert pending["call_id"] != first["pending_approvals"][0]["call_id"]
    api.post(f"/v1/runs/{second['run_id']}/approvals/{pending['call_id']}", json={"approve": False})
    _finish(api, second["run_id"])


def test_another_tenant_or_no_token_cannot_decide(
        api: httpx.Client, sid: str, gated: Server) -> None:
    before = _bumps(api, sid)
    body = api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.bump()"}).json()
    url = f"/v1/runs/{body['run_id']}/approvals/{body['pending_approvals'][0]['call_id']}"
    with gated.client(OTHER) as other:
        r = other.post(url, json={"approve": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    with gated.client("not-a-token") as nobody:
        assert nobody.post(url, json={"approve": True}).status_code == 401
    api.post(url, json={"approve": False})
    result = _finish(api, body["run_id"])
    assert result["error"]["ename"] == "ToolDenied"
    assert _bumps(api, sid) == before
