"""What the manager sees of a person's console attached to a session (``/v1/sessions/{id}/channels``).

The console talks to the session's kernel through kernelmode, frame by frame. The tap looks at
each message on the way: it records the console's runs in the session's history (so they are
in the notebook export), answers the kernel's tool calls itself (the console never sees the
preamble's requests, and ``tools.*`` works as in any run; a request too large to be read is
refused at once, as in a run), refuses a shutdown request (a
person leaving the console must not stop the agent's kernel), and refuses cells while the
manager drains (sessions/drain.py: a cell started then would be cut off by the stop). A console's cell is sent with
``stop_on_error`` off: the kernel queues every client's cells in one shell queue, so an error
in a person's cell must not abort an agent's run queued behind it (nor the other way round).
The same tap serves JupyterLab and VS Code (``/api/kernels/{id}/channels``).

What the tap keeps per connection is bounded: a cell's code is kept for the history up to
``sessions.max_code_bytes`` characters (with a note when cut), and at most ``MAX_PENDING``
requests (``PENDING_CODE_CELLS`` full cells of code together) wait for their reply; beyond, the oldest are
forgotten (their cells run, but are not in the history). A console that floods the kernel with
requests it never gets answers to cannot pin the server's memory.
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

from ..gateway.exchange import ExecuteExchange
from ..gateway.execution import OutputCollector
from ..models import RunError, ToolCall
from ..protocol import MARKER
from .console_policy import POLICY_ERROR, cell_refusal, debug_refusal, refusal_messages

if TYPE_CHECKING:
    from .live import LiveSession
    from .manager import SessionManager

MAX_PENDING = 32  # requests of one console awaiting their reply
PENDING_CODE_CELLS = 4  # their kept code together: this many cells of max_code_bytes
DRAIN_ERROR = "ServerBusy"  # a cell refused while the manager drains (as REST's 503 server_busy)


def kept_code(code: str, cap: int) -> str:
    """The code as the history keeps it: at most ``cap`` characters, and a note when cut."""
    if len(code) <= cap:
        return code
    return code[:cap] + f"\n# [kernelmode: {len(code) - cap} more characters of this cell were not kept]"


@dataclass
class _ConsoleRun:
    code: str
    exchange: ExecuteExchange  # fed the kernel's messages for the cell, as the console gets them
    started: float
    tool_calls: list[ToolCall] = field(default_factory=list)


class ConsoleTap:
    def __init__(self, manager: SessionManager, s: LiveSession,
                 send_upstream: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        self.manager = manager
        self.s = s
        self.send_upstream = send_upstream  # (channel, message) to the kernel
        self._runs: dict[str, _ConsoleRun] = {}  # awaiting their reply, oldest first
        self._pending_chars = 0
        self.dropped = 0  # requests forgotten at the bounds (their cells are not in the history)
        self._session = JupyterSession(key=b"x", username="kernelmode")
        self._tasks: set[asyncio.Task[None]] = set()
        s.attached += 1
        self._closed = False

    async def refusal(self, msg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
        """What the client gets instead of the kernel's answer when the code policy refuses this
        message (console_policy.py), or when the manager is draining (a cell started now would
        be cut off by the stop); None: pass it on."""
        policy, kind = self.manager.runner.policy, msg.get("msg_type")
        if kind == "execute_request" and (stopping := self.manager.drain.cell_refusal()) is not None:
            return refusal_messages(self._session, msg, stopping, self.s.info.execution_count or 0, DRAIN_ERROR)
        if policy is None or kind not in ("execute_request", "debug_request"):
            return None
        if kind == "debug_request":
            return debug_refusal(self._session, msg)
        info = self.s.info
        reason = await cell_refusal(policy, info.session_id, info.tenant, msg)
        if reason is None:
            return None
        content = msg.get("content") or {}
        if not content.get("silent"):  # in the history, like a REST run the policy refuses
            code = content.get("code")
            error = RunError(ename=POLICY_ERROR, evalue=reason, traceback="")
            result = self._new_collector().to_result(uuid.uuid4().hex, info.session_id, "error", error=error)
            self.manager.record_console_run(self.s, kept_code(code if isinstance(code, str) else repr(code),
                                                              self.manager.settings.sessions.max_code_bytes),
                                            result, [{"type": "error", **error.model_dump()}])
        return refusal_messages(self._session, msg, reason, info.execution_count or 0)

    def _new_collector(self) -> OutputCollector:
        cfg = self.manager.settings.sessions
        return OutputCollector(cfg.max_output_bytes, max_display_bytes=cfg.max_display_bytes)

    def from_console(self, channel: str, msg: dict[str, Any]) -> bool:
        """Look at a message the console sends; False: do not pass it to the kernel."""
        kind = msg.get("msg_type")
        self.s.touch()  # a person at the console keeps the session from being reaped
        if kind == "shutdown_request":
            return False
        if kind == "execute_request":
            msg["content"]["stop_on_error"] = False  # the caller re-encodes the request
        if kind == "execute_request" and not msg["content"].get("silent"):
            cfg = self.manager.settings.sessions
            msg_id = str(msg["header"]["msg_id"])
            self._forget(msg_id)  # a repeated id replaces its earlier request
            run = _ConsoleRun(
                code=kept_code(str(msg["content"].get("code", "")), cfg.max_code_bytes),
                exchange=ExecuteExchange(self._new_collector()),
                started=time.monotonic())
            self._runs[msg_id] = run
            self._pending_chars += len(run.code)
            self.s.console_cells += 1
            budget = PENDING_CODE_CELLS * cfg.max_code_bytes
            while len(self._runs) > MAX_PENDING or self._pending_chars > budget:
                self._forget(next(iter(self._runs)))  # the oldest (dicts keep arrival order)
                self.dropped += 1
        return True

    def _forget(self, msg_id: str) -> _ConsoleRun | None:
        run = self._runs.pop(msg_id, None)
        if run is not None:
            self._pending_chars -= len(run.code)
            self.s.console_cells -= 1
        return run

    def from_kernel(self, channel: str, msg: dict[str, Any]) -> bool:
        """Look at a message for the console; False: it was for kernelmode (a tool call)."""
        kind = msg.get("msg_type")
        parent = (msg.get("parent_header") or {}).get("msg_id", "")
        run = self._runs.get(parent)
        # A tool call, or one too large to be read (the decoder left its prompt out: only the
        # preamble's requests carry data; a plain input() fails in the kernel before asking).
        if kind == "input_request" and (
                msg.get("dropped") or str(msg["content"].get("prompt", "")).startswith(MARKER)):
            task = asyncio.create_task(self._answer_tool_call(msg, run))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return False
        if run is not None and run.exchange.feed(msg) == "done":
            self._record(parent, run)
        return True

    async def _answer_tool_call(self, msg: dict[str, Any], run: _ConsoleRun | None) -> None:
        s, broker = self.s, self.manager.broker
        record: ToolCall | None
        if msg.get("dropped"):  # answered at once: the call fails in the kernel, nothing waits
            reply, record = broker.refuse_unread(s.info.session_id, "console", msg["dropped"])
        else:
            reply, record = await broker.handle(
                s.info.session_id, "console", s.info.tools, str(msg["content"]["prompt"])[len(MARKER):])
        if record is not None and run is not None:
            run.tool_calls.append(record)
        answer = self._session.msg("input_reply", {"value": reply}, parent=msg["header"])
        with contextlib.suppress(Exception):  # the console left meanwhile
            await self.send_upstream("stdin", answer)

    def _record(self, msg_id: str, run: _ConsoleRun) -> None:
        self._forget(msg_id)
        c = run.exchange.collector
        result = c.to_result(
            uuid.uuid4().hex, self.s.info.session_id, "ok" if c.reply_status == "ok" else "error",
            duration_ms=round((time.monotonic() - run.started) * 1000, 3), tool_calls=run.tool_calls)
        if c.execution_count is not None:
            self.s.info.execution_count = c.execution_count
        self.manager.record_console_run(self.s, run.code, result, c.events)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.s.attached -= 1
        for msg_id, run in list(self._runs.items()):
            if run.exchange.got_reply:
                # The cell finished: only its idle status was still on its way when the console
                # left (it may leave as soon as it has the reply). Keep it in the history.
                self._record(msg_id, run)
            else:
                self._forget(msg_id)
        for task in list(self._tasks):
            task.cancel()
