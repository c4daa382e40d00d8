"""The code policy holds on every door a tenant can send code through with its own token: REST,
one-shot, MCP, the console channel and the Jupyter API's channels (v1 and legacy), silent cells,
user expressions, cells sent on ``control``, and the debugger. A refused cell never reaches the
kernel (a canary file it would write stays absent); the client gets a proper failed cell naming
the reason; the session stays usable."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from websockets.sync.client import ClientConnection, connect

from kernelmode.api.jupyter_api import kernel_id_of
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame
from tests.conftest import Server
from tests.mcp.conftest import mcp_client

from .conftest import ALPHA
from .policy_rules import ASK_MARK, DENY_MARK

V1 = "v1.kernel.websocket.jupyter.org"
HEADERS = {"Authorization": f"token {ALPHA}"}


@pytest.fixture(scope="module")
def alpha_sid(alpha: httpx.Client) -> Iterator[str]:
    r = alpha.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    assert alpha.post(f"/v1/sessions/{sid}/execute", json={"code": "kept = 7"}).json()["status"] == "ok"
    yield sid
    alpha.delete(f"/v1/sessions/{sid}")


def _canary_cell(name: str, mark: str = DENY_MARK) -> str:
    """A cell that leaves a file behind if it ever runs."""
    return f"open('/mnt/data/{name}', 'w').write('ran')  # {mark}"


class _Door:
    """One websocket to a session's kernel, in v1 frames or legacy JSON."""

    def __init__(self, ws: ClientConnection, legacy: bool) -> None:
        self.ws, self.legacy, self.session = ws, legacy, Session(key=b"", username="tenant")

    def send(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(msg_type, content)
        if self.legacy:
            self.ws.send(json.dumps({**msg, "channel": channel}, default=json_default))
        else:
            self.ws.send(encode_frame(msg, channel))
        return str(msg["header"]["msg_id"])

    def answers(self, msg_id: str, reply_type: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the reply, the iopub messages of the request up to its idle status)."""
        reply: dict[str, Any] | None = None
        iopub: list[dict[str, Any]] = []
        while reply is None or not any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                                       for m in iopub):
            raw = self.ws.recv(timeout=120)
            msg = json.loads(raw) if isinstance(raw, str) else decode_frame(raw, Bounds(max_part_bytes=1 << 24))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == reply_type:
                reply = msg
                if reply_type == "debug_reply":
                    break
            elif msg["channel"] == "iopub":
                iopub.append(msg)
        return reply, iopub


def _doors(tenant_server: Server, sid: str) -> list[tuple[str, str, bool]]:
    base = "ws" + tenant_server.url[len("http"):]
    kid = kernel_id_of(sid)
    return [("console", f"{base}/v1/sessions/{sid}/channels", False),
            ("jupyter-v1", f"{base}/api/kernels/{kid}/channels", False),
            ("jupyter-legacy", f"{base}/api/kernels/{kid}/channels", True)]


def _exists(alpha: httpx.Client, sid: str, names: list[str]) -> list[str]:
    code = f"import os\n[n for n in {names!r} if os.path.exists('/mnt/data/' + n)]"
    res = alpha.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()
    assert res["status"] == "ok", res
    return list(json.loads(res["result"].replace("'", '"')))


def test_a_denied_cell_runs_through_no_channel(tenant_server: Server, alpha: httpx.Client, alpha_sid: str) -> None:
    canaries: list[str] = []

    def canary() -> str:
        canaries.append(f"pwned-{secrets.token_hex(4)}")
        return canaries[-1]

    # REST and one-shot: refused as before (the baseline the channels must match)
    res = alpha.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": _canary_cell(canary())}).json()
    assert res["status"] == "error" and res["error"]["ename"] == "PolicyDenied", res
    once = alpha.post("/v1/execute", json={"code": _canary_cell("x")}).json()
    assert once["status"] == "error" and once["error"]["ename"] == "PolicyDenied", once
    for name, url, legacy in _doors(tenant_server, alpha_sid):
        with connect(url, additional_headers=HEADERS, subprotocols=None if legacy else [V1],  # type: ignore[list-item]
                     open_timeout=60, max_size=None) as ws:
            door = _Door(ws, legacy)
            attempts = [
                ("shell", {"code": _canary_cell(canary()), "silent": False}),
                ("shell", {"code": _canary_cell(canary()), "silent": True}),  # no history, still code
                ("shell", {"code": "1", "user_expressions": {"x": _canary_cell(canary())}}),
                ("control", {"code": _canary_cell(canary())}),  # ipykernel runs it there too
            ]
            for channel, content in attempts:
                msg_id = door.send(channel, "execute_request", {"silent": False, "store_history": True,
                                                                "allow_stdin": False, **content})
                reply, iopub = door.answers(msg_id, "execute_reply")
                c = reply["content"]
                assert c["status"] == "error" and c["ename"] == "PolicyDenied", (name, reply)
                assert c["evalue"] == f"tenant alpha may not run {DENY_MARK} cells", (name, c)
                assert reply["channel"] == channel
                errors = [m["content"] for m in iopub if m["msg_type"] == "error"]
                assert errors and errors[0]["ename"] == "PolicyDenied", (name, iopub)
            # ask: nobody could approve a console cell, so it is a refusal that says so
            msg_id = door.send("shell", "execute_request", {"code": _canary_cell(canary(), ASK_MARK)})
            c = door.answers(msg_id, "execute_reply")[0]["content"]
            assert c["status"] == "error" and c["ename"] == "PolicyDenied", (name, c)
            assert "asks for approval" in c["evalue"] and "not a console cell" in c["evalue"], c
            # the debugger evaluates what the policy never sees: refused while a policy is set
            msg_id = door.send("control", "debug_request", {
                "seq": 1, "type": "request", "command": "evaluate",
                "arguments": {"expression": _canary_cell(canary()), "context": "repl"}})
            d = door.answers(msg_id, "debug_reply")[0]["content"]
            assert d["success"] is False and "code policy" in d["message"], (name, d)
            # an allowed cell runs on the same connection, with the session's state
            msg_id = door.send("shell", "execute_request", {"code": "kept * 6", "silent": False})
            reply, iopub = door.answers(msg_id, "execute_reply")
            assert reply["content"]["status"] == "ok", (name, reply)
            results = [m["content"]["data"]["text/plain"] for m in iopub if m["msg_type"] == "execute_result"]
            assert results == ["42"], (name, iopub)
    assert _exists(alpha, alpha_sid, canaries) == []  # the kernel never saw one of them
    notebook = alpha.get(f"/v1/sessions/{alpha_sid}/notebook")
    assert notebook.text.count("PolicyDenied") >= 3, notebook.text  # refused cells are in the history


async def test_a_denied_cell_is_refused_over_mcp(tenant_server: Server) -> None:
    async with mcp_client(tenant_server, ALPHA) as c:
        result = await c.call_tool("run_python", {"code": _canary_cell("mcp-canary")})
        text = json.dumps(result.model_dump(mode="json"))
        assert "PolicyDenied" in text and f"may not run {DENY_MARK} cells" in text, text
        check = await c.call_tool("run_python", {"code": "import os; os.path.exists('/mnt/data/mcp-canary')"})
        assert check.structured_content is not None and check.structured_content["result"] == "False", check
