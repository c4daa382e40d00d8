"""Every decoder on a trust boundary is bounded first, and text that is not text is data.

Attacks from a token holder (frames on the console websocket, bodies with lone surrogates) and
from kernel code (a giant display message, huge or deeply nested tool requests, output that
is not UTF-8): each is refused or cut with a note to the caller, and neither the server nor
another session notices.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from kernelmode.protocol.frames import encode_frame
from tests.conftest import Server
from tests.support.mcp_raw import MCP_HEADERS, initialize, rpc_answer

WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"
MB = 1024 * 1024


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (proc(5))


@pytest.fixture()
def channels(server: Server, session_factory: Callable[..., str]) -> Iterator[Callable[[], ClientConnection]]:
    """Open the console websocket of a fresh session (closed after the test)."""
    sid = session_factory()
    with contextlib.ExitStack() as opened:

        def open_ws() -> ClientConnection:
            return opened.enter_context(connect(
                f"ws{server.url[4:]}/v1/sessions/{sid}/channels",
                additional_headers={"Authorization": f"Bearer {server.token}"},
                subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                open_timeout=60, max_size=None))

        yield open_ws


def _closed_with(ws: ClientConnection, frame: bytes) -> tuple[int | None, str]:
    """Send ``frame``, then read until the server closes the websocket: (code, reason)."""
    with pytest.raises(ConnectionClosed) as info:
        ws.send(frame)
        while True:
            ws.recv(timeout=60)
    rcvd = info.value.rcvd
    return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")


def _still_serving(server: Server, sid: str) -> None:
    """The server answers probes and another session's run."""
    with server.client(timeout=120) as c:
        assert c.get("/healthz").status_code == 200
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "print(6 * 7)", "timeout_seconds": 60})
        assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text


def _frame(parts: list[bytes], count: int | None = None, offsets: list[int] | None = None) -> bytes:
    channel = b"shell"
    if offsets is None:
        offsets = [8 * (len(parts) + 3)]
        offsets.append(offsets[-1] + len(channel))
        for p in parts:
            offsets.append(offsets[-1] + len(p))
    n = len(offsets) if count is None else count
    return (n.to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
            + channel + b"".join(parts))


HEADER = json.dumps({"msg_id": "a1", "msg_type": "execute_request", "session": "s", "username": "u",
                     "date": "2024-01-01T00:00:00Z", "version": "5.3"}).encode()
GOOD = [HEADER, b"{}", b"{}", b'{"code": "1", "silent": false}']
CONSOLE_PART_LIMIT = 6 * MB + 64 * 1024  # 6 x sessions.max_code_bytes + slack (the default)

