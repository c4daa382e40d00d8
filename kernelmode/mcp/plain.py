"""Plain JSON answers on /mcp where an SSE stream would carry nothing but the answer.

The SDK's client reads an SSE answer up to its JSON-RPC response and then closes the response
before the stream's end arrives, so its HTTP client drops the connection: every call paid a new
TCP connection. A JSON body is read whole and the connection is kept. The stream carries
something besides the answer only when the client asked for progress (``_meta.progressToken``)
or can be asked things mid-call (it declared ``elicitation`` or ``sampling`` at initialize);
otherwise the handler buffers the SDK's SSE answer and sends its one response as JSON.
"""

from __future__ import annotations

import json
from typing import Any

# An answer's events are "event: message" + "data: <one JSON-RPC message>" (sse_starlette).
_DATA = "data:"


def _request(body: bytes) -> dict[str, Any] | None:
    """The JSON-RPC request in a POST body (None: not one single request)."""
    try:
        msg = json.loads(body)
    except ValueError:
        return None
    if not isinstance(msg, dict) or "id" not in msg or not isinstance(msg.get("method"), str):
        return None
    return msg


def plain_client(body: bytes) -> bool | None:
    """For an ``initialize`` request: True if the client cannot be asked anything mid-call (no
    elicitation, no sampling), False if it can; None for any other body."""
    msg = _request(body)
    if msg is None or msg["method"] != "initialize":
        return None
    params = msg.get("params")
    caps = params.get("capabilities") if isinstance(params, dict) else None
    if not isinstance(caps, dict):
        return True
    return caps.get("elicitation") is None and caps.get("sampling") is None


def wants_stream(body: bytes) -> bool:
    """Whether this request's answer needs the SSE stream: it is not one request, or it asked for
    progress notifications."""
    msg = _request(body)
    if msg is None or msg["method"] == "initialize":
        return True
    params = msg.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and meta.get("progressToken") is not None


def sse_answer(stream: bytes) -> bytes | None:
    """The JSON-RPC response (or error) carried by a buffered SSE answer; None when there is no
    single one (then the stream is sent as it is)."""
    found: list[str] = []
    for event in stream.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[len(_DATA):].lstrip(" ") for line in event.split("\n") if line.startswith(_DATA))
        if not data:
            continue
        try:
            msg = json.loads(data)
        except ValueError:
            return None
        if isinstance(msg, dict) and "id" in msg and ("result" in msg or "error" in msg):
            found.append(data)
    return found[0].encode() if len(found) == 1 else None

