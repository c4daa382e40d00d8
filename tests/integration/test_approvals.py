"""The approval gate and the code policy end to end: a real server with tools that require
approval (a Python tool, one tool of a real upstream MCP server) and examples/code_policy.py as
its policy; decisions over REST, and over MCP by the real SDK client's elicitation callback."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Server, start_server
from tests.tools.test_mcp_upstream import SERVER as MCP_SERVER

INTERN = secrets.token_urlsafe(16)
OTHER = secrets.token_urlsafe(16)
TIMEOUT = 12  # approval_timeout_seconds of this server: long enough for a test to answer first (a
# loaded machine answers in a second or two), short for the one test that waits it out

CONFIG = """
server:
  tenants:
    - {name: interns, token: "${KM_INTERN_TOKEN}"}
    - {name: other, token: "${KM_OTHER_TOKEN}"}
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather", requires_approval: true}
mcp_servers:
  - name: up
    command: @PYTHON@
    args: [@MCP_SERVER@, stdio]
    requires_approval: [echo]
tool_calls:
  approval_timeout_seconds: @TIMEOUT@
policy:
  module: "examples.code_policy:check"
"""

WEATHER = 'r = tools.weather(city="Paris")\nr["city"]'
CATCH = ('try:\n    tools.weather(city="Oslo")\nexcept ToolDenied as e:\n'
         '    print("denied:", e, isinstance(e, ToolError))')


@pytest.fixture(scope="module")
def gate_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG.replace("@PYTHON@", json.dumps(sys.executable))
                   .replace("@MCP_SERVER@", json.dumps(MCP_SERVER)).replace("@TIMEOUT@", str(TIMEOUT)))
    srv = start_server({"KM_INTERN_TOKEN": INTERN, "KM_OTHER_TOKEN": OTHER}, args=["--config", str(cfg)])
    yield srv
    srv.discard()


@pytest.fixture(scope="module")
def api(gate_server: Server) -> Iterator[httpx.Client]:
    with gate_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def sid(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    yield r.json()["session_id"]
    api.delete(f"/v1/sessions/{r.json()['session_id']}")


def awaiting(api: httpx.Client, sid: str, code: str) -> dict[str, Any]:
    """Submit ``code`` (a waited execute) and return its awaiting_approval answer."""
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "awaiting_approval", body
    assert r.headers["Location"] == f"/v1/runs/{body['run_id']}"
    return body


def finish(api: httpx.Client, run_id: str) -> dict[str, Any]:
    """The run's final result (long-polling until it ends)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        p = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 30}).json()
        if p["done"]:
            return p["result"]
    raise AssertionError(f"run {run_id} did not end")


def audit_lines(server: Server, run_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]
    return [x for x in lines if x.get("run_id") == run_id]


# -- REST ------------------------------------------------------------------------------------------

def test_a_poll_given_the_approvals_version_it_saw_ends_on_an_approval_that_came_since(
        api: httpx.Client, sid: str) -> None:
    """A poller that looked before an approval came and polls again after it (a race a follower
    on another manager meets, mcp/remote.py) passes the approvals_version it saw: its wait ends at
    once instead of at wait_seconds; with the version now, the wait holds as before."""
    body = awaiting(api, sid, WEATHER)
    run_id, [pending] = body["run_id"], body["pending_approvals"]
    now = api.get(f"/v1/runs/{run_id}").json()
    assert now["approvals_version"] > 0 and now["pending_approvals"] == [pending], now
    # Seen before the approval came: answered at once (the client's timeout is far below the wait).
    stale = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 60, "approvals_version": 0}, timeout=30)
    assert stale.status_code == 200 and stale.json()["status"] == "awaiting_approval", stale.text
    assert api.get(f"/v1/runs/{run_id}", params={"approvals_version": "x"}).status_code == 422
    assert api.post(f"/v1/runs/{run_id}/approvals/{pending['call_id']}", json={"approve": False}).status_code == 200
    finish(api, run_id)


