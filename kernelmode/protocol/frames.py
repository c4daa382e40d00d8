"""Kernel websocket frames (the ``v1.kernel.websocket.jupyter.org`` protocol), parsed with bounds.

A frame is a little-endian u64 count ``n``, ``n`` u64 offsets, then the channel name and the
message parts (header, parent_header, metadata, content, binary buffers...):
``frame[offsets[i]:offsets[i + 1]]`` is the channel for i = 0 and part i - 1 after it.

jupyter_server's decoder loops over whatever count a frame claims (a 16-byte frame claiming
2**64-1 offsets pins a CPU and eats memory until the process dies) and json-decodes parts of
any size. Here the count, the offsets and each part's size are checked against the frame
before anything is decoded, and each JSON part's shape (nesting depth, number of values) is
measured at C speed before ``json.loads`` builds it: a part of a few MB of ``{}`` costs ~27
times its size as Python objects.

- A client's frame that fails a check is refused whole (:class:`FrameError`).
- A kernel's message whose metadata or content fails is still routed (its header is read) but
  arrives with ``{}`` in place of both and ``msg["dropped"] = {"bytes", "limit", "reason"}``,
  so the run can say what it lost. The gateway marks what it already dropped the same way
  (content ``{"kernelmode_dropped": {...}}``, see kg_extensions).

Bytes that are not UTF-8 and lone surrogates (``"\\udcff"`` escapes) become U+FFFD, as
jupyter_client does for bytes: text that is not text is data, never a crash further on.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import orjson
from jupyter_client.jsonutil import json_default

from ..errors import FrameError, InvalidRequest

CHANNELS = frozenset({"shell", "iopub", "stdin", "control", "hb"})
MIN_PARTS = 4  # header, parent_header, metadata, content
MAX_PARTS = 64  # ... and up to 60 binary buffers (widgets send a few)
MAX_HEADER_BYTES = 64 * 1024  # a header or parent_header (a few hundred bytes in practice)
MAX_JSON_DEPTH = 64  # plotly/vega specs nest ~10 deep; pydantic refuses to dump past ~255
MAX_JSON_VALUES = 1_000_000  # values in one part (~32-100 MB as Python objects at most)
DROPPED = "kernelmode_dropped"  # the gateway's note in place of a content it did not forward

_U64 = 8
# A JSON string (possessive: linear on any input), to look past brackets inside strings.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{},")
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def split_frame(frame: bytes | bytearray | memoryview, max_parts: int = MAX_PARTS) -> tuple[str, list[memoryview]]:
    """(channel, parts) of a v1 frame, after checking its header against its length."""
    view = memoryview(frame)
    size = len(view)
    if size < _U64:
        raise FrameError(f"a frame of {size} bytes has no header")
    count = int.from_bytes(view[:_U64], "little")
    # The count is checked against the frame (each offset takes 8 bytes) before any loop on it.
    if count < MIN_PARTS + 2 or count > max_parts + 2:
        raise FrameError(f"the frame claims {count} offsets: a message has {MIN_PARTS + 2} to "
                         f"{max_parts + 2} (channel, {MIN_PARTS} JSON parts, buffers)")
    table_end = _U64 * (count + 1)
    if table_end > size:
        raise FrameError(f"the frame claims {count} offsets ({table_end} bytes) in {size} bytes")
    # C calls, not a Python step per part: the table read at once, its order checked by sorting.
    offsets = list(struct.unpack_from(f"<{count}Q", view, _U64))
    if offsets[0] < table_end:
        raise FrameError("the frame's first part overlaps its offset table")
    if sorted(offsets) != offsets:
        raise FrameError("the frame's offsets are not in ascending order")
    if offsets[-1] > size:
        raise FrameError(f"the frame's parts end at byte {offsets[-1]}, beyond its {size} bytes")
    channel = str(view[offsets[0]:offsets[1]], "ascii", "replace")
    if channel not in CHANNELS:
        raise FrameError(f"unknown channel {channel[:32]!r}")
    return channel, [view[a:b] for a, b in zip(offsets[1:-1], offsets[2:], strict=True)]


def json_shape_error(data: bytes | bytearray | memoryview, max_depth: int = MAX_JSON_DEPTH,
                     max_values: int = MAX_JSON_VALUES) -> str | None:
    """Why ``data`` (JSON text) is too deep or too many values to decode, or None.

    Measured without building anything: brackets and commas are counted (a cheap upper bound
    that settles most messages), and only when that bound is over a limit are strings cut out
    and the nesting peeled, one level of empty pairs per pass, by C-level regex passes.
    Malformed JSON passes: ``json.loads`` then says what is wrong with it."""
    raw = bytes(data) if not isinstance(data, bytes) else data
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= max_depth and opens + raw.count(b",") < max_values:
        return None
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_STRUCTURE)
    closes = skeleton.count(b"]") + skeleton.count(b"}")
    values = len(skeleton) - closes + 1  # each comma and each container starts a value
    if values > max_values:
        return f"it holds more than {max_values:,} JSON values"
    brackets = skeleton.translate(None, b",")
    for _ in range(max_depth):
        if not brackets:
            return None
        peeled = _EMPTY_PAIR.sub(b"", brackets)
        if len(peeled) == len(brackets):
            return None  # unbalanced: malformed, for json.loads to report
        brackets = peeled
    if brackets and len(_EMPTY_PAIR.sub(b"", brackets)) < len(brackets):
        return f"it nests deeper than {max_depth} levels"
    return None


def scrub_surrogates(value: Any) -> Any:
    """``value`` with each lone surrogate in its strings (keys too) replaced by U+FFFD.

    Iterative: the value may be as deep as the JSON bounds allow."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    root = [value]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, str):
                    node[i] = _SURROGATE.sub("\ufffd", item)
                elif isinstance(item, (list, dict)):
                    stack.append(item)
        elif isinstance(node, dict):
            for key in list(node):
                item = node[key]
                if isinstance(item, str):
                    item = _SURROGATE.sub("\ufffd", item)
                elif isinstance(item, (list, dict)):
                    stack.append(item)
                if isinstance(key, str) and _SURROGATE.search(key):
                    del node[key]
                    node[_SURROGATE.sub("\ufffd", key)] = item
                else:
                    node[key] = item
    return root[0]


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where the first lone surrogate in ``value``'s strings is, said for a person (``code:
    U+D800 at character 2``), or None. A lone surrogate is valid in JSON (``"\\ud800"``) and in a
    Python str, but it is not Unicode text: no UTF-8 encoder (the gateway's, the kernel's) takes
    it. Iterative, like scrub_surrogates."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            m = _SURROGATE.search(node)
            if m is not None:
                at = f"U+{ord(m.group()):04X} at character {m.start()}"
                return f"{path}: {at}" if path else at
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key, item in reversed(list(node.items())):
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _SURROGATE.search(key):
                    return f"{_SURROGATE.sub(chr(0xFFFD), name)}: a lone surrogate in a key"
                stack.append((name, item))
    return None


