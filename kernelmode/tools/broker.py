"""ToolBroker: answers tool calls that kernel code makes over its session's stdin channel.

The session is known from the channel the request came on (the caller passes it), never from
the request. Every call is checked (allow-list, rate, sizes), run with a timeout, logged, and
recorded for the RunResult.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..audit import audit
from ..config import ToolBrokerSettings
from ..kernel.preamble import PING
from ..models import ToolCall
from .base import ToolFailed
from .registry import ToolRegistry, allowed


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
        self._limiters: dict[str, RateLimiter] = {}

    def forget_session(self, session_id: str) -> None:
        self._limiters.pop(session_id, None)

    async def handle(self, session_id: str, run_id: str, allow: list[str] | None,
                     payload: str) -> tuple[str, ToolCall | None]:
        """Answer one request (the JSON after the preamble's marker): (reply JSON, record).

        The preamble's stdin ping is answered here too, with no record."""
        started = time.monotonic()
        bytes_in = len(payload.encode("utf-8", errors="replace"))
        call_id: Any = None
        name = "?"
        try:
            try:
                request = json.loads(payload)
                call_id, name, arguments = request["id"], str(request["tool"]), request["arguments"]
            except (ValueError, KeyError, TypeError):
                raise ToolFailed("malformed tool request") from None
            if name == PING:
                return json.dumps({"id": call_id, "ok": True, "result": "pong"}), None
            if not isinstance(arguments, dict):
                raise ToolFailed("arguments must be a mapping of parameter names to values")
            if bytes_in > self.settings.max_argument_bytes:
                raise ToolFailed(f"arguments are {bytes_in} bytes, over the limit of "
                                 f"{self.settings.max_argument_bytes}; pass a file path instead")
            tool = self.registry.get(name)
            if tool is None or not allowed(name, allow):
                # The same answer for "does not exist" and "not allowed here".
                raise ToolFailed("unknown tool (call tools.help() to list the tools of this session)")
            limiter = self._limiters.setdefault(
                session_id, RateLimiter(self.settings.rate_per_second, self.settings.rate_burst))
            if not limiter.take():
                raise ToolFailed(f"rate limit: at most {self.settings.rate_per_second:g} tool calls "
                                 "per second in a session; batch the work into fewer calls")
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
            reply = json.dumps({"id": call_id, "ok": False, "error": error})
        record = ToolCall(
            tool=name, ok=error is None, error=error,
            duration_ms=round((time.monotonic() - started) * 1000, 3),
            bytes_in=bytes_in, bytes_out=len(reply),
        )
        audit("tool_call", session_id=session_id, run_id=run_id, **record.model_dump())
        return reply, record
