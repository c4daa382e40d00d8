"""ToolBroker: answers tool calls that kernel code makes over its session's stdin channel.

The session is known from the channel the request came on (the caller passes it), never from
the request. Every call is checked (allow-list, rate, sizes), run with a timeout, logged, and
recorded for the RunResult.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..audit import audit
from ..config import ToolBrokerSettings
from ..errors import InvalidRequest, ToolFailed
from ..models import ToolCall
from ..protocol import PING, SEARCH
from ..protocol.frames import json_shape_error
from .approval_budget import ApprovalBounds
from .approvals import Approvals, shown_arguments
from .registry import ToolRegistry, allowed

# A ToolFailed's details when a call needing approval was denied (by a person, the timeout, or
# the run's end): the kernel then raises its ToolDenied, the one class of that name.
_DENIED = {"denied": True}
# The call id at the head of the preamble's request: read without parsing, so that a request
# refused before it is parsed is still answered as its call.
MAX_RECORDED_NAME = 256  # characters of a tool name kept in a record (configured names: 64 at most)
_CALL_ID = re.compile(r'\{"id": "([0-9a-f]{32})"')


def _call_id(payload: str) -> str | None:
    m = _CALL_ID.match(payload[:64])
    return m.group(1) if m else None


@dataclass
class RateLimiter:
    """Token bucket: ``rate`` calls per second, bursts up to ``burst``."""

    rate: float
    burst: int
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class ToolBroker:
    def __init__(self, registry: ToolRegistry, settings: ToolBrokerSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.approvals = Approvals(ApprovalBounds(
            settings.max_pending_approvals_per_session, settings.max_pending_approvals_per_tenant,
            settings.max_pending_approval_bytes_per_session, settings.max_pending_approval_bytes_per_tenant))
        self._limiters: dict[str, RateLimiter] = {}
        # Calls the manager answers itself (name -> handler(session_id, arguments)), e.g. the
        # preamble's %pip install; they are not tools, so no allow-list or tool rate applies.
        self.reserved: dict[str, Callable[[str, dict[str, Any]], Awaitable[Any]]] = {}

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a tool of this server or one of its reserved calls (the names a
        metric label may carry; anything a kernel made up is not)."""
        return name in self.reserved or self.registry.get(name) is not None

    def forget_session(self, session_id: str) -> None:
        self._limiters.pop(session_id, None)

    async def handle(self, session_id: str, run_id: str, allow: list[str] | None,
                     payload: str) -> tuple[str, ToolCall | None]:
        """Answer one request (the JSON after the preamble's marker): (reply JSON, record).

        The preamble's stdin ping is answered here too, with no record."""
        started = time.monotonic()
        limit = self.settings.max_argument_bytes
        call_id: Any = _call_id(payload)
        name = "?"
        # Sizes first, then shape, then parsing: json.loads of a request of many small values
        # builds many times its size in objects, and recurses on deep nesting.
        bytes_in = len(payload)  # characters: at most the bytes, enough to refuse a huge one
        try:
            if bytes_in <= limit:
                data = payload.encode("utf-8", errors="replace")
                bytes_in = len(data)
            if bytes_in > limit:
                raise ToolFailed(f"arguments are over the limit of {limit} bytes; pass a file path instead")
            problem = json_shape_error(data)
            if problem is not None:
                raise ToolFailed(f"the request cannot be read: {problem}")
            try:
                request = json.loads(data)
                call_id, name, arguments = request["id"], str(request["tool"]), request["arguments"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise ToolFailed("malformed tool request") from None
            if name == PING:
                return json.dumps({"id": call_id, "ok": True, "result": "pong"}), None
            if not isinstance(arguments, dict):
                raise ToolFailed("arguments must be a mapping of parameter names to values")
            if name == SEARCH:
                return self._search(session_id, call_id, arguments, allow), None
            handler = self.reserved.get(name)
            if handler is not None:
                return self._reply(call_id, await handler(session_id, arguments)), \
                    self._record(session_id, run_id, name, None, started, bytes_in, 0)
            tool = self.registry.get(name)
            if tool is None or not allowed(name, allow):
                # The same answer for "does not exist" and "not allowed here".
                raise ToolFailed("unknown tool (call tools.help() to list the tools of this session)")
            limiter = self._limiters.setdefault(
                session_id, RateLimiter(self.settings.rate_per_second, self.settings.rate_burst))
            if not limiter.take():
                raise ToolFailed(f"rate limit: at most {self.settings.rate_per_second:g} tool calls "
                                 "per second in a session; batch the work into fewer calls")
            if self.registry.requires_approval(name):
                # While it waits (minutes), hold the request's text only: its parsed copies go
                # now and it is read again once approved (approval_budget.py bounds the text).
                shown = shown_arguments(arguments)
                del arguments, request, data
                await self._approve(session_id, run_id, call_id, name, shown, bytes_in)
                arguments = json.loads(payload.encode("utf-8", errors="replace"))["arguments"]
            result = await tool.call(arguments, self.settings.call_timeout_seconds)
            try:
                reply = json.dumps({"id": call_id, "ok": True, "result": result})
            except (TypeError, ValueError) as e:
                raise ToolFailed(f"the tool returned data that is not JSON: {e}") from None
            if len(reply) > self.settings.max_result_bytes:
                raise ToolFailed(f"the result is {len(reply)} bytes, over the limit of "
                                 f"{self.settings.max_result_bytes}")
            error = None
        except ToolFailed as e:
            error = str(e) or "failed"
            # denied: the kernel raises its ToolDenied (a ToolError) rather than ToolError
            reply = json.dumps({"id": call_id, "ok": False, "error": error,
                                **(_DENIED if e.details == _DENIED else {})})
        return reply, self._record(session_id, run_id, name, error, started, bytes_in, len(reply))

    def _search(self, session_id: str, call_id: Any, arguments: dict[str, Any], allow: list[str] | None) -> str:
        """tools.search() in a kernel: ranked over the tools this session may call, and no other."""
        limiter = self._limiters.setdefault(
            session_id, RateLimiter(self.settings.rate_per_second, self.settings.rate_burst))
        if not limiter.take():
            raise ToolFailed(f"rate limit: at most {self.settings.rate_per_second:g} tool calls per second")
        try:
            matches = self.registry.search(arguments.get("query"), arguments.get("limit", 8), allow)  # type: ignore[arg-type]
        except InvalidRequest as e:
            raise ToolFailed(e.message) from None
        return json.dumps({"id": call_id, "ok": True, "result": [m.model_dump() for m in matches]})

    async def _approve(self, session_id: str, run_id: str, call_id: Any, name: str,
                       shown: dict[str, Any], size: int) -> None:
        """Wait for the call's approval (the gate of its run; ``shown``: the arguments as listed,
        ``size``: the request's bytes); unless approved, a ToolFailed that the kernel raises as its
        ``ToolDenied``."""
        gate = self.approvals.gate(run_id)
        if gate is None or gate.session_id != session_id:
            audit("approval_decided", session_id=session_id, run_id=run_id, tool=name, approved=False,
                  by="no_gate", reason="a console cell cannot wait for approval")
            raise ToolFailed(f"{name} requires approval, which only a run started through REST or MCP "
                             "can wait for (not a console cell)", details=_DENIED)
        decision = await gate.request(call_id if isinstance(call_id, str) else None, name, shown,
                                      self.settings.approval_timeout_seconds, size)
        if decision.by == "bound":
            raise ToolFailed(f"{name} was not put up for approval: {decision.reason}", details=_DENIED)
        if not decision.approved:
            raise ToolFailed(f"{name} was denied ({decision.by})"
                             + (f": {decision.reason}" if decision.reason else ""), details=_DENIED)

    @staticmethod
    def _reply(call_id: Any, result: Any) -> str:
        return json.dumps({"id": call_id, "ok": True, "result": result})

    def refuse_unread(self, session_id: str, run_id: str, note: dict[str, Any]) -> tuple[str, ToolCall]:
        """Answer a request too large to be read at all (its message arrived without it, see
        frames.decode_frame): the kernel's call fails at once instead of waiting."""
        size = int(note.get("bytes") or 0)
        error = (f"the request is {size:,} bytes, over the limit of {int(note.get('limit') or 0):,} "
                 "bytes a message; pass a file path instead")
        reply = json.dumps({"id": None, "ok": False, "error": error})
        return reply, self._record(session_id, run_id, "?", error, time.monotonic(), size, len(reply))

    @staticmethod
    def _record(session_id: str, run_id: str, name: str, error: str | None, started: float,
                bytes_in: int, bytes_out: int) -> ToolCall:
        if len(name) > MAX_RECORDED_NAME:  # a made-up name of any size: its record and audit line stay small
            name = name[:MAX_RECORDED_NAME] + "…"
        record = ToolCall(
            tool=name, ok=error is None, error=error,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
            bytes_in=bytes_in, bytes_out=bytes_out,
        )
        audit("tool_call", session_id=session_id, run_id=run_id, **record.model_dump())
        return record