def refuse_lone_surrogates(value: Any, what: str) -> None:
    """InvalidRequest (422) if ``value`` holds a lone surrogate: refused at the front door, before
    a kernel or the gateway could choke on it, with what to send instead."""
    where = lone_surrogate(value)
    if where is not None:
        raise InvalidRequest(
            f"{what} holds a lone surrogate ({where}), which is not Unicode text and cannot reach "
            "a kernel: send valid text (in code, write such a character as an escape in a string "
            "literal, '\\ud800', or use bytes)")


def loads(data: bytes | bytearray | memoryview, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
          max_values: int = MAX_JSON_VALUES) -> Any:
    """JSON ``data`` decoded, once its size and shape are within bounds (else FrameError)."""
    if len(data) > max_bytes:
        raise FrameError(f"{len(data):,} bytes, over the limit of {max_bytes:,}")
    raw = data if isinstance(data, bytes) else bytes(data)
    problem = json_shape_error(raw, max_depth, max_values)
    if problem is not None:
        raise FrameError(problem)
    # orjson reads valid JSON as the standard library does, 3-5x faster (most of the manager's
    # per-message decoding); whatever it refuses (lone surrogate escapes, bytes that are not
    # UTF-8, NaN, integers past 64 bits) is read below as before. (So the scan for surrogate
    # escapes is made only then.)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    try:
        value = json.loads(raw.decode("utf-8", "replace"))
    except RecursionError:  # a backstop: the shape check already bounds the depth
        raise FrameError("it nests too deeply") from None
    except ValueError as e:
        raise FrameError(f"not JSON: {e}") from None
    return scrub_surrogates(value) if surrogates else value


@dataclass(frozen=True)
class Bounds:
    """What one side of a connection may send: ``max_part_bytes`` for a message's metadata and
    content each; a header stays under MAX_HEADER_BYTES."""

    max_part_bytes: int
    max_depth: int = MAX_JSON_DEPTH
    max_values: int = MAX_JSON_VALUES
    max_parts: int = MAX_PARTS


