"""kernelmode.mcp.oversize: an oversized /mcp request's id and method from its first (or last)
bytes, and its in-protocol answer."""

from __future__ import annotations

import json

from kernelmode.mcp.oversize import (
    HEAD_BYTES,
    TAIL_BYTES,
    OversizeBody,
    answer,
    request_fields,
    scan_head,
)

BIG = "A" * (3 * HEAD_BYTES)


def body_of(*chunks: bytes) -> OversizeBody:
    b = OversizeBody()
    for c in chunks:
        b.feed(c)
    return b


def test_keeps_only_the_ends() -> None:
    raw = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                      "params": {"name": "upload_file", "arguments": {"content_base64": BIG}}}).encode()
    b = body_of(*(raw[i:i + 1000] for i in range(0, len(raw), 1000)))
    assert b.size == len(raw) and len(b.head) == HEAD_BYTES and len(b.tail) == TAIL_BYTES
    assert bytes(b.head) == raw[:HEAD_BYTES] and b.tail == raw[-TAIL_BYTES:]
    assert request_fields(b) == (9, "tools/call", "upload_file")


def test_the_id_written_last_is_found_in_the_tail() -> None:
    raw = (b'{"method":"tools/call","params":{"name":"upload_file","arguments":{"id":1,"x":"'
           + BIG.encode() + b'"}},"jsonrpc":"2.0","id":"req-7"}')
    assert request_fields(body_of(raw)) == ("req-7", "tools/call", "upload_file")


def test_nested_ids_are_not_the_request_id() -> None:
    assert scan_head(b'{"params":{"id":5,"name":"x"},"method":"m"') == {("method",): "m", ("params", "name"): "x"}
    nested_last = b'{"method":"m","params":{"x":"' + BIG.encode() + b'","id":3}}'
    assert request_fields(body_of(nested_last))[0] is None
    assert scan_head(b'[{"id":1}]') == {}  # a batch has no one id
    assert scan_head(b'{"id":true}') == {("id",): True}
    assert request_fields(body_of(b'{"id":true,"method":"m"}'))[0] is None  # not a JSON-RPC id


def test_a_tool_call_gets_an_error_result_with_its_id() -> None:
    raw = json.dumps({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                      "params": {"name": "upload_file", "arguments": {"content_base64": BIG}}}).encode()
    status, out = answer(body_of(raw), cap=1000)
    msg = json.loads(out)
    assert status == 200 and msg["id"] == 4 and msg["result"]["isError"] is True
    text = msg["result"]["content"][0]["text"]
    assert "1000 bytes" in text and "PUT /v1/sessions/{session_id}/files/{path}" in text
    assert "upload_file was not run" in text


def test_other_requests_get_an_error_and_no_id_a_413() -> None:
    status, out = answer(body_of(b'{"jsonrpc":"2.0","id":5,"method":"tools/list","params":{"x":"'
                                 + BIG.encode() + b'"}}'), cap=1000)
    assert status == 200 and json.loads(out)["error"]["code"] == -32600
    status, out = answer(body_of(b'{"jsonrpc":"2.0","method":"notifications/x","params":{"x":"'
                                 + BIG.encode() + b'"}}'), cap=1000)
    assert status == 413 and json.loads(out)["id"] is None
