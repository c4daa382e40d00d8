"""FileChannel against the real file agent run in-process (tests/file_agent_loopback.py), and
against the same agent made to lie: every lie is refused with a clear error, never a crash,
never more memory or bytes than the manager asked for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kernelmode.artifacts.channel import FileChannel
from kernelmode.errors import (
    FileExists,
    FileNotFound,
    FilesTimeout,
    FileTransferFailed,
    KernelUnavailable,
    PayloadTooLarge,
)
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame
from tests.file_agent_loopback import Loopback


def _channel(root: Path) -> tuple[FileChannel, Loopback]:
    loop = Loopback(root)
    return FileChannel(loop, timeout=0.5), loop  # type: ignore[arg-type]


async def _read(channel: FileChannel, rel: str, max_bytes: int = 1 << 30) -> bytes:
    download = await channel.open_read(rel, max_bytes)
    return await download.read_all()


def test_write_read_list_delete_round_trip(tmp_path: Path) -> None:
    channel, _ = _channel(tmp_path)
    data = bytes(range(256)) * 40_000  # ~10 MB: several chunks, a window of acks

    async def go() -> None:
        path, entry = await channel.write(PurePosixPath("d/x.bin"), iter([data[i:i + (1 << 20)] for i in
                                                                          range(0, len(data), 1 << 20)]),
                                          len(data), overwrite=False)
        assert path == "/mnt/data/d/x.bin" and entry.size == len(data)
        assert await _read(channel, "d/x.bin") == data
        assert set(await channel.scan()) == {"d/x.bin"}
        with pytest.raises(FileExists):
            await channel.write(PurePosixPath("d/x.bin"), iter([b"y"]), 1, overwrite=False)
        await channel.delete(PurePosixPath("d/x.bin"))
        with pytest.raises(FileNotFound):
            await channel.open_read("d/x.bin", 100)

    asyncio.run(go())
    assert not [p for p in (tmp_path / "d").iterdir()]  # no temp file left behind


def test_an_upload_cut_short_leaves_nothing(tmp_path: Path) -> None:
    channel, _ = _channel(tmp_path)

    async def go() -> None:
        with pytest.raises(Exception, match="ended after"):
            await channel.write(PurePosixPath("short.bin"), iter([b"abc"]), 10, overwrite=False)

    asyncio.run(go())
    assert list(tmp_path.iterdir()) == []


def _lie(loop: Loopback, change: Any) -> None:
    loop.tamper = change


@pytest.mark.parametrize(("lie", "error", "words"), [
    # a listing naming a path outside the workspace
    (lambda d, b: (d, [json.dumps({"files": [["../../etc/passwd", 1, 1, 1, 1]]}).encode()]),
     FileTransferFailed, "outside the workspace"),
    (lambda d, b: (d, [json.dumps({"files": [["/etc/passwd", 1, 1, 1, 1]]}).encode()]),
     FileTransferFailed, "outside the workspace"),
    # garbage instead of JSON, and a malformed entry
    (lambda d, b: (d, [b"\xff{{{not json"]), FileTransferFailed, "not valid"),
    (lambda d, b: (d, [json.dumps({"files": [["a", -5, "x", 1, 1]]}).encode()]), FileTransferFailed, "malformed"),
    (lambda d, b: ("nope", b), FileTransferFailed, "malformed"),
    # an answer that nests deeper than the bounds
    (lambda d, b: (d, [b"[" * 100_000 + b"]" * 100_000]), FileTransferFailed, "refused"),
])
def test_lying_listings_are_refused(tmp_path: Path, lie: Any, error: type[Exception], words: str) -> None:
    channel, loop = _channel(tmp_path)
    _lie(loop, lie)
    with pytest.raises(error, match=words):
        asyncio.run(channel.scan())


def test_lying_downloads_are_refused(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"hello")
    channel, loop = _channel(tmp_path)
    # a huge claimed size: refused before anything is read
    _lie(loop, lambda d, b: ({**d, "size": 10**15} if "size" in d else d, b))
    with pytest.raises(PayloadTooLarge):
        asyncio.run(_read(channel, "f.txt", max_bytes=1 << 30))
    # more bytes than announced
    _lie(loop, lambda d, b: (d, [b"x" * 1000]))
    with pytest.raises(FileTransferFailed, match="more than"):
        asyncio.run(_read(channel, "f.txt"))
    # a chunk larger than any chunk asked for
    _lie(loop, lambda d, b: ({**d, "size": 64 << 20} if "size" in d else d, [b"x" * (3 << 20)]))
    with pytest.raises(FileTransferFailed, match="chunk"):
        asyncio.run(_read(channel, "f.txt"))
    # a wrong checksum
    _lie(loop, lambda d, b: ({**d, "sha256": "0" * 64} if "sha256" in d else d, b))
    with pytest.raises(FileTransferFailed, match="sha256"):
        asyncio.run(_read(channel, "f.txt"))
    # fewer bytes than announced
    _lie(loop, lambda d, b: ({**d, "size": 50} if "size" in d else d, b))
    with pytest.raises(FileTransferFailed, match="changed while"):
        asyncio.run(_read(channel, "f.txt"))
    # an error code the manager does not know: a transfer failure, its text kept short
    _lie(loop, lambda d, b: ({"error": {"code": "weird", "message": "m" * 10_000}}, []))
    with pytest.raises(FileTransferFailed) as e:
        asyncio.run(_read(channel, "f.txt"))
    assert len(str(e.value)) <= 2000


def test_a_wrong_ack_and_silence_fail_the_upload(tmp_path: Path) -> None:
    channel, loop = _channel(tmp_path)
    _lie(loop, lambda d, b: ({"seq": 99} if "seq" in d else d, b))
    with pytest.raises(FileTransferFailed, match="acknowledged"):
        asyncio.run(channel.write(PurePosixPath("a"), iter([b"x"]), 1, overwrite=False))
    loop.silent = True  # a kernel that never answers
    with pytest.raises(FilesTimeout, match="did not answer"):
        asyncio.run(channel.scan())


def test_the_changes_note_is_bounded(tmp_path: Path) -> None:
    channel, loop = _channel(tmp_path)
    _lie(loop, lambda d, b: (d, [json.dumps({"files": [[f"f{i}", 1, 1, 1, 1] for i in range(500)]}).encode()]))
    with pytest.raises(FileTransferFailed, match="more than 51"):
        asyncio.run(channel.changes(51))


def test_file_transfers_need_the_binary_protocol(tmp_path: Path) -> None:
    """A gateway speaking only the legacy JSON protocol would carry buffers as base64: refused."""
    loop = Loopback(tmp_path)
    loop.binary = False  # type: ignore[misc]
    with pytest.raises(KernelUnavailable, match="legacy JSON protocol"):
        FileChannel(loop)  # type: ignore[arg-type]


def test_buffers_survive_a_v1_frame_both_ways() -> None:
    msg = {"header": {"msg_id": "1", "msg_type": "comm_msg"}, "parent_header": {}, "metadata": {},
           "content": {"comm_id": "c", "data": {"seq": 0}}, "buffers": [b"\x00\xff" * 1000, b"x"]}
    back = decode_frame(encode_frame(msg, "shell"), Bounds(max_part_bytes=1 << 20), lenient=True)
    assert [bytes(b) for b in back["buffers"]] == [b"\x00\xff" * 1000, b"x"]
    assert back["content"] == msg["content"]
