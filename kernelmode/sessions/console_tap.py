"""What the manager sees of a person's console attached to a session (``/v1/sessions/{id}/channels``).

The console talks to the session's kernel through kernelmode, frame by frame. The tap looks at
each message on the way: it records the console's runs in the session's history (so they are
in the notebook export), answers the kernel's tool calls itself (the console never sees the
preamble's requests, and ``tools.*`` works as in any run), and refuses a shutdown request (a
person leaving the console must not stop the agent's kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jupyter_client.session import Session as JupyterSession

from ..gateway.execution import OutputCollector
from ..kernel.preamble import MARKER
from ..models import RunResult, ToolCall

if TYPE_CHECKING:
    from .manager import LiveSession, SessionManager

_OUTPUT_TYPES = {"stream", "display_data", "update_display_data", "execute_result", "error"}


@dataclass
class _ConsoleRun:
    code: str
    collector: OutputCollector
    started: float
    tool_calls: list[ToolCall] = field(default_factory=list)
    reply: bool = False
    idle: bool = False


class ConsoleTap:
    def __init__(self, manager: SessionManager, s: LiveSession,
                 send_upstream: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        self.manager = manager
        self.s = s
        self.send_upstream = send_upstream  # (channel, message) to the kernel
        self._runs: dict[str, _ConsoleRun] = {}
        self._session = JupyterSession(key=b"x", username="kernelmode")
        self._tasks: set[asyncio.Task[None]] = set()

    def from_console(self, channel: str, msg: dict[str, Any]) -> bool:
        """Look at a message the console sends; False: do not pass it to the kernel."""
        kind = msg.get("msg_type")
        self.s.touch()  # a person at the console keeps the session from being reaped
        if kind == "shutdown_request":
            return False
        if kind == "execute_request" and not msg["content"].get("silent"):
            cfg = self.manager.settings.sessions
            self._runs[msg["header"]["msg_id"]] = _ConsoleRun(
                code=str(msg["content"].get("code", "")),
                collector=OutputCollector(cfg.max_output_bytes, max_display_bytes=cfg.max_display_bytes),
                started=time.monotonic())
            self.s.console_cells += 1
        return True

    def from_kernel(self, channel: str, msg: dict[str, Any]) -> bool:
        """Look at a message for the console; False: it was for kernelmode (a tool call)."""
        kind = msg.get("msg_type")
        parent = (msg.get("parent_header") or {}).get("msg_id", "")
        run = self._runs.get(parent)
        if kind == "input_request" and str(msg["content"].get("prompt", "")).startswith(MARKER):
            task = asyncio.create_task(self._answer_tool_call(msg, run))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return False
        if run is not None:
            if kind in _OUTPUT_TYPES or kind == "execute_reply":
                run.collector.add(msg)
                run.reply |= kind == "execute_reply"
            elif kind == "status" and msg["content"].get("execution_state") == "idle":
                run.idle = True
            if run.reply and run.idle:
                self._record(parent, run)
        return True

    async def _answer_tool_call(self, msg: dict[str, Any], run: _ConsoleRun | None) -> None:
        s = self.s
        reply, record = await self.manager.broker.handle(
            s.info.session_id, "console", s.info.tools, str(msg["content"]["prompt"])[len(MARKER):])
        if record is not None and run is not None:
            run.tool_calls.append(record)
        answer = self._session.msg("input_reply", {"value": reply}, parent=msg["header"])
        with contextlib.suppress(Exception):  # the console left meanwhile
            await self.send_upstream("stdin", answer)

    def _record(self, msg_id: str, run: _ConsoleRun) -> None:
        del self._runs[msg_id]
        self.s.console_cells -= 1
        c = run.collector
        result = RunResult(
            run_id=uuid.uuid4().hex, session_id=self.s.info.session_id,
            status="ok" if c.reply_status == "ok" else "error",
            stdout=c.stdout, stderr=c.stderr, result=c.result, outputs=c.outputs, error=c.error,
            execution_count=c.execution_count, truncated=c.truncated, outputs_dropped=c.dropped_outputs,
            duration_ms=round((time.monotonic() - run.started) * 1000, 3), tool_calls=run.tool_calls,
        )
        if c.execution_count is not None:
            self.s.info.execution_count = c.execution_count
        self.manager.record_console_run(self.s, run.code, result, c.events)

    def close(self) -> None:
        self.s.console_cells -= len(self._runs)
        self._runs.clear()
        for task in list(self._tasks):
            task.cancel()
