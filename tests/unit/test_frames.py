"""The bounded v1 frame parser (kernelmode.protocol.frames): every check before any decode."""

from __future__ import annotations

import json
import tracemalloc
from datetime import datetime, timezone

import pytest
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)

from kernelmode.errors import FrameError, InvalidRequest
from kernelmode.protocol.frames import (
    DROPPED,
    MAX_JSON_DEPTH,
    Bounds,
    decode_frame,
    encode_frame,
    json_shape_error,
    loads,
    lone_surrogate,
    pack_json,
    refuse_lone_surrogates,
    scrub_surrogates,
    split_frame,
)

BOUNDS = Bounds(max_part_bytes=1024 * 1024)


def _msg(content: object, msg_type: str = "execute_request") -> dict:
    return {"header": {"msg_id": "m1", "msg_type": msg_type}, "parent_header": {"msg_id": "p1"},
            "metadata": {}, "content": content}


def _frame(parts: list[bytes], channel: bytes = b"shell", count: int | None = None,
           offsets: list[int] | None = None) -> bytes:
    if offsets is None:
        offsets = [8 * (len(parts) + 3)]
        offsets.append(offsets[-1] + len(channel))
        for p in parts:
            offsets.append(offsets[-1] + len(p))
    n = len(offsets) if count is None else count
    return (n.to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
            + channel + b"".join(parts))


PARTS = [b'{"msg_id": "m", "msg_type": "x"}', b"{}", b"{}", b'{"a": 1}']


def test_round_trip_matches_jupyter_server() -> None:
    msg = _msg({"code": "print(1)", "s": "\u00e9\ud83d\ude00", "n": 2**70, "lone": "\udc00"})
    ours = encode_frame(msg, "shell")
    # The same framing as jupyter_server's; each part the JSON the standard library writes
    # (ours compact, by orjson; the integer past 64 bits as json does; a lone surrogate, which
    # the gateway could not re-encode for the kernel, as U+FFFD).
    theirs = serialize_msg_to_ws_v1(msg, "shell", lambda o: json.dumps(o, separators=(",", ":")).encode())
    _, our_parts = deserialize_msg_from_ws_v1(ours)
    _, their_parts = deserialize_msg_from_ws_v1(bytes(theirs))
    assert [json.loads(p) for p in our_parts[:3]] == [json.loads(p) for p in their_parts[:3]]
    assert json.loads(our_parts[3]) == {**json.loads(their_parts[3]), "lone": "\ufffd"}
    assert json.loads(our_parts[3])["n"] == 2**70
    msg = _msg({"code": "print(1)"})
    ours = encode_frame(msg, "shell")
    assert ours == bytes(serialize_msg_to_ws_v1(msg, "shell", lambda o: json.dumps(o, separators=(",", ":")).encode()))
    channel, parts = deserialize_msg_from_ws_v1(ours)
    assert [bytes(p) for p in split_frame(ours)[1]] == [bytes(p) for p in parts]
    decoded = decode_frame(ours, BOUNDS)
    assert decoded["channel"] == channel == "shell"
    assert decoded["content"] == {"code": "print(1)"} and decoded["msg_type"] == "execute_request"


def test_the_16_byte_frame_claiming_2_64_offsets_is_refused_at_once() -> None:
    frame = (2**64 - 1).to_bytes(8, "little") + b"\0" * 8
    tracemalloc.start()
    with pytest.raises(FrameError, match="offsets"):
        split_frame(frame)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1024 * 1024


@pytest.mark.parametrize("frame, match", [
    (b"", "no header"),
    (b"\x01" + b"\0" * 6, "no header"),
    (_frame(PARTS, count=1000), "offsets"),
    (_frame(PARTS[:3]), "offsets"),  # fewer than the 4 JSON parts
    (_frame(PARTS, count=7)[:60], "offsets"),  # the table runs past the frame's end
    (_frame(PARTS, offsets=[64, 69, 101, 99, 103, 111, 112]), "ascending"),
    (_frame(PARTS, offsets=[64, 69, 101, 103, 105, 10**9, 10**9 + 1]), "beyond"),
    (_frame(PARTS, offsets=[8, 69, 101, 103, 105, 113, 114]), "overlaps"),
    (_frame(PARTS, channel=b"admin"), "channel"),
])
def test_forged_headers_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_frame(frame, BOUNDS)


