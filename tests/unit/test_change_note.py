"""The file agent's post-run change note rides in the cell's own execute_reply (kernel/file_agent.py),
so a run brings the manager no message more than a bare kernel's. A real ipykernel: first bare,
then with the file agent installed in it as the boot code installs it."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from kernelmode.artifacts.channel import changes_buffer
from kernelmode.gateway.exchange import ExecuteExchange, Message, execute_content
from kernelmode.gateway.execution import OutputCollector
from kernelmode.kernel import file_agent as files
from tests.unit.test_exchange import LONG, KernelChannels, bare_kernel

INSTALL = """
import json, sys, types
_m = types.ModuleType('kernelmode_files')
exec(compile({source!r}, '<kernelmode files>', 'exec'), _m.__dict__)
sys.modules['kernelmode_files'] = _m
_m.install(get_ipython(), json.loads({config!r}))
del _m
"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def channels(tmp_path_factory) -> AsyncIterator[KernelChannels]:  # noqa: ANN001
    async with bare_kernel(cwd=str(tmp_path_factory.mktemp("ws"))) as (_, ch):
        yield ch


async def _messages(ch: KernelChannels, code: str, silent: bool = False) -> list[Message]:
    """Every message that answers one execute_request, up to its reply and its idle status."""
    queue = await ch.send("shell", "execute_request", execute_content(code, silent))
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


def _kinds(msgs: list[Message]) -> Counter[str]:
    return Counter(m["msg_type"] if m["msg_type"] != "status" else f"status:{m['content']['execution_state']}"
                   for m in msgs)


def _reply(msgs: list[Message]) -> Message:
    return next(m for m in msgs if m["msg_type"] == "execute_reply")


def _install(tmp: Path, **config: object) -> str:
    return INSTALL.format(source=Path(files.__file__).read_text(), config=json.dumps({"root": str(tmp), **config}))


async def _collected(msgs: list[Message]) -> OutputCollector:
    collector = OutputCollector(1 << 20)
    exchange = ExecuteExchange(collector)
    outcomes = [exchange.feed(m) for m in msgs]
    assert outcomes[-1] == "done"
    return collector


async def test_a_run_brings_as_many_messages_as_on_a_bare_kernel(channels: KernelChannels, tmp_path: Path) -> None:
    # Bare: ipykernel's own finish_metadata (an earlier test of this module's kernel may have
    # installed the agent).
    await _messages(channels, "get_ipython().kernel.__dict__.pop('finish_metadata', None)", silent=True)
    bare = await _messages(channels, "1+1")
    assert files.NOTE_KEY not in _reply(bare)["metadata"]
    installed = await _messages(channels, _install(tmp_path), silent=True)
    assert _reply(installed)["content"]["status"] == "ok"
    assert files.NOTE_KEY not in _reply(installed)["metadata"]  # a silent request makes no note
    with_agent = await _messages(channels, "1+1")
    assert len(with_agent) == len(bare) == 5, _kinds(with_agent)
    assert _kinds(with_agent) == _kinds(bare)
    note = _reply(with_agent)["metadata"][files.NOTE_KEY]
    assert json.loads(note) == {"files": [], "truncated": False, "stopped": None}
    collector = await _collected(with_agent)
    assert collector.result == "2" and collector.file_changes == note.encode()


async def test_the_note_names_what_the_cell_changed(channels: KernelChannels, tmp_path: Path) -> None:
    assert _reply(await _messages(channels, _install(tmp_path), silent=True))["content"]["status"] == "ok"
    msgs = await _messages(channels, f"open({str(tmp_path / 'made.txt')!r}, 'w').write('m')")
    assert [m for m in msgs if m["msg_type"] == "comm_msg"] == []
    collector = await _collected(msgs)
    assert collector.file_changes is not None
    assert [e.path for e in changes_buffer(collector.file_changes, 10).files] == ["made.txt"]
    # A failed cell makes no note (and takes no look: its files are in the next successful one's).
    failed = await _messages(channels, f"open({str(tmp_path / 'late.txt')!r}, 'w').write('l'); 1/0")
    assert files.NOTE_KEY not in _reply(failed)["metadata"]
    after = await _collected(await _messages(channels, "2+2"))
    assert after.file_changes is not None
    assert [e.path for e in changes_buffer(after.file_changes, 10).files] == ["late.txt"]


async def test_a_large_note_comes_as_a_buffer_before_the_reply(channels: KernelChannels, tmp_path: Path) -> None:
    """Over MAX_NOTE_BYTES the note is a comm_msg with the JSON as its buffer, as before: the
    reply stays small and the harvest still needs no round trip."""
    count = 1200
    assert _reply(await _messages(channels, _install(tmp_path, max_changes=count), silent=True))["content"]["status"] == "ok"
    code = (f"import os\nfor i in range({count}):\n"
            f"    open(os.path.join({str(tmp_path)!r}, f'{{i:04d}}' + 'n' * 200), 'w').close()\n")
    msgs = await _messages(channels, code)
    assert files.NOTE_KEY not in _reply(msgs)["metadata"]
    notes = [m for m in msgs if m["msg_type"] == "comm_msg"]
    assert len(notes) == 1 and notes[0]["content"]["comm_id"] == files.CHANGES_COMM
    assert len(notes[0]["buffers"][0]) > files.MAX_NOTE_BYTES
    collector = await _collected(msgs)
    assert collector.file_changes is not None
    assert len(changes_buffer(collector.file_changes, count).files) == count
