"""kernelmode.mcp.plain: which /mcp answers may be plain JSON, and the answer out of an SSE stream."""

from __future__ import annotations

import json

from kernelmode.mcp.plain import plain_client, sse_answer, wants_stream


def _req(method: str, **params: object) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 7, "method": method, "params": params}).encode()


def test_initialize_says_whether_the_client_can_be_asked() -> None:
    assert plain_client(_req("initialize", capabilities={})) is True
    assert plain_client(_req("initialize", capabilities={"roots": {}})) is True
    assert plain_client(_req("initialize", capabilities={"elicitation": {}})) is False
    assert plain_client(_req("initialize", capabilities={"sampling": {}})) is False
    assert plain_client(_req("tools/call", name="run_python")) is None
    assert plain_client(b"not json") is None


def test_stream_is_kept_for_progress_notifications_and_odd_bodies() -> None:
    assert not wants_stream(_req("tools/call", name="run_python", arguments={}))
    assert wants_stream(_req("tools/call", name="run_python", _meta={"progressToken": 1}))
    assert wants_stream(_req("initialize", capabilities={}))
    assert wants_stream(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]')  # a batch
    assert wants_stream(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
    assert wants_stream(b"{")


def test_sse_answer_takes_the_one_response() -> None:
    answer = {"jsonrpc": "2.0", "id": 7, "result": {"content": [], "note": "a\n\nb"}}
    note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {}}
    stream = (f"event: message\r\ndata: {json.dumps(note)}\r\n\r\n: ping\r\n\r\n"
              f"event: message\r\ndata: {json.dumps(answer)}\r\n\r\n").encode()
    assert json.loads(sse_answer(stream) or b"") == answer
    assert sse_answer(b"") is None
    assert sse_answer(b"data: {broken\n\n") is None
    two = f"data: {json.dumps(answer)}\n\ndata: {json.dumps(answer)}\n\n".encode()
    assert sse_answer(two) is None  # not a single response: sent as it came

