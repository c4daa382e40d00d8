"""The workspace part of a checkpoint (sessions/checkpoints.py ``_archive``, through the kernel's
file agent, here in-process behind a loopback) when the kernel changes a file while it is being
tarred: a clear CheckpointFailed (a 409), never a bare error (a 500 from POST
/v1/sessions/{id}/checkpoint, a traceback in hibernation)."""

from __future__ import annotations

import asyncio
import os
import tarfile
from pathlib import Path

import pytest

from kernelmode.artifacts.channel import FileChannel
from kernelmode.errors import CheckpointFailed
from kernelmode.sessions.checkpoints import _archive
from tests.file_agent_loopback import Loopback


def _channel(root: Path) -> tuple[FileChannel, Loopback]:
    loop = Loopback(root)
    return FileChannel(loop, timeout=5), loop  # type: ignore[arg-type]


def test_a_file_that_shrinks_while_archived_fails_the_checkpoint_cleanly(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    ws_root.mkdir()
    (ws_root / "status.json").write_bytes(b"x" * (5 << 20))  # more than one chunk
    dest = tmp_path / "checkpoint.tar"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    channel, loop = _channel(ws_root)

    def shrink(data: dict, bufs: list[bytes]) -> tuple[dict, list[bytes]]:
        if "size" in data:  # the kernel truncates the file once its read has begun
            os.truncate(ws_root / "status.json", 10)
        return data, bufs

    loop.tamper = shrink
    with pytest.raises(CheckpointFailed, match="status.json"):
        asyncio.run(_archive(channel, dest, scratch))
    assert not dest.exists()  # no half-written tar left in the scratch dir
    assert list(scratch.iterdir()) == []


def test_archive_keeps_regular_files(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    (ws_root / "sub").mkdir(parents=True)
    (ws_root / "sub" / "a.txt").write_bytes(b"hello")
    (ws_root / "link").symlink_to(ws_root / "sub" / "a.txt")
    dest = tmp_path / "checkpoint.tar"
    channel, _ = _channel(ws_root)
    assert asyncio.run(_archive(channel, dest, tmp_path))[0] == 1
    with tarfile.open(dest) as tar:
        member = tar.extractfile("sub/a.txt")
        assert member is not None and member.read() == b"hello"
