"""A malformed code string never costs a session its state (issue 32).

A lone surrogate (``"\\ud800"``) is valid JSON and a valid Python str, but no UTF-8 encoder takes
it: passed on to the kernel, its publishing of the cell (execute_input) failed, no execute_reply
came, and the run waited until its timeout restarted the kernel, its variables gone. Every door that takes code refuses it (422 / isError); a websocket client's
frame is re-encoded from what was checked, with U+FFFD in its place.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from kernelmode.api.jupyter_api import kernel_id_of
from tests.conftest import Server
from tests.support.mcp_raw import MCP_HEADERS, initialize, rpc_answer

V1 = "v1.kernel.websocket.jupyter.org"
JSON = {"Content-Type": "application/json"}
# Bodies written by hand: httpx's json= would refuse to encode a lone surrogate.
CODES = {"comment-high": b'"# \\ud800"', "string-low": b'"x = \'\\udcff\'"'}


@pytest.fixture()
def kept(session_factory: Callable[..., str], run: Callable[..., dict]) -> str:
    """A session with a variable to lose."""
    sid = session_factory()
    assert run(sid, "x = 41")["status"] == "ok"
    return sid


def _still_there(api: httpx.Client, sid: str) -> None:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x + 1)", "timeout_seconds": 60})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["status"] == "ok" and res["stdout"] == "42\n" and res["state_lost"] is False, res


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and "lone surrogate" in error["message"], error
    assert "code" in error["message"] and "send valid text" in error["message"], error


@pytest.mark.parametrize("code", list(CODES))
@pytest.mark.parametrize("extra", [b"", b', "wait_seconds": 5', b', "wait_seconds": 0'])
def test_rest_execute_refuses_a_lone_surrogate_and_keeps_the_variables(
        code: str, extra: bytes, api: httpx.Client, kept: str) -> None:
    r = api.post(f"/v1/sessions/{kept}/execute", content=b'{"code": ' + CODES[code] + extra + b"}",
                 headers=JSON)
    _refused(r)  # it was 202 running, then a timeout that restarted the kernel
    _still_there(api, kept)


def test_one_shot_execute_refuses_a_lone_surrogate(api: httpx.Client) -> None:
    _refused(api.post("/v1/execute", content=b'{"code": "# \\ud800"}', headers=JSON))
    assert not [s for s in api.get("/v1/sessions").json()["sessions"]
                if s["session_id"].startswith("oneshot-")]  # no kernel taken for it


def test_mcp_run_python_refuses_a_lone_surrogate(server: Server, api: httpx.Client, kept: str) -> None:
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        sess = initialize(c)
        body = (b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "run_python", '
                b'"arguments": {"code": "# \\ud800", "session_id": "' + kept.encode() + b'"}}}')
        answer = rpc_answer(c.post("/mcp", content=body, headers=sess))
        # The SDK's parser may refuse the body itself (-32700); kernelmode's direct route answers
        # an isError result naming the problem. Never a run left hanging.
        if "error" in answer:
            assert answer["error"]["code"] in (-32700, -32602), answer
        else:
            assert answer["result"]["isError"] is True, answer
            assert "lone surrogate" in json.dumps(answer["result"]), answer
        c.delete("/mcp", headers=sess)
    _still_there(api, kept)


# -- websockets: a frame is re-encoded from what was checked ---------------------------------------

def _header(msg_type: str) -> dict:
    return {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "s", "username": "u",
            "date": "2024-01-01T00:00:00Z", "version": "5.3"}


def _v1(channel: str, header: dict, parent: dict, content: bytes) -> bytes:
    """A v1 frame whose content part is ``content`` as given (json would escape nothing away)."""
    parts = [json.dumps(header).encode(), json.dumps(parent).encode(), b"{}", content]
    offsets = [8 * (len(parts) + 3)]
    offsets.append(offsets[-1] + len(channel))
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    return (len(offsets).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
            + channel.encode() + b"".join(parts))


def _v1_message(raw: bytes | str) -> dict:
    if isinstance(raw, str):
        return dict(json.loads(raw))
    n = int.from_bytes(raw[:8], "little")
    offsets = [int.from_bytes(raw[8 + 8 * i:16 + 8 * i], "little") for i in range(n)]
    parts = [raw[offsets[i]:offsets[i + 1]] for i in range(min(n - 1, 5))]
    return {"channel": parts[0].decode(), "header": json.loads(parts[1]),
            "parent_header": json.loads(parts[2]), "content": json.loads(parts[4])}


# A console cell that reads a line from its client (ipykernel's own raw_input, past the preamble's
# refusal of input()): the client's input_reply is what the kernel waits on.
ASK = ("k = get_ipython().kernel\n"
       "answer = type(k).raw_input(k, 'say something')\n"
       "print(len(answer), hex(ord(answer[0])))")


@pytest.fixture()
def console(server: Server, kept: str) -> Iterator[ClientConnection]:
    with connect(f"ws{server.url[4:]}/api/kernels/{kernel_id_of(kept)}/channels",
                 additional_headers={"Authorization": f"token {server.token}"},
                 subprotocols=[V1], open_timeout=60, max_size=None) as ws:  # type: ignore[list-item]
        yield ws


def _until(ws: ClientConnection, parent: str, kind: str, seen: list[dict]) -> dict:
    """Read until the message ``kind`` answering ``parent`` (a hang fails on recv's timeout)."""
    while True:
        msg = _v1_message(ws.recv(timeout=120))
        if msg["parent_header"].get("msg_id") == parent:
            seen.append(msg)
            if msg["header"]["msg_type"] == kind:
                return msg


def test_a_websocket_frame_with_a_lone_surrogate_reaches_the_kernel_as_text(
        console: ClientConnection, api: httpx.Client, kept: str) -> None:
    seen: list[dict] = []
    ask = _header("execute_request")
    console.send(_v1("shell", ask, {}, json.dumps({
        "code": ASK, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": True, "stop_on_error": False}).encode()))
    request = _until(console, ask["msg_id"], "input_request", seen)
    # The answer as a client may write it: the escape, as JSON allows. Passed on as it came (every
    # frame but an execute_request was), it reached the kernel as a lone surrogate (0xd800).
    console.send(_v1("stdin", _header("input_reply"), request["header"], b'{"value": "\\ud800"}'))
    reply = _until(console, ask["msg_id"], "execute_reply", seen)
    assert reply["content"]["status"] == "ok", reply
    out = "".join(m["content"].get("text", "") for m in seen if m["header"]["msg_type"] == "stream")
    assert out == "1 0xfffd\n", seen  # U+FFFD in its place
    # The same escape in a cell's code: the cell runs (with U+FFFD), and nothing is lost.
    cell = _header("execute_request")
    console.send(_v1("shell", cell, {}, b'{"code": "y = 1  # \\ud800", "silent": false, '
                                        b'"allow_stdin": false, "stop_on_error": false}'))
    assert _until(console, cell["msg_id"], "execute_reply", [])["content"]["status"] == "ok"
    with contextlib.suppress(Exception):
        console.close()
    _still_there(api, kept)
