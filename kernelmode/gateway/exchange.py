"""The Jupyter execute exchange, written once: send an ``execute_request``, then read the
messages that answer it (iopub, shell, stdin) until its ``execute_reply`` and its ``idle``
status have both arrived, or a deadline passes, or the kernel goes away.

Runs, the boot preamble and the console tap all use it (cf. jupyter_client's
``_async_execute_interactive``: one loop, hooks for output and stdin). ``ExecuteExchange.feed``
is the step that judges one message, so a passive reader (the console tap, which sees messages
a person's console asked for) uses the same rules as ``collect``, which reads a queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, Protocol

from .execution import OutputCollector

# Synthetic events put into a request's queue next to the kernel's own messages (they are never
# sent by a kernel): the kernel died or is restarting (``state``), or its websocket closed.
KERNEL_STATUS_EVENT = "kernelmode_kernel_status"
DISCONNECTED_EVENT = "kernelmode_disconnected"
# The ``state`` of a KERNEL_STATUS_EVENT the manager sends when it restarts a kernel on purpose.
RESTARTED = "restarted"

Outcome = Literal["done", "timeout", "died", "restarted"]
_DEADLINE = "kernelmode_deadline"  # collect's own mark in the queue: its deadline passed
Message = dict[str, Any]


class Channels(Protocol):
    """What the exchange needs of a kernel connection (KernelConnection, or a test's adapter)."""

    async def send(self, channel: str, msg_type: str, content: dict[str, Any],
                   expect_reply: bool = True) -> asyncio.Queue[Message]: ...

    def forget(self, queue: asyncio.Queue[Message]) -> None: ...


def execute_content(code: str, silent: bool = False) -> dict[str, Any]:
    """An execute_request's content. allow_stdin: tool calls come back as input_requests (the
    preamble makes a plain input() fail inside the kernel). stop_on_error off: the manager queues
    nothing of its own behind a run, so an abort would only hit someone else's cell (a console's)."""
    return {"code": code, "silent": silent, "store_history": not silent, "user_expressions": {},
            "allow_stdin": True, "stop_on_error": False}


class ExecuteExchange:
    """One execute_request and what answers it.

    ``on_input`` answers a stdin input_request (run as a task of the exchange, cancelled by
    ``close``); ``on_start`` is called once, when the kernel starts the cell (execute_input).
    The reply/idle state lives here, so a second ``collect`` after a timeout (an interrupt's
    grace) goes on where the first stopped.
    """

    def __init__(self, collector: OutputCollector,
                 on_input: Callable[[Message], Coroutine[Any, Any, None]] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self.collector = collector
        self.on_input = on_input
        self.on_start = on_start
        self.got_reply = False
        self.got_idle = False
        self._conn: Channels | None = None
        self._queue: asyncio.Queue[Message] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    async def send(self, conn: Channels, code: str, silent: bool = False) -> None:
        """Send the cell over ``conn``; its answers are then read by ``collect``."""
        self._conn = conn
        self._queue = await conn.send("shell", "execute_request", execute_content(code, silent))

    def feed(self, msg: Message) -> Outcome | None:
        """Take one message of the request: the outcome once the exchange is over, else None."""
        kind = msg.get("msg_type")
        if kind == KERNEL_STATUS_EVENT:
            return "restarted" if msg.get("state") == RESTARTED else "died"
        if kind == DISCONNECTED_EVENT:
            return "died"
        if kind == "status":
            self.got_idle = (msg.get("content") or {}).get("execution_state") == "idle"
        elif kind == "input_request":
            if self.on_input is not None:
                task: asyncio.Task[None] = asyncio.create_task(self.on_input(msg))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
        else:
            if kind == "execute_input" and self.on_start is not None:
                on_start, self.on_start = self.on_start, None
                on_start()
            elif kind == "execute_reply":
                self.got_reply = True
            self.collector.add(msg)
        return "done" if self.got_reply and self.got_idle else None

    async def collect(self, deadline: float) -> Outcome:
        """Read until the exchange is over, or ``deadline`` (loop clock) passes: 'timeout'.

        One timer for the whole wait (not one per message), and no task of its own: the timer
        puts this call's deadline mark in the queue (a mark of an earlier call is passed over);
        what arrived before the deadline stays in the collector.
        """
        assert self._queue is not None, "send() first"
        queue = self._queue
        mark: Message = {"msg_type": _DEADLINE}
        timer = asyncio.get_running_loop().call_at(deadline, queue.put_nowait, mark)
        try:
            while True:
                msg = await queue.get()
                if msg.get("msg_type") == _DEADLINE:
                    if msg is mark:
                        return "timeout"
                    continue
                outcome = self.feed(msg)
                if outcome is not None:
                    return outcome
        finally:
            timer.cancel()

    def close(self) -> None:
        """Stop listening for the request's messages; cancel stdin answers still being made."""
        if self._conn is not None and self._queue is not None:
            self._conn.forget(self._queue)
        for task in list(self._answering):
            task.cancel()
