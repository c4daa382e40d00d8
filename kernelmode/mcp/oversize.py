"""An MCP request over /mcp's body cap, answered inside the protocol instead of a bare HTTP 413.

A transport-level 413 (or a connection closed mid-upload) makes the SDK's client drop the whole
MCP connection, and the model loses it for one oversized ``upload_file``. So /mcp reads such a
body to its end (up to ``drain_limit``; beyond, the connection is closed as before) but keeps
only its first ``HEAD_BYTES`` and last ``TAIL_BYTES``: the JSON-RPC ``id`` (and ``method``)
are found there without decoding megabytes. Clients write ``id`` first (the SDK does:
``{"jsonrpc", "id", "method", "params"}``); a client that writes it last is found in the tail.
The answer is the request's own JSON-RPC response: a tool result with ``isError`` for a
``tools/call`` (naming the cap and the REST upload route), a JSON-RPC error otherwise, and a
413 carrying a JSON-RPC error when no id was found (the SDK's client files that under its
request's id too).
"""

from __future__ import annotations

import json
import re
from typing import Any

HEAD_BYTES = 64 * 1024
TAIL_BYTES = 4 * 1024
INVALID_REQUEST = -32600  # JSON-RPC's code; what the SDK answers for a request it refuses

# One JSON token at a time: a string, a structural character, or a scalar.
_TOKEN = re.compile(rb'\s*(?:("[^"\\]*(?:\\.[^"\\]*)*")|([{}\[\]:,])|(-?[0-9][0-9.eE+-]*|true|false|null))')
# A top-level id written as the body's last member: `..., "id": 7}`.
_TAIL_ID = re.compile(rb'"id"\s*:\s*(-?[0-9]{1,18}|"[^"\\]{0,256}")\s*}\s*$')
_WANTED = {("id",), ("method",), ("params", "name")}


class OversizeBody:
    """What is kept of an oversized body while the rest is read and dropped."""

    def __init__(self) -> None:
        self.size = 0
        self.head = bytearray()
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        room = HEAD_BYTES - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail = (self.tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]


def scan_head(head: bytes) -> dict[tuple[str, ...], Any]:
    """The top-level ``id``, ``method`` and ``params.name`` found in the first bytes of a JSON
    object (a truncated one: the scan stops at the first token it cannot complete)."""
    found: dict[tuple[str, ...], Any] = {}
    keys: list[str | None] = []  # per open container: the key whose value is being read
    kinds: list[bytes] = []
    key_next = False
    pos = 0
    while len(found) < len(_WANTED):
        m = _TOKEN.match(head, pos)
        if m is None:
            break
        pos = m.end()
        string, punct, scalar = m.groups()
        if punct in (b"{", b"["):
            if not kinds and punct == b"[":
                break  # a batch: no one id
            kinds.append(punct)
            keys.append(None)
            key_next = punct == b"{"
        elif punct in (b"}", b"]"):
            if not kinds:
                break
            kinds.pop()
            keys.pop()
            key_next = False
        elif punct == b",":
            key_next = bool(kinds) and kinds[-1] == b"{"
        elif punct == b":":
            key_next = False
        elif string is not None and key_next:
            keys[-1] = json.loads(string) if len(string) < 256 else None
            key_next = False
        else:  # a scalar or string value
            path = tuple(k for k in keys if k is not None)
            if len(path) == len(keys) and path in _WANTED:
                found[path] = json.loads(string if string is not None else scalar)
    return found


def request_fields(body: OversizeBody) -> tuple[int | str | None, str | None, str | None]:
    """(id, method, tool name) of the oversized request, each None where not found."""
    found = scan_head(bytes(body.head))
    rid = found.get(("id",))
    if ("id",) not in found:
        m = _TAIL_ID.search(body.tail)
        rid = json.loads(m.group(1)) if m else None
    if isinstance(rid, bool) or not isinstance(rid, (int, str)):
        rid = None
    method, tool = found.get(("method",)), found.get(("params", "name"))
    return rid, method if isinstance(method, str) else None, tool if isinstance(tool, str) else None


def advice(size: int, cap: int, tool: str | None) -> str:
    what = f"{tool} was not run" if tool else "it was not read"
    return (f"This MCP request is {size} bytes, over this server's limit of {cap} bytes "
            f"({cap / 2**20:g} MiB, mcp.max_request_bytes), so {what}. Send large files over REST instead: "
            "PUT /v1/sessions/{session_id}/files/{path} with the file's bytes as the body (same "
            "bearer token; session_id as run_python reports it), then read the file from "
            "run_python. This connection is still open.")


def answer(body: OversizeBody, cap: int) -> tuple[int, bytes]:
    """(HTTP status, JSON body) answering an oversized request."""
    rid, method, tool = request_fields(body)
    text = advice(body.size, cap, tool if method == "tools/call" else None)
    if rid is None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": None,
                               "error": {"code": INVALID_REQUEST, "message": text}}
        return 413, json.dumps(msg).encode()
    if method == "tools/call":
        result = {"content": [{"type": "text", "text": text}], "isError": True}
        return 200, json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()
    error = {"code": INVALID_REQUEST, "message": text}
    return 200, json.dumps({"jsonrpc": "2.0", "id": rid, "error": error}).encode()