ATTACKS = {
    # the frame: 16 bytes claiming 2**64-1 offsets (the old decoder looped on it)
    "huge-count": (2**64 - 1).to_bytes(8, "little") + b"\0" * 8,
    "count-beyond-frame": _frame(GOOD, count=10_000),
    "descending-offsets": _frame(GOOD, offsets=[56, 61, 200, 150, 210, 220]),
    "offsets-beyond-frame": _frame(GOOD, offsets=[56, 61, 100, 102, 104, 10**12]),
    "oversized-part": _frame([*GOOD[:3], b'{"code": "' + b"x" * (CONSOLE_PART_LIMIT + 1000) + b'"}']),
    "deep-nesting": _frame([*GOOD[:3], b'{"code": "1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]),
    "many-values": _frame([*GOOD[:3], b'{"code": "1", "x": [' + b"{}," * 1_500_000 + b"{}]}"]),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_forged_console_frame_closes_only_its_connection(
        name: str, server: Server, channels: Callable[[], ClientConnection],
        session_factory: Callable[..., str]) -> None:
    other = session_factory()
    code, reason = _closed_with(channels(), ATTACKS[name])
    assert code == 4400 and reason.startswith("refused frame"), (code, reason)
    _still_serving(server, other)
    # a console that speaks properly still works on the same session
    ok = channels()
    msg = {"header": {"msg_id": uuid.uuid4().hex, "msg_type": "kernel_info_request", "session": "s",
                      "username": "u", "date": "2024-01-01T00:00:00Z", "version": "5.3"},
           "parent_header": {}, "metadata": {}, "content": {}}
    ok.send(encode_frame(msg, "shell"))
    for _ in range(50):
        raw = ok.recv(timeout=60)
        if isinstance(raw, bytes) and b"kernel_info_reply" in raw:
            break
    else:
        pytest.fail("no kernel_info_reply")


def test_a_frame_over_the_websocket_cap_is_refused_by_size(server: Server,
                                                           channels: Callable[[], ClientConnection]) -> None:
    big = _frame([*GOOD[:3], b'{"code": "' + b"x" * (CONSOLE_PART_LIMIT + 200 * 1024) + b'"}'])
    code, _ = _closed_with(channels(), big)
    # 1009 (message too big): tornado refuses it before buffering more and before our parser
    # (which would say 4400). The close frame may be lost to a reset while the client still sends.
    assert code in (1009, None), code
    with server.client() as c:
        assert c.get("/healthz").status_code == 200


def _publish(n: int) -> str:
    # [{}] * n: one dict, n times, so the kernel holds n pointers while the message carries
    # n JSON objects ("{}, " each) that a decoder would build one by one.
    return ("from IPython.display import publish_display_data\n"
            f"publish_display_data({{'application/json': [{{}}] * {n}}})\n"
            "print('published')\n")


@pytest.mark.parametrize("n", [8_500_000, 3_000_000], ids=["34MB-cut-by-the-gateway", "12MB-cut-by-the-manager"])
def test_a_giant_display_message_is_dropped_with_a_note(
        n: int, server: Server, session_factory: Callable[..., str], run: Callable[..., dict]) -> None:
    sid, other = session_factory(), session_factory()
    assert run(sid, "kept = 'still here'")["status"] == "ok"
    _reset_peak(server.proc.pid)
    before = _status(server.proc.pid)
    res = run(sid, _publish(n), timeout_seconds=300)
    after = _status(server.proc.pid)
    assert res["status"] == "ok" and res["state_lost"] is False, {k: res[k] for k in ("status", "error")}
    assert res["stdout"] == "published\n"
    assert res["outputs_dropped"] == 1 and res["truncated"] is True and res["outputs"] == []
    assert "was not read" in res["stderr"], res["stderr"]
    growth_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    # Decoded, the message costs ~27 times its size (+926 MB for 34 MB before the bound).
    assert growth_mb < 150, f"the manager's peak RSS grew by {growth_mb:.0f} MB"
    assert run(sid, "print(kept)")["stdout"] == "still here\n"
    assert run(other, "print('other')")["stdout"] == "other\n"


TOOL_CALL = """
import json, uuid
import kernelmode_preamble as kp
def raw_call(payload):
    return json.loads(kp._bridge._raw_input(kp.MARKER + payload))
def call(arguments):
    try:
        kp._bridge.call('nope', arguments)
    except kp.ToolError as e:
        return str(e)
"""


def test_oversized_tool_requests_fail_at_once(session_factory: Callable[..., str], run: Callable[..., dict]) -> None:
    sid = session_factory()
    res = run(sid, TOOL_CALL + "print(call({'x': 'a' * 30_000_000}))\nprint(call({'x': 'a' * 9_000_000}))",
              timeout_seconds=120)
    assert res["status"] == "ok", res["error"]
    huge, big = res["stdout"].splitlines()
    assert "30,0" in huge and "over the limit" in huge, huge  # cut before the manager reads it
    assert "over the limit of 8388608 bytes" in big, big  # the broker's cap, checked before parsing
    assert [c["ok"] for c in res["tool_calls"]] == [False, False]
    assert run(sid, "print('next')")["stdout"] == "next\n"


def test_a_deeply_nested_tool_request_fails_at_once(session_factory: Callable[..., str],
                                                    run: Callable[..., dict]) -> None:
    sid = session_factory()
    code = TOOL_CALL + (
        "cid = uuid.uuid4().hex\n"
        "deep = '{\"id\": \"%s\", \"tool\": \"nope\", \"arguments\": {\"a\": %s}}' % "
        "(cid, '[' * 100_000 + ']' * 100_000)\n"
        "reply = raw_call(deep)\n"
        "print(reply['id'] == cid, reply['ok'], reply['error'])\n"
        "print(call({'a': eval('[' * 70 + ']' * 70)}))\n"
    )
    res = run(sid, code, timeout_seconds=120)  # it used to hang until this timeout
    assert res["status"] == "ok", res["error"]
    first, second = res["stdout"].splitlines()
    assert first.startswith("True False") and "deeper than 64" in first, first
    assert "deeper than 64" in second, second


# -- Unicode that is not text ------------------------------------------------------------------------

OUTPUTS = {
    "print-surrogate": "print('a\\udcffb')",
    "print-high-surrogate": "import sys; sys.stdout.write('c\\ud800d\\n')",
    "raw-byte": "import os, sys; sys.stdout.flush(); os.write(1, b'e\\xfff\\n')",
    "bad-file-name": "import os; os.makedirs('/tmp/d', exist_ok=True); "
                     "open(os.fsdecode(b'/tmp/d/n\\xffm'), 'w').close(); print(*os.listdir('/tmp/d'))",
    "display-surrogate": "from IPython.display import publish_display_data; "
                         "publish_display_data({'text/plain': 'g\\udcffh', 'application/json': {'k\\udcff': 1}})",
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_kernel_output_that_is_not_utf8_is_data(name: str, session_factory: Callable[..., str],
                                               run: Callable[..., dict], api: httpx.Client) -> None:
    sid = session_factory()
    assert run(sid, "kept = 41")["status"] == "ok"
    res = run(sid, OUTPUTS[name], timeout_seconds=60)
    assert res["status"] in ("ok", "error") and res["state_lost"] is False, res
    assert res["status"] != "kernel_died"
    after = run(sid, "print(kept + 1)")
    assert after["status"] == "ok" and after["stdout"] == "42\n" and after["state_lost"] is False, after
    assert api.get(f"/v1/sessions/{sid}/notebook").status_code == 200
    assert api.get(f"/v1/runs/{res['run_id']}").status_code == 200


def test_a_lone_surrogate_in_the_code_is_refused(session_factory: Callable[..., str],
                                                api: httpx.Client) -> None:
    """Refused before any kernel sees it (a high one wedged the run: test_malformed_text.py)."""
    sid = session_factory()
    assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "kept = 1"}).status_code == 200
    body = b'{"code": "x = \'\\udcff\'\\nprint(len(x))"}'  # the escape, as JSON allows
    for url in (f"/v1/sessions/{sid}/execute", "/v1/execute"):
        r = api.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "lone surrogate" in r.json()["error"]["message"], r.text
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(kept)"})
    assert r.status_code == 200 and r.json()["stdout"] == "1\n" and not r.json()["state_lost"], r.text


@pytest.mark.parametrize("body", [
    b'{"tools": ["\\udcff"]}',
    b'{"session_id": "a\\udcff"}',
    b'{"limits": {"memory_mb": "\\udcff"}}',
])
def test_a_lone_surrogate_in_session_fields_is_a_clear_error(body: bytes, api: httpx.Client) -> None:
    r = api.post("/v1/sessions", content=body, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["code"]




def test_a_lone_surrogate_in_mcp_run_python_is_answered(server: Server) -> None:
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        sess = initialize(c)
        body = (b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "run_python", '
                b'"arguments": {"code": "x = \'\\udcff\'\\nprint(len(x))"}}}')
        r = c.post("/mcp", content=body, headers=sess)
        assert r.status_code < 500, r.text
        answer = rpc_answer(r)
        # The SDK parses the body itself: it answers a JSON-RPC parse error (pydantic refuses
        # lone surrogates), or runs the code; either way an answer, and the connection goes on.
        assert answer.get("id") == 2 or answer["error"]["code"] == -32700, answer
        r = c.post("/mcp", json={"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "run_python", "arguments": {"code": "print('after')"}}}, headers=sess)
        assert r.status_code == 200 and "after" in json.dumps(rpc_answer(r)), r.text
        c.delete("/mcp", headers=sess)
