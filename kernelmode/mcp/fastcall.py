"""A direct route at /mcp for the calls that are most of the traffic: ``run_python`` and
``get_run`` from a client that only ever gets plain JSON answers (plain.py).

Why: the SDK's way through for one tool call (its transport, memory streams, a dispatcher task,
the middleware chain, a JSON-RPC model per message) cost about 4 ms of CPU per call on top of the
run itself, more than the manager spends on the run (bench/RESULTS.md, "MCP fast calls"). For a
call whose whole answer is one JSON body, none of that machinery carries anything: this module
checks what the SDK would check, runs the registered tool itself and writes the same JSON-RPC
answer (same serializer, same message cap).

Anything it does not recognise exactly goes the SDK's way (``match`` returns None): another
method or tool, a batch, a progress token, arguments that do not validate (the SDK answers with
its own error), an unknown or another tenant's connection id, a connection that has not finished
its initialize, a protocol version it does not know. Which connections are open, whose, and
plain, is the front door's own table (open_connections.py), not the SDK's. What is skipped: the SDK's OpenTelemetry span
for the call, and ``notifications/cancelled`` for it (a cancelled call's run goes on, as over
REST, where a run outlives its request).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver.exceptions import ResourceError, ToolError, UnexpectedToolError
from mcp.server.mcpserver.tools.base import Tool
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent
from mcp_types.methods import serialize_server_result
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from .connections import SESSION_HEADER, TENANT_HEADER
from .open_connections import Connection

log = logging.getLogger(__name__)

# Tools answered here: the run tools, whose context use is the connection's headers only.
FAST_TOOLS = frozenset({"run_python", "get_run"})
_METHOD = "tools/call"
_PARAMS = frozenset({"name", "arguments", "_meta"})
VERSION_HEADER = "mcp-protocol-version"


class HeadersContext:
    """What the run tools use of the SDK's ``Context`` over HTTP: the request's headers (the
    connection's id and the caller's tenant). No ``session``: a plain client cannot be asked
    anything (elicit.py then finds no capability), and progress was not asked for."""

    sends_progress = False  # answers.RunAnswers then waits for a run's end, not each output

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    async def report_progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """No progress token: nothing to send (the SDK's Context does the same)."""


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


@dataclass(frozen=True)
class FastCall:
    """A recognised call: the JSON-RPC id, the tool and its validated arguments."""

    request_id: int | str
    tool: Tool
    arguments: dict[str, Any]
    version: str
    mcp_session: str


def parse_call(body: bytes) -> tuple[int | str, str, dict[str, Any]] | None:
    """(id, tool name, raw arguments) of a body that is exactly one ``tools/call`` request for a
    fast tool without a progress token; None for anything else."""
    try:
        msg = json.loads(body)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or msg.get("method") != _METHOD:
        return None
    rid, params = msg.get("id"), msg.get("params")
    if isinstance(rid, bool) or not isinstance(rid, (int, str)) or not isinstance(params, dict):
        return None
    if set(msg) - {"jsonrpc", "id", "method", "params"} or set(params) - _PARAMS:
        return None
    name, args, meta = params.get("name"), params.get("arguments", {}), params.get("_meta")
    if name not in FAST_TOOLS or not isinstance(args, dict):
        return None
    if meta is not None and (not isinstance(meta, dict) or meta.get("progressToken") is not None):
        return None
    return rid, str(name), args


class FastCalls:
    """Recognises the fast calls of plain clients and answers them."""

    def __init__(self, kmcp: Any) -> None:
        """``kmcp``: the KernelmodeMCP (its fast tools, its start, its message cap)."""
        self.kmcp = kmcp

    def match(self, headers: Mapping[str, str], body: bytes, conn: Connection | None) -> FastCall | None:
        """The call in this POST if this route may answer it exactly as the SDK would. ``conn``:
        the open connection the request names, already found to be the caller's own."""
        sid = headers.get(SESSION_HEADER)
        if sid is None or conn is None or not conn.plain:
            return None
        version = headers.get(VERSION_HEADER)
        accept = headers.get("accept", "")
        if (version not in HANDSHAKE_PROTOCOL_VERSIONS or "application/json" not in accept
                or "text/event-stream" not in accept
                or not headers.get("content-type", "").startswith("application/json")):
            return None  # the SDK answers these (406, 415, the era routing)
        parsed = parse_call(body)
        if parsed is None:
            return None
        rid, name, raw = parsed
        tool = self.kmcp.fast_tools.get(name)
        if tool is None or tool.context_kwarg != "ctx" or tool.resolved_params:
            return None
        try:
            arguments = tool.fn_metadata.validate_arguments(raw)
        except Exception:  # the SDK gives its own answer to arguments that do not validate
            return None
        return FastCall(rid, tool, arguments, str(version), sid)

    async def answer(self, call: FastCall, tenant: str, authorization: str) -> bytes:
        """Run the tool and give the JSON-RPC answer (result, or error), as the SDK would.
        ``authorization``: the caller's, for a session another manager owns (remote.py)."""
        ctx = HeadersContext({SESSION_HEADER: call.mcp_session, TENANT_HEADER: tenant,
                              "authorization": authorization})
        envelope: dict[str, Any] = {"jsonrpc": "2.0", "id": call.request_id}
        try:
            await self.kmcp.await_start()  # what the SDK route's middleware does first
            # convert_result also checks the structured content against the output model.
            result = call.tool.fn_metadata.convert_result(await call.tool.fn(**call.arguments, ctx=ctx))
            dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
            dumped = serialize_server_result(_METHOD, call.version, dumped)
            # Encoded once and measured as sent; encoded again only if the cap cut it.
            body = _encode({**envelope, "result": dumped})
            capped = await self.kmcp.cap_answer(_METHOD, dumped, len(body))
            if capped is dumped:
                return body
            envelope["result"] = capped
        except MCPError as e:
            envelope["error"] = e.error.model_dump(by_alias=True, mode="json", exclude_none=True)
        except Exception as e:  # as the SDK answers: a deliberate ToolError's text, else none
            if isinstance(e, (ToolError, ResourceError)) and not isinstance(e, UnexpectedToolError):
                text = f"Error executing tool {call.tool.name}: {e}"
            else:
                log.exception("Tool %r raised an unexpected exception", call.tool.name)
                text = f"Error executing tool {call.tool.name}"
            failed = CallToolResult(content=[TextContent(text=text)], is_error=True)
            envelope["result"] = failed.model_dump(by_alias=True, mode="json", exclude_none=True)
        return _encode(envelope)