def decode_frame(raw: str | bytes, bounds: Bounds, lenient: bool = False) -> dict[str, Any]:
    """A frame (v1 binary, or legacy JSON text) as a message dict, within ``bounds``.

    ``lenient`` (a kernel's messages): metadata and content over their bounds are dropped
    with a note instead of refusing the message. Otherwise (a client's) any excess refuses."""
    if isinstance(raw, str):
        data = raw.encode("utf-8", "surrogatepass")
        whole = loads(data, 2 * MAX_HEADER_BYTES + 2 * bounds.max_part_bytes, bounds.max_depth,
                      bounds.max_values)
        if not isinstance(whole, dict) or not isinstance(whole.get("content", {}), dict):
            raise FrameError("a message is a JSON object")
        return whole
    channel, parts = split_frame(raw, bounds.max_parts)
    header = _header_part(parts[0], "header", bounds)
    parent = _header_part(parts[1], "parent_header", bounds)
    msg: dict[str, Any] = {"channel": channel, "header": header, "msg_type": header.get("msg_type"),
                           "parent_header": parent}
    try:
        metadata = loads(parts[2], bounds.max_part_bytes, bounds.max_depth, bounds.max_values)
        content = loads(parts[3], bounds.max_part_bytes, bounds.max_depth, bounds.max_values)
    except FrameError as e:
        if not lenient:
            raise FrameError(f"the message's metadata or content: {e}") from None
        size = len(parts[2]) + len(parts[3])
        msg.update(metadata={}, content={},
                   dropped={"bytes": size, "limit": bounds.max_part_bytes, "reason": str(e)})
        return msg
    if isinstance(content, dict) and isinstance(content.get(DROPPED), dict):
        note = content[DROPPED]  # what the gateway already left out
        msg.update(metadata={}, content={}, dropped={
            "bytes": int(note.get("bytes") or 0), "limit": int(note.get("limit") or 0),
            "reason": str(note.get("reason") or "over the gateway's limit")})
        return msg
    msg.update(metadata=metadata if isinstance(metadata, dict) else {},
               content=content if isinstance(content, dict) else {})
    if len(parts) > MIN_PARTS:  # binary buffers (file transfers): views into the frame, not copies
        msg["buffers"] = parts[MIN_PARTS:]
    return msg


def _header_part(part: memoryview, name: str, bounds: Bounds) -> dict[str, Any]:
    try:
        value = loads(part, MAX_HEADER_BYTES, bounds.max_depth, bounds.max_values)
    except FrameError as e:
        raise FrameError(f"the message's {name}: {e}") from None
    if not isinstance(value, dict):
        raise FrameError(f"the message's {name} is not a JSON object")
    return value


def pack_json(obj: Any) -> bytes:
    """``obj`` as JSON bytes a Jupyter peer can read back and re-encode: never a lone surrogate.

    orjson writes the same JSON (datetimes as jupyter_client's json_default does, UTC as Z),
    several times faster; what it refuses (lone surrogates, integers past 64 bits) is written by
    the standard library, with each lone surrogate as U+FFFD. Written as a ``\\ud800`` escape, a
    lone surrogate passes the gateway and reaches the kernel, whose own re-encoding
    (jupyter_client's json_packer: UTF-8 with surrogateescape, which fails on U+D800..U+DC7F)
    fails when it publishes the cell's execute_input: the handler stops before any
    execute_reply, and the run waited for one until its timeout restarted the kernel (issue 32)."""
    try:
        return orjson.dumps(obj, default=json_default, option=orjson.OPT_UTC_Z)
    except (orjson.JSONEncodeError, TypeError):
        text = json.dumps(obj, default=json_default)
        if _SURROGATE_ESCAPE.search(text.encode()) is not None:  # a copy scrubbed, not obj itself
            text = json.dumps(scrub_surrogates(json.loads(text)))
        return text.encode()


def encode_frame(msg: dict[str, Any], channel: str) -> bytes:
    """A message as a v1 frame (what jupyter_server's serialize_msg_to_ws_v1 makes)."""
    parts = [pack_json(msg["header"]), pack_json(msg["parent_header"]),
             pack_json(msg.get("metadata", {})), pack_json(msg["content"]),
             *(bytes(b) for b in msg.get("buffers") or [])]
    name = channel.encode()
    offsets = [_U64 * (len(parts) + 3)]
    offsets.append(offsets[-1] + len(name))
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    table = b"".join(o.to_bytes(_U64, "little") for o in offsets)
    return len(offsets).to_bytes(_U64, "little") + table + name + b"".join(parts)