def test_approved_call_runs_and_the_decision_is_audited(api: httpx.Client, sid: str,
                                                        gate_server: Server) -> None:
    body = awaiting(api, sid, WEATHER)
    [pending] = body["pending_approvals"]
    assert pending["tool"] == "weather" and pending["arguments"] == {"city": "Paris"}
    run_id, call_id = body["run_id"], pending["call_id"]
    p = api.get(f"/v1/runs/{run_id}").json()
    assert p["status"] == "awaiting_approval" and p["pending_approvals"] == [pending] and not p["done"]

    r = api.post(f"/v1/runs/{run_id}/approvals/{call_id}", json={"approve": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"run_id": run_id, "call_id": call_id, "approved": True, "reason": None, "by": "rest"}
    again = api.post(f"/v1/runs/{run_id}/approvals/{call_id}", json={"approve": False})
    assert again.status_code == 409 and again.json()["error"]["code"] == "approval_decided"

    result = finish(api, run_id)
    assert result["status"] == "ok" and result["result"] == "'Paris'", result
    assert [c["tool"] for c in result["tool_calls"]] == ["weather"] and result["tool_calls"][0]["ok"]
    events = [(x["event"], x.get("by")) for x in audit_lines(gate_server, run_id) if "approval" in x["event"]]
    assert events == [("approval_requested", None), ("approval_decided", "rest")]


def test_denied_call_raises_tool_denied_with_the_reason(api: httpx.Client, sid: str) -> None:
    body = awaiting(api, sid, CATCH)
    call_id = body["pending_approvals"][0]["call_id"]
    r = api.post(f"/v1/runs/{body['run_id']}/approvals/{call_id}", json={"approve": False, "reason": "not today"})
    assert r.status_code == 200 and r.json()["approved"] is False
    result = finish(api, body["run_id"])
    assert result["status"] == "ok"
    assert result["stdout"] == "denied: weather: weather was denied (rest): not today True\n"
    assert result["tool_calls"][0]["ok"] is False


def test_waiting_for_approval_does_not_count_against_the_runs_timeout(api: httpx.Client, sid: str) -> None:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": WEATHER, "timeout_seconds": 2})
    body = r.json()
    assert body["status"] == "awaiting_approval", body
    time.sleep(3)  # longer than the run's timeout: only the time the code itself runs counts
    api.post(f"/v1/runs/{body['run_id']}/approvals/{body['pending_approvals'][0]['call_id']}", json={"approve": True})
    result = finish(api, body["run_id"])
    assert result["status"] == "ok" and result["result"] == "'Paris'", result


def test_tools_without_the_flag_do_not_wait(api: httpx.Client, sid: str) -> None:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.add(a=1, b=2), tools.up.add(a=2, b=3)"})
    assert r.status_code == 200 and r.json()["result"] == "(3, 5)", r.text


def test_listings_say_which_tools_ask_first(api: httpx.Client, sid: str) -> None:
    flags = {t["name"]: t["requires_approval"] for t in api.get("/v1/tools").json()["tools"]}
    assert flags["weather"] and flags["up.echo"] and not flags["add"] and not flags["up.add"]
    text = api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.help()"}).json()["stdout"]
    assert "tools.weather(city: str, unit: str = 'C') -> dict  [asks a person first]" in text
    assert "[asks a person first]" not in text.split("tools.add(")[1].splitlines()[0]


def test_listed_upstream_tool_waits(api: httpx.Client, sid: str) -> None:
    body = awaiting(api, sid, 'tools.up.echo(text="hi")')
    [pending] = body["pending_approvals"]
    assert pending["tool"] == "up.echo" and pending["arguments"] == {"text": "hi"}
    api.post(f"/v1/runs/{body['run_id']}/approvals/{pending['call_id']}", json={"approve": True})
    assert finish(api, body["run_id"])["result"] == "'hi'"


def test_bad_decisions_are_refused_and_lose_nothing(api: httpx.Client, sid: str, gate_server: Server) -> None:
    body = awaiting(api, sid, WEATHER)
    run_id, call_id = body["run_id"], body["pending_approvals"][0]["call_id"]
    url = f"/v1/runs/{run_id}/approvals/{call_id}"
    for bad in ({}, {"approve": "maybe"}, {"approve": True, "extra": 1}, {"approve": True, "reason": "x" * 3000}):
        r = api.post(url, json=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)
    r = api.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
    r = api.post(f"/v1/runs/{run_id}/approvals/{'0' * 32}", json={"approve": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "approval_not_found"
    r = api.post(f"/v1/runs/{'0' * 32}/approvals/{call_id}", json={"approve": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    r = api.post(f"/v1/runs/{run_id}/approvals/not-an-id", json={"approve": True})
    assert r.status_code == 404
    with gate_server.client(OTHER) as other:  # another tenant: the run is unknown to it
        r = other.post(url, json={"approve": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    # All that left the call pending, as it was:
    assert api.get(f"/v1/runs/{run_id}").json()["pending_approvals"] == body["pending_approvals"]
    assert api.post(url, json={"approve": True}).status_code == 200
    assert finish(api, run_id)["status"] == "ok"


def test_interrupt_while_waiting_withdraws_the_call(api: httpx.Client, sid: str) -> None:
    body = awaiting(api, sid, WEATHER)
    run_id, call_id = body["run_id"], body["pending_approvals"][0]["call_id"]
    assert api.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
    result = finish(api, run_id)
    assert result["status"] == "interrupted" and result["error"]["ename"] == "KeyboardInterrupt", result
    r = api.post(f"/v1/runs/{run_id}/approvals/{call_id}", json={"approve": True})
    assert r.status_code == 409 and "run_ended" in r.json()["error"]["message"]
    after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.add(a=2)"}).json()
    assert after["status"] == "ok" and after["result"] == "2"  # the session is unaffected


def test_no_answer_in_time_is_a_deny(api: httpx.Client, sid: str, gate_server: Server) -> None:
    body = awaiting(api, sid, CATCH)
    result = finish(api, body["run_id"])
    assert result["stdout"] == f"denied: weather: weather was denied (timeout): no answer within {TIMEOUT} s True\n"
    decided = [x for x in audit_lines(gate_server, body["run_id"]) if x["event"] == "approval_decided"]
    assert [(x["by"], x["approved"]) for x in decided] == [("timeout", False)]


def test_one_shot_runs_deny_at_once(api: httpx.Client) -> None:
    r = api.post("/v1/execute", json={"code": CATCH})
    assert r.status_code == 200, r.text
    assert "one-shot run cannot wait" in r.json()["stdout"]


def test_client_methods_decide(gate_server: Server, api: httpx.Client, sid: str) -> None:
    from kernelmode.client import Client as KmClient

    with KmClient(gate_server.url, gate_server.token) as km:
        first = km.execute(sid, WEATHER)
        assert first.status == "awaiting_approval"
        answer = km.approve(first.run_id, first.pending_approvals[0].call_id, False, reason="no")
        assert answer.approved is False and answer.by == "rest"
    result = finish(api, first.run_id)
    assert result["status"] == "error" and result["error"]["ename"] == "ToolDenied", result


# -- the code policy -------------------------------------------------------------------------------

def test_policy_denies_for_a_tenant_and_the_session_stays_usable(gate_server: Server) -> None:
    with gate_server.client(INTERN) as intern:
        sid = intern.post("/v1/sessions", json={}).json()["session_id"]
        try:
            r = intern.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1\nimport subprocess"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["status"] == "error" and body["error"]["ename"] == "PolicyDenied"
            assert "tenant interns may not start processes (import subprocess)" in body["error"]["evalue"]
            ok = intern.post(f"/v1/sessions/{sid}/execute", json={"code": "y = 2\ny"}).json()
            assert ok["status"] == "ok" and ok["result"] == "2"
            # the refused code never ran: x is not defined
            assert intern.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}).json()["error"]["ename"] == "NameError"
        finally:
            intern.delete(f"/v1/sessions/{sid}")


def test_policy_ask_goes_through_the_gate(api: httpx.Client, sid: str) -> None:
    code = 'open("/tmp/report.txt", "w").write("hi")'
    body = awaiting(api, sid, code)
    [pending] = body["pending_approvals"]
    assert pending["tool"] == "policy:run"
    assert pending["arguments"] == {"code": code, "reason": "writes to /tmp/report.txt, outside /mnt/data"}
    api.post(f"/v1/runs/{body['run_id']}/approvals/{pending['call_id']}", json={"approve": True})
    assert finish(api, body["run_id"])["result"] == "2"
    denied = awaiting(api, sid, code)
    api.post(f"/v1/runs/{denied['run_id']}/approvals/{denied['pending_approvals'][0]['call_id']}",
             json={"approve": False, "reason": "no"})
    result = finish(api, denied["run_id"])
    assert result["status"] == "error" and result["error"]["ename"] == "PolicyDenied"
    assert result["error"]["evalue"].endswith("was denied (rest): no")


def test_interrupt_refuses_a_run_waiting_for_the_policy(api: httpx.Client, sid: str) -> None:
    body = awaiting(api, sid, 'x_interrupted = 1\nopen("/etc/km-test", "w")')
    assert api.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
    result = finish(api, body["run_id"])
    assert result["status"] == "error" and result["error"]["ename"] == "PolicyDenied"
    assert result["error"]["evalue"].endswith("was denied (interrupt): interrupted")
    after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "'x_interrupted' in dir()"}).json()
    assert after["result"] == "False"  # it never ran


# -- MCP: elicitation --------------------------------------------------------------------------------

@asynccontextmanager
async def mcp(server: Server, on_elicit: Any = None) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {server.token}"},
                              timeout=httpx2.Timeout(30, read=300))
    try:
        async with Client(streamable_http_client(server.url + "/mcp", http_client=http),
                          elicitation_callback=on_elicit) as client:
            try:
                yield client
            finally:
                await client.call_tool("close_session", {})
    finally:
        await http.aclose()


def answering(action: str, content: dict[str, Any] | None, seen: list[str]) -> Any:
    async def on_elicit(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        seen.append(params.message)
        return types.ElicitResult(action=action, content=content)  # type: ignore[arg-type]

    return on_elicit


@pytest.mark.parametrize(("action", "content", "expected"), [
    ("accept", {"approve": True}, "'Paris'"),
    ("accept", {"approve": False, "reason": "nope"}, "weather was denied (mcp): nope"),
    ("decline", None, "weather was denied (mcp): declined at the MCP client"),
    ("cancel", None, "weather was denied (mcp): cancelled at the MCP client"),
])
async def test_mcp_elicitation_decides(gate_server: Server, action: str, content: dict[str, Any] | None,
                                       expected: str) -> None:
    seen: list[str] = []
    code = ('try:\n    print(repr(tools.weather(city="Paris")["city"]))\n'
            'except ToolDenied as e:\n    print(e)')
    async with mcp(gate_server, answering(action, content, seen)) as client:
        result = await client.call_tool("run_python", {"code": code})
    assert result.structured_content is not None
    assert result.structured_content["status"] == "ok", result
    assert result.structured_content["stdout"].strip().endswith(expected)
    [message] = seen
    assert "weather" in message and '"city": "Paris"' in message


async def test_mcp_client_without_elicitation_gets_the_pending_answer(gate_server: Server) -> None:
    async with mcp(gate_server) as client:
        result = await client.call_tool("run_python", {"code": WEATHER})
        assert result.structured_content is not None
        assert result.structured_content["status"] == "awaiting_approval"
        [pending] = result.structured_content["pending_approvals"]
        text = result.content[0].text  # type: ignore[union-attr]
        assert "AWAITING APPROVAL" in text and f"/approvals/{pending['call_id']}" in text
        run_id = result.structured_content["run_id"]
        with gate_server.client() as api:  # an operator answers over REST
            assert api.post(f"/v1/runs/{run_id}/approvals/{pending['call_id']}",
                            json={"approve": True}).status_code == 200
        done = await client.call_tool("get_run", {"run_id": run_id, "wait_seconds": 60})
        assert done.structured_content is not None and done.structured_content["status"] == "ok"


async def test_mcp_elicitation_over_the_stdio_bridge(gate_server: Server) -> None:
    """`kernelmode mcp --url` relays the elicitation and its answer unchanged."""
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from tests.conftest import REPO

    seen: list[str] = []
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "kernelmode.cli", "mcp"], cwd=str(REPO),
        env={**os.environ, "KERNELMODE_URL": gate_server.url, "KERNELMODE_TOKEN": gate_server.token})
    async with Client(stdio_client(params), elicitation_callback=answering("accept", {"approve": True}, seen)) as c:
        result = await c.call_tool("run_python", {"code": 'tools.up.echo(text="over stdio")'})
        assert result.structured_content is not None and result.structured_content["result"] == "'over stdio'"
        await c.call_tool("close_session", {})
    [message] = seen
    assert "up.echo" in message and "over stdio" in message


def test_a_console_cell_cannot_wait_for_approval(gate_server: Server, api: httpx.Client, sid: str) -> None:
    """A person's console cell calling a gated tool is denied at once, saying why (nobody could
    answer for a cell no front door follows)."""
    from tests.conftest import attached_frontend

    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).status_code == 200  # tools installed
    outputs: list[dict[str, Any]] = []
    with attached_frontend(gate_server, sid) as kc:
        reply = kc.execute_interactive(CATCH, timeout=120, allow_stdin=True, output_hook=outputs.append,
                                       stdin_hook=lambda msg: kc.input(""))
    assert reply["content"]["status"] == "ok", reply["content"]
    printed = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
    assert printed == ("denied: weather: weather requires approval, which only a run started through REST or "
                       "MCP can wait for (not a console cell) True\n"), printed


def test_serve_refuses_a_policy_it_cannot_load(tmp_path: Any) -> None:
    import subprocess

    from tests.conftest import REPO

    cfg = tmp_path / "kernelmode.yaml"
    cfg.write_text('policy: {module: "no_such_policy_pkg.rules:check"}\n')
    proc = subprocess.run([sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir",
                           str(tmp_path / "data"), "--config", str(cfg)], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO), env={**os.environ, "KERNELMODE_TOKEN": secrets.token_urlsafe(16)})
    assert proc.returncode != 0
    assert "policy.module: cannot load 'no_such_policy_pkg.rules:check': ModuleNotFoundError" in proc.stderr


async def test_mcp_elicitation_answers_the_code_policy(gate_server: Server) -> None:
    seen: list[str] = []
    code = 'open("/tmp/mcp.txt", "w").write("abc")'
    async with mcp(gate_server, answering("accept", {"approve": True}, seen)) as client:
        result = await client.call_tool("run_python", {"code": code})
    assert result.structured_content is not None and result.structured_content["result"] == "3", result
    [message] = seen
    assert message.startswith("The code policy asks whether this code may run") and code in message
    assert "writes to /tmp/mcp.txt, outside /mnt/data" in message
