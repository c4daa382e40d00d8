"""The execute exchange (kernelmode/gateway/exchange.py) driven by a real ipykernel.

The exchange only needs ``send`` and ``forget`` of a connection (``Channels``), so here a real
kernel is started with jupyter_client, and a small adapter routes its iopub/shell/stdin messages
to the request they answer, as KernelConnection does with the gateway's websocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager

from kernelmode.gateway.exchange import (
    DISCONNECTED_EVENT,
    KERNEL_STATUS_EVENT,
    RESTARTED,
    ExecuteExchange,
    Message,
)
from kernelmode.gateway.execution import OutputCollector

LONG = 120.0  # a deadline no passing exchange comes near (the kernel answers in milliseconds)


class KernelChannels:
    """``Channels`` over jupyter_client: replies routed to their request by parent msg_id."""

    def __init__(self, kc: AsyncKernelClient) -> None:
        self.kc = kc
        self.listeners: dict[str, asyncio.Queue[Message]] = {}
        self.pumps = [asyncio.create_task(self._pump(get)) for get in
                      (kc.get_iopub_msg, kc.get_shell_msg, kc.get_stdin_msg)]

    async def _pump(self, get: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        while True:
            try:
                msg = await get(timeout=0.2)
            except Exception:  # queue.Empty on a quiet channel
                continue
            queue = self.listeners.get((msg.get("parent_header") or {}).get("msg_id", ""))
            if queue is not None:
                queue.put_nowait(msg)

    async def send(self, channel: str, msg_type: str, content: dict[str, Any],
                   expect_reply: bool = True) -> asyncio.Queue[Message]:
        msg = self.kc.session.msg(msg_type, content)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        if expect_reply:
            self.listeners[msg["header"]["msg_id"]] = queue
        getattr(self.kc, f"{channel}_channel").send(msg)
        queue.msg_id = msg["header"]["msg_id"]  # type: ignore[attr-defined]
        return queue

    def forget(self, queue: asyncio.Queue[Message]) -> None:
        self.listeners.pop(getattr(queue, "msg_id", ""), None)

    async def close(self) -> None:
        for task in self.pumps:
            task.cancel()
        await asyncio.gather(*self.pumps, return_exceptions=True)


@contextlib.asynccontextmanager
async def bare_kernel(cwd: str | None = None) -> AsyncIterator[tuple[AsyncKernelManager, KernelChannels]]:
    """A real ipykernel (this venv's) and its channels, shut down after."""
    km = AsyncKernelManager()
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    await km.start_kernel(cwd=cwd)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    channels = KernelChannels(kc)
    try:
        yield km, channels
    finally:
        await channels.close()
        kc.stop_channels()
        with contextlib.suppress(Exception):
            await km.shutdown_kernel(now=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def kernel() -> AsyncIterator[tuple[AsyncKernelManager, KernelChannels]]:
    async with bare_kernel() as k:
        yield k


def _collector() -> OutputCollector:
    return OutputCollector(1 << 20)


async def _run(channels: KernelChannels, code: str, **hooks: Any) -> tuple[str, ExecuteExchange]:
    exchange = ExecuteExchange(_collector(), **hooks)
    await exchange.send(channels, code)
    try:
        outcome = await exchange.collect(asyncio.get_running_loop().time() + LONG)
    finally:
        exchange.close()
    return outcome, exchange


async def test_output_result_and_reply(kernel: tuple[AsyncKernelManager, KernelChannels]) -> None:
    _, channels = kernel
    started: list[bool] = []
    outcome, ex = await _run(channels, "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\n6 * 7",
                             on_start=lambda: started.append(True))
    assert outcome == "done" and ex.got_reply and ex.got_idle
    c = ex.collector
    assert (c.stdout, c.stderr, c.result, c.reply_status) == ("hi\n", "oops\n", "42", "ok")
    assert started == [True]  # once, when the cell started
    result = c.to_result("r1", "s1", "ok", duration_ms=1.5)
    assert (result.run_id, result.session_id, result.stdout, result.result, result.duration_ms) == \
        ("r1", "s1", "hi\n", "42", 1.5)
    assert result.execution_count == c.execution_count is not None


async def test_error_is_data(kernel: tuple[AsyncKernelManager, KernelChannels]) -> None:
    _, channels = kernel
    outcome, ex = await _run(channels, "1 / 0")
    assert outcome == "done"
    assert ex.collector.reply_status == "error"
    assert ex.collector.error is not None and ex.collector.error.ename == "ZeroDivisionError"
    assert "\x1b[" not in ex.collector.error.traceback  # ANSI colours stripped


async def test_stdin_hook_answers_input_request(kernel: tuple[AsyncKernelManager, KernelChannels]) -> None:
    _, channels = kernel
    prompts: list[str] = []

    async def answer(msg: Message) -> None:
        prompts.append(msg["content"]["prompt"])
        await channels.send("stdin", "input_reply", {"value": "ab"}, expect_reply=False)

    outcome, ex = await _run(channels, "x = input('say: ')\nprint(x * 2)", on_input=answer)
    assert outcome == "done" and ex.collector.reply_status == "ok"
    assert prompts == ["say: "]
    assert ex.collector.stdout.endswith("abab\n")


async def test_deadline_then_interrupt_goes_on_where_it_stopped(
        kernel: tuple[AsyncKernelManager, KernelChannels]) -> None:
    """A timeout keeps what arrived; after an interrupt, a second collect ends the same exchange."""
    km, channels = kernel
    exchange = ExecuteExchange(_collector())
    await exchange.send(channels, "import time\nprint('before', flush=True)\ntime.sleep(3600)")
    loop = asyncio.get_running_loop()
    try:
        # Wait until the cell is surely running (its first output), then let a short deadline pass.
        while "before" not in exchange.collector.stdout:
            assert await exchange.collect(loop.time() + 0.2) == "timeout"
        await km.interrupt_kernel()
        assert await exchange.collect(loop.time() + LONG) == "done"
    finally:
        exchange.close()
    assert exchange.collector.error is not None and exchange.collector.error.ename == "KeyboardInterrupt"
    assert exchange.collector.stdout == "before\n"
    outcome, ex = await _run(channels, "'still alive'")  # the kernel serves the next request
    assert outcome == "done" and ex.collector.result == "'still alive'"


@pytest.mark.parametrize(("event", "outcome"), [
    ({"msg_type": KERNEL_STATUS_EVENT, "state": "dead"}, "died"),
    ({"msg_type": KERNEL_STATUS_EVENT, "state": "restarting"}, "died"),
    ({"msg_type": KERNEL_STATUS_EVENT, "state": RESTARTED}, "restarted"),
    ({"msg_type": DISCONNECTED_EVENT}, "died"),
])
def test_synthetic_events_end_the_exchange(event: Message, outcome: str) -> None:
    assert ExecuteExchange(_collector()).feed(event) == outcome


def test_feed_needs_both_reply_and_idle() -> None:
    """The console tap feeds messages one by one: done only once both have arrived, either order."""
    for order in (("execute_reply", "status"), ("status", "execute_reply")):
        ex = ExecuteExchange(_collector())
        msgs = {"execute_reply": {"msg_type": "execute_reply", "content": {"status": "ok", "execution_count": 3}},
                "status": {"msg_type": "status", "content": {"execution_state": "idle"}}}
        assert ex.feed({"msg_type": "status", "content": {"execution_state": "busy"}}) is None
        assert ex.feed(msgs[order[0]]) is None
        assert ex.feed(msgs[order[1]]) == "done"
        assert ex.collector.execution_count == 3


class _Queued:
    """A connection whose answers are whatever the test puts in the request's queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.forgotten = False

    async def send(self, channel: str, msg_type: str, content: dict[str, Any],
                   expect_reply: bool = True) -> asyncio.Queue[Message]:
        return self.queue

    def forget(self, queue: asyncio.Queue[Message]) -> None:
        self.forgotten = True


_REPLY: Message = {"msg_type": "execute_reply", "content": {"status": "ok", "execution_count": 1}}
_IDLE: Message = {"msg_type": "status", "content": {"execution_state": "idle"}}


async def test_collect_reads_what_arrived_before_its_deadline_and_leaves_no_timer() -> None:
    """collect's deadline is a timer that queues its own mark (no task): the messages already in
    the queue are read first, a mark of an earlier collect is passed over, and the timer of a
    collect that ended is cancelled (it queues nothing later)."""
    loop = asyncio.get_running_loop()
    conn = _Queued()
    ex = ExecuteExchange(_collector())
    await ex.send(conn, "1+1")
    assert await ex.collect(loop.time() + 0.01) == "timeout"  # nothing came: its own mark
    assert conn.queue.empty()
    conn.queue.put_nowait({"msg_type": "kernelmode_deadline"})  # a stale mark, not this call's
    conn.queue.put_nowait(_REPLY)
    conn.queue.put_nowait(_IDLE)
    assert await ex.collect(loop.time() - 1.0) == "done"  # past already, but the answer was in
    await asyncio.sleep(0.05)
    assert conn.queue.empty()  # its timer was cancelled before it could fire
    ex2 = ExecuteExchange(_collector())
    await ex2.send(conn, "1+1")
    loop.call_later(0.01, conn.queue.put_nowait, _REPLY)  # while collect waits
    loop.call_later(0.02, conn.queue.put_nowait, _IDLE)
    assert await ex2.collect(loop.time() + 0.05) == "done"
    await asyncio.sleep(0.1)
    assert conn.queue.empty()  # the ended collect's timer was cancelled
    ex2.close()
    assert conn.forgotten
