"""The kernel's answers to the snapshot request are untrusted input (sessions/snapshot_call.py):
a malformed one is CheckpointAnswerRefused (502 checkpoint_answer_refused) naming the field, never a
TypeError or ValidationError that would surface as a 500. And a take cancelled while an object
is being stored waits for that upload, so its cleanup cannot run before the object lands."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from kernelmode.artifacts.local import LocalStore
from kernelmode.sessions.checkpoints import _put_whole
from kernelmode.sessions.snapshot_call import (
    CheckpointAnswerRefused,
    LoadAnswer,
    SaveAnswer,
    parse_answer,
)


def test_a_genuine_answer_parses() -> None:
    a = parse_answer(SaveAnswer, {"saved": ["x"], "skipped": [{"name": "f", "reason": "open file"}],
                                  "bytes": 10, "seconds": 0.25})
    assert a.saved == ["x"] and a.skipped[0].reason == "open file" and a.seconds == 0.25
    assert parse_answer(SaveAnswer, {"unchanged": True}).unchanged
    assert parse_answer(SaveAnswer, None).error == "no answer"
    assert parse_answer(LoadAnswer, {"restored": ["x"], "lost": []}).restored == ["x"]


@pytest.mark.parametrize("raw", [
    {"skipped": [1]}, {"skipped": [{"name": "x"}]}, {"seconds": "soon"}, {"seconds": float("nan")},
    {"seconds": -1}, {"saved": "x"}, {"saved": [""]}, {"saved": ["x" * 5000]}, {"error": {"code": 1}},
    {"unchanged": "yes"}, {"seconds": True},
])
def test_a_malformed_save_answer_is_refused(raw: dict) -> None:
    with pytest.raises(CheckpointAnswerRefused, match="malformed") as e:
        parse_answer(SaveAnswer, raw)
    assert e.value.http_status == 502 and e.value.code == "checkpoint_answer_refused"


@pytest.mark.parametrize("raw", [{"lost": [1]}, {"lost": [{"name": 1, "reason": "x"}]}, {"restored": [None]}])
def test_a_malformed_load_answer_is_refused(raw: dict) -> None:
    with pytest.raises(CheckpointAnswerRefused):
        parse_answer(LoadAnswer, raw)


async def test_a_cancelled_store_waits_for_its_upload(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "artifacts", 60)
    await store.start()
    src = tmp_path / "blob"
    src.write_bytes(b"x" * 1000)
    release = threading.Event()
    put = store.put_file

    async def slow_put(key: str, path: Path, mime: str) -> None:
        await asyncio.to_thread(release.wait, 10)
        await put(key, path, mime)

    store.put_file = slow_put  # type: ignore[method-assign]
    task = asyncio.create_task(_put_whole(store, ".checkpoints/c/namespace.kmck", src, "x"))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the upload it started
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (tmp_path / "artifacts" / ".checkpoints" / "c" / "namespace.kmck").exists()