def test_oversized_part_is_refused_before_decoding() -> None:
    big = b'{"code": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    with pytest.raises(FrameError, match="over the limit"):
        decode_frame(_frame([*PARTS[:3], big]), BOUNDS)
    with pytest.raises(FrameError, match="header"):
        decode_frame(_frame([b'{"x": "' + b"y" * 100_000 + b'"}', *PARTS[1:]]), BOUNDS)


def test_a_kernel_message_over_its_bound_arrives_dropped_with_a_note() -> None:
    big = b"[" + b"{}," * 400_000 + b"{}]"
    msg = decode_frame(_frame([*PARTS[:3], big], channel=b"iopub"), BOUNDS, lenient=True)
    assert msg["content"] == {} and msg["dropped"]["bytes"] >= len(big)
    assert msg["header"]["msg_type"] == "x"  # still routed


def test_the_gateways_note_becomes_dropped() -> None:
    note = json.dumps({DROPPED: {"bytes": 5, "limit": 4, "reason": "r"}}).encode()
    msg = decode_frame(_frame([*PARTS[:3], note], channel=b"iopub"), BOUNDS, lenient=True)
    assert msg["dropped"] == {"bytes": 5, "limit": 4, "reason": "r"}


def test_deep_nesting_is_measured_without_recursion() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert "deeper" in (json_shape_error(deep) or "")
    with pytest.raises(FrameError, match="deeper"):
        loads(deep, 10**7)
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert json_shape_error(ok) is None
    assert json_shape_error(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)) is not None
    # brackets inside strings are text, not nesting
    assert json_shape_error(json.dumps({"t": "[" * 10_000}).encode()) is None
    assert json_shape_error(json.dumps({"t": '\\"[' * 10_000}).encode()) is None


def test_many_values_are_refused_before_decoding() -> None:
    assert "values" in (json_shape_error(b"[" + b"0," * 2_000_000 + b"0]") or "")
    assert json_shape_error(json.dumps({"csv": "1,2," * 1_000_000}).encode()) is None


def test_undecodable_bytes_and_lone_surrogates_become_replacement_chars() -> None:
    content = b'{"text": "a\xffb \\udcff \\ud83d\\ude00", "\\ud800k": ["\\udfff"]}'
    msg = decode_frame(_frame([*PARTS[:3], content], channel=b"iopub"), BOUNDS, lenient=True)
    assert msg["content"] == {"text": "a\ufffdb \ufffd \U0001f600", "\ufffdk": ["\ufffd"]}
    json.dumps(msg, ensure_ascii=False).encode("utf-8")  # encodable: no surrogate is left
    assert scrub_surrogates(["\udcff", {"k": "\ud800"}]) == ["\ufffd", {"k": "\ufffd"}]


def test_nothing_packed_for_the_gateway_holds_a_lone_surrogate() -> None:
    """jupyter_client's json_packer (the gateway's, the kernel's) fails on U+D800..U+DC7F: a
    message carrying one was dropped, and a cell that never arrived never ended (issue 32)."""
    from jupyter_client.session import json_packer

    value = {"code": "# \ud800", "n": 2**70, "\udcffk": ["\udfff", {"d": datetime.now(timezone.utc)}]}
    with pytest.raises(UnicodeEncodeError):
        json_packer(json.loads(json.dumps(value, default=str)))
    packed = json.loads(pack_json(value))
    json_packer(packed)  # the gateway re-encodes it
    assert packed["code"] == "# \ufffd" and packed["\ufffdk"][0] == "\ufffd" and packed["n"] == 2**70
    assert value["code"] == "# \ud800"  # the caller's value untouched


def test_lone_surrogates_are_found_and_refused_with_where() -> None:
    assert lone_surrogate({"a": ["ok", {"b": "x\ud800"}]}) == "a[1].b: U+D800 at character 1"
    assert lone_surrogate({"a": "\U0001f600", "b": ["\u00e9"]}) is None
    with pytest.raises(InvalidRequest, match=r"code holds a lone surrogate \(U\+DCFF at character 4\)"):
        refuse_lone_surrogates("x = \udcff", "code")
