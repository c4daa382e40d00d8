"""The workspace part of a checkpoint (sessions/checkpoint_files.py ``archive``, through the kernel's
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
from kernelmode.sessions.checkpoint_files import archive
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
        asyncio.run(archive(channel, dest, scratch, 1 << 30))
    assert not dest.exists()  # no half-written tar left in the scratch dir
    assert list(scratch.iterdir()) == []


def test_archive_keeps_regular_files(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    (ws_root / "sub").mkdir(parents=True)
    (ws_root / "sub" / "a.txt").write_bytes(b"hello")
    (ws_root / "link").symlink_to(ws_root / "sub" / "a.txt")
    dest = tmp_path / "checkpoint.tar"
    channel, _ = _channel(ws_root)
    assert asyncio.run(archive(channel, dest, tmp_path, 1 << 30))[0] == 1
    with tarfile.open(dest) as tar:
        member = tar.extractfile("sub/a.txt")
        assert member is not None and member.read() == b"hello"


def test_sparse_files_count_at_their_length_and_the_rest_is_skipped(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    ws_root.mkdir()
    for i in range(4):  # 4 MB each, almost no blocks on disk
        with open(ws_root / f"sparse{i}", "wb") as f:
            f.truncate(4 << 20)
    (ws_root / "small.txt").write_bytes(b"kept")
    dest = tmp_path / "checkpoint.tar"
    channel, _ = _channel(ws_root)
    files, size, skipped = asyncio.run(archive(channel, dest, tmp_path, 10 << 20))
    assert files == 3 and size <= (10 << 20) + 64 * 1024  # small.txt and two of the sparse files
    assert sorted(s.path for s in skipped) == ["sparse2", "sparse3"]
    assert all("disk_mb" in s.reason for s in skipped)


def test_an_agent_announcing_more_than_it_listed_reads_no_more_than_the_budget(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    ws_root.mkdir()
    for i in range(3):
        (ws_root / f"f{i}").write_bytes(b"x" * 10)
    dest = tmp_path / "checkpoint.tar"
    channel, loop = _channel(ws_root)

    def grow(data: dict, bufs: list[bytes]) -> tuple[dict, list[bytes]]:
        if "size" in data:  # the listing said 10 bytes; the read announces 3 MB
            data = dict(data, size=3 << 20)
        return data, bufs

    loop.tamper = grow
    files, _, skipped = asyncio.run(archive(channel, dest, tmp_path, 1 << 20))
    assert files == 0 and len(skipped) == 3 and "larger when read" in skipped[0].reason
