"""The preamble's lean flush (kernel/preamble.py ``lean_flush``): an ipykernel OutStream's flush()
with nothing to send no longer makes a round trip to the IOPub thread (four per `1+1` run,
issue 18), and output still reaches IOPub in order, before the result and the idle status.
A real ipykernel: first as it is, then with the preamble's lean_flush installed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from kernelmode.gateway.exchange import Message, execute_content
from kernelmode.kernel import preamble
from tests.unit.test_exchange import LONG, KernelChannels, bare_kernel

INSTALL = """
import sys, types
_m = types.ModuleType('kernelmode_preamble')
exec(compile({source!r}, '<kernelmode preamble>', 'exec'), _m.__dict__)
for _s in (sys.stdout, sys.stderr):
    _m.lean_flush(_s)
del _m, _s
"""
PREAMBLE_SOURCE = Path(preamble.__file__).read_text()
# How many events an empty flush of each stream hands to the IOPub thread (printed as JSON).
COUNT = """
import json, sys
_n = {'stdout': 0, 'stderr': 0}
for _name in _n:
    _s = getattr(sys, _name)
    _pub = _s.pub_thread
    _orig = _pub.schedule
    def _counting(f, _name=_name, _orig=_orig):
        _n[_name] += 1
        return _orig(f)
    _pub.schedule = _counting
    try:
        _s.flush()
    finally:
        del _pub.schedule
print(json.dumps(_n))
"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def channels(tmp_path_factory) -> AsyncIterator[KernelChannels]:  # noqa: ANN001
    async with bare_kernel(cwd=str(tmp_path_factory.mktemp("ws"))) as (_, ch):
        yield ch


async def _messages(ch: KernelChannels, code: str) -> list[Message]:
    """Every message that answers one execute_request, up to its reply and its idle status."""
    queue = await ch.send("shell", "execute_request", execute_content(code))
    got: list[Message] = []
    reply = idle = False
    try:
        while not (reply and idle):
            msg = await asyncio.wait_for(queue.get(), LONG)
            got.append(msg)
            kind = msg["msg_type"]
            reply = reply or kind == "execute_reply"
            idle = idle or (kind == "status" and msg["content"]["execution_state"] == "idle")
    finally:
        ch.forget(queue)
    return got


def _stdout(msgs: list[Message]) -> str:
    return "".join(m["content"]["text"] for m in msgs
                   if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")


def _iopub(msgs: list[Message]) -> list[str]:
    """IOPub's messages in order: stream:NAME:TEXT, execute_result, status:STATE."""
    out = []
    for m in msgs:
        kind, c = m["msg_type"], m["content"]
        if kind == "stream":
            out.append(f"stream:{c['name']}:{c['text']}")
        elif kind == "status":
            out.append(f"status:{c['execution_state']}")
        elif kind == "execute_result":
            out.append(f"execute_result:{c['data']['text/plain']}")
    return out


# A starved IOPub thread (issue 32: a run's output lost under load), made certain: the thread's
# timed flush of print('ok') takes the buffer, then is held until the cell's end has queued its
# idle status or a flush of stdout behind it; only then is the stream message queued. The cell
# waits until the buffer is taken, so the end of the cell always falls in that window.
STARVED_IOPUB = """
import sys, threading, time
_k, _out = get_ipython().kernel, sys.stdout
_pub, _taken, _idle = _out.pub_thread, threading.Event(), threading.Event()
_status = _k._publish_status
def _publish_status(status, channel, parent=None):
    _status(status, channel, parent)
    if status == 'idle':
        del _k._publish_status
        _idle.set()
_rotate = _out._flush_buffers
def _starved():
    _out._flush_buffers = _rotate
    taking = _rotate()
    first = next(taking, None)  # the buffer is taken; its message not queued yet
    _taken.set()
    for _ in range(6000):  # bounded: 30 s
        if _idle.is_set() or any(f == _out._flush for f in list(_pub._events)):
            break
        time.sleep(0.005)
    if first is not None:
        yield first
        yield from taking
_k._publish_status, _out._flush_buffers = _publish_status, _starved
print('ok')
_taken.wait(30)
"""


async def _empty_flush_events(ch: KernelChannels) -> dict[str, int]:
    return json.loads(_stdout(await _messages(ch, COUNT)))  # type: ignore[no-any-return]


async def test_an_empty_flush_costs_no_round_trip_and_output_keeps_its_order(channels: KernelChannels) -> None:
    # ipykernel as it is: each empty flush hands the IOPub thread two events (a flush, a wake-up).
    assert await _empty_flush_events(channels) == {"stdout": 2, "stderr": 2}
    install = INSTALL.format(source=PREAMBLE_SOURCE)
    for _ in range(2):  # a second install (a reconnect runs the preamble again) wraps once
        assert _reply(await _messages(channels, install))["content"]["status"] == "ok"
    assert await _empty_flush_events(channels) == {"stdout": 0, "stderr": 0}
    wrapped = _stdout(await _messages(channels, "import sys\nprint(type(sys.stdout.flush.__wrapped__).__name__, "
                                                "sys.stdout.flush.__wrapped__.__self__ is sys.stdout)"))
    assert wrapped == "method True\n"

    # Output written in the cell still comes first, in order; the result; idle last.
    msgs = await _messages(channels, "import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')\n40 + 2")
    order = _iopub(msgs)
    assert order[-1] == "status:idle"
    assert order.index("execute_result:42") > max(i for i, k in enumerate(order) if k.startswith("stream:"))
    assert _stdout(msgs) == "a\nc\n"
    assert "".join(k.split(":", 2)[2] for k in order if k.startswith("stream:stderr:")) == "b\n"

    # A flush with something written goes through: the text is out before the cell ends.
    msgs = await _messages(channels, "import sys\nsys.stdout.write('now')\nsys.stdout.flush()\n"
                                     "print(sys.stdout._flush_pending, dict(sys.stdout._buffers))")
    assert _stdout(msgs) == "nowFalse {}\n"


def _reply(msgs: list[Message]) -> Message:
    return next(m for m in msgs if m["msg_type"] == "execute_reply")


async def test_output_is_not_lost_when_the_iopub_thread_is_starved(channels: KernelChannels) -> None:
    """The cell ends while the IOPub thread holds its output between taking and queueing it:
    the lean flush waits for that send, so the output still comes before the idle status."""
    install = INSTALL.format(source=PREAMBLE_SOURCE)
    assert _reply(await _messages(channels, install))["content"]["status"] == "ok"
    msgs = await _messages(channels, STARVED_IOPUB)
    assert _reply(msgs)["content"]["status"] == "ok"
    assert _stdout(msgs) == "ok\n"  # read up to the idle status, as a run is
