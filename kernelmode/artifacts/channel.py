"""FileChannel: a session's workspace through its kernel's own Jupyter channels.

The manager shares no disk with kernels (they may run on other nodes, behind Enterprise
Gateway): listings, uploads, downloads, deletes and harvests are requests to the file agent in
the kernel (kernel/file_agent.py, which documents the protocol), one comm per operation, with file
bytes as the messages' binary buffers (the v1 websocket protocol).

The kernel is untrusted. Everything it answers is checked here: the reply's shape, each path
(relative, no '..'), each chunk's size against what was asked, the running total against the
size it announced and against the manager's own cap, and the sha256 of the whole transfer.
A download holds at most two chunks in memory (pulled one ahead); an upload at most WINDOW
chunks in flight, each acknowledged. A kernel that stays silent past the deadline (a cell
running: comm requests wait behind it; or a dead kernel) fails the operation with
FilesTimeout, never a hang.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
import uuid
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import (
    FileExists,
    FileNotFound,
    FilesTimeout,
    FileTransferFailed,
    InvalidRequest,
    KernelmodeError,
    KernelUnavailable,
    PayloadTooLarge,
    WorkspaceChanged,
    WorkspaceFull,
)
from ..gateway.client import KernelConnection, next_message
from ..gateway.exchange import DISCONNECTED_EVENT, KERNEL_STATUS_EVENT
from ..protocol import FILES_TARGET
from ..protocol.frames import json_shape_error
from ..sandbox.spec import WORKSPACE_MOUNT
from .workspace import SCAN_MAX_ENTRIES, FileEntry, Listing

CHUNK = 2 << 20  # bytes per message; under the gateway's message cap (frames.message_limit)
WINDOW = 4  # upload chunks in flight before the oldest's ack is awaited
MAX_LISTING_BYTES = 16 << 20  # a listing's JSON (the agent stops at 4 MB)
MAX_PATH_BYTES = 64 * 1024
TIMEOUT = 60.0  # seconds the kernel may take to answer one message of a transfer
SUBSHELL_TIMEOUT = 10.0  # for the kernel to make the file subshell (a control request)


# The refusals the kernel's file agent may name: kernel code is not trusted to pick any other
# class of errors.ERRORS (an unknown code is a FileTransferFailed).
_ERRORS: dict[str, type[KernelmodeError]] = {
    "file_not_found": FileNotFound, "file_exists": FileExists, "workspace_full": WorkspaceFull,
    "payload_too_large": PayloadTooLarge, "workspace_changed": WorkspaceChanged,
    "invalid_request": InvalidRequest, "checksum_mismatch": FileTransferFailed,
}


def path_hex(rel: PurePosixPath | str) -> str:
    """A workspace path as the agent takes it: hex of its file system bytes."""
    return os.fsencode(str(rel)).hex()


def checked_path(value: Any) -> str:
    """A path the kernel named, if it is a clean relative path (FileTransferFailed if not)."""
    if not isinstance(value, str) or not value or len(value) > MAX_PATH_BYTES:
        raise FileTransferFailed("the kernel named a file with no path or an overlong one")
    parts = value.split("/")
    if value.startswith("/") or "\x00" in value or any(p in ("", ".", "..") for p in parts):
        raise FileTransferFailed(f"the kernel named a path outside the workspace: {value[:200]!r}")
    return value


def _entry(row: Any) -> FileEntry:
    if not (isinstance(row, list) and len(row) == 5 and all(type(v) is int and v >= 0 for v in row[1:])):
        raise FileTransferFailed("the kernel sent a malformed file entry")
    return FileEntry(checked_path(row[0]), row[1], row[2], row[3], row[4])


def _json_buffer(msg: dict[str, Any], limit: int) -> Any:
    bufs = msg.get("buffers") or []
    if len(bufs) != 1:
        raise FileTransferFailed("the kernel's answer lacks its data buffer")
    try:
        # Surrogate escapes stay: they are the names that are not UTF-8 (frames.loads would scrub them).
        if len(bufs[0]) > limit:
            raise FileTransferFailed(f"the kernel's answer is over {limit} bytes")
        problem = json_shape_error(bufs[0])
        if problem is not None:
            raise FileTransferFailed(f"the kernel's answer is refused: {problem}")
        return json.loads(bytes(bufs[0]))
    except ValueError as e:
        raise FileTransferFailed(f"the kernel's answer is not valid: {e}") from None


def parse_listing(raw: Any) -> Listing:
    """A listing the agent sent (its JSON buffer, decoded), checked."""
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), list):
        raise FileTransferFailed("the kernel's listing is malformed")
    listing = Listing()
    if len(raw["files"]) > SCAN_MAX_ENTRIES:
        raise FileTransferFailed(f"the kernel listed more than {SCAN_MAX_ENTRIES} files")
    for row in raw["files"]:
        e = _entry(row)
        listing[e.path] = e
    stopped = raw.get("stopped")
    listing.stopped = stopped[:500] if isinstance(stopped, str) else None
    listing.full = raw.get("full") is True
    if type(raw.get("started_ns")) is int:
        listing.started_ns = raw["started_ns"]
    return listing


@dataclass
class Changes:
    """What a cell changed in the workspace, as the agent saw it."""

    files: list[FileEntry]
    truncated: bool
    stopped: str | None


def parse_changes(raw: Any, max_files: int) -> Changes:
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), list):
        raise FileTransferFailed("the kernel's change list is malformed")
    if len(raw["files"]) > max_files:
        raise FileTransferFailed(f"the kernel listed more than {max_files} changed files")
    stopped = raw.get("stopped")
    return Changes([_entry(r) for r in raw["files"]], raw.get("truncated") is True,
                   stopped[:500] if isinstance(stopped, str) else None)


def changes_buffer(raw: bytes, max_files: int) -> Changes:
    """The post-run note (OutputCollector.file_changes), checked."""
    return parse_changes(_json_buffer({"buffers": [raw]}, MAX_LISTING_BYTES), max_files)


# One subshell per kernel connection for file traffic (None: the kernel has none).
_subshells: weakref.WeakKeyDictionary[KernelConnection, str | None] = weakref.WeakKeyDictionary()
_subshell_locks: weakref.WeakKeyDictionary[KernelConnection, asyncio.Lock] = weakref.WeakKeyDictionary()


async def files_subshell(conn: KernelConnection) -> str | None:
    """The kernel subshell (JEP 91, ipykernel 7) that carries this connection's file requests,
    made on first use: its shell messages run on their own thread, so an upload or a listing
    does not wait for a running cell. None when the kernel has no subshells (older ipykernel):
    file requests then queue behind the running cell, up to the deadline."""
    if conn in _subshells:
        return _subshells[conn]
    lock = _subshell_locks.setdefault(conn, asyncio.Lock())
    async with lock:
        if conn in _subshells:
            return _subshells[conn]
        found: str | None = None
        queue = await conn.send("control", "create_subshell_request", {})
        try:
            deadline = asyncio.get_running_loop().time() + SUBSHELL_TIMEOUT
            while (msg := await next_message(queue, deadline)) is not None:
                if msg.get("msg_type") == "create_subshell_reply":
                    sid = (msg.get("content") or {}).get("subshell_id")
                    found = sid if isinstance(sid, str) and 0 < len(sid) <= 100 else None
                    break
                if msg.get("msg_type") in (DISCONNECTED_EVENT, KERNEL_STATUS_EVENT):
                    raise KernelUnavailable("the kernel went away")
        finally:
            conn.forget(queue)
        _subshells[conn] = found
        return found


class _Comm:
    """One comm to the agent: requests on it, each answered by one comm_msg."""

    def __init__(self, conn: KernelConnection, timeout: float, subshell: str | None = None) -> None:
        self.conn = conn
        self.timeout = timeout
        self.subshell = subshell
        self.comm_id = uuid.uuid4().hex
        self.opened = False

    async def request(self, data: dict[str, Any], buffers: list[bytes] | None = None,
                      opening: bool = False) -> asyncio.Queue[dict[str, Any]]:
        content: dict[str, Any] = {"comm_id": self.comm_id, "data": data}
        if opening:
            content["target_name"] = FILES_TARGET
            self.opened = True
        return await self.conn.send("shell", "comm_open" if opening else "comm_msg", content,
                                    buffers=buffers, subshell_id=self.subshell)

    async def answer(self, queue: asyncio.Queue[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(data, message) of the reply to a request, its errors raised."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                remaining = deadline - loop.time()
                try:
                    msg = await asyncio.wait_for(queue.get(), max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise FilesTimeout(
                        f"the kernel did not answer a file request within {self.timeout:.0f} s: it is "
                        "busy running code (file requests wait for the running cell) or it is dead") from None
                kind = msg.get("msg_type")
                if kind in (DISCONNECTED_EVENT, KERNEL_STATUS_EVENT):
                    raise KernelUnavailable("the kernel went away during a file operation")
                content = msg.get("content") or {}
                if content.get("comm_id") != self.comm_id:
                    continue  # status busy/idle of the request
                if msg.get("dropped"):
                    raise FileTransferFailed("the kernel's answer was over the message size limit")
                if kind == "comm_close":
                    raise KernelUnavailable("the kernel has no file agent (it closed the request)")
                if kind != "comm_msg":
                    continue
                data = content.get("data")
                if not isinstance(data, dict):
                    raise FileTransferFailed("the kernel's answer is malformed")
                error = data.get("error")
                if error is not None:
                    code = str(error.get("code")) if isinstance(error, dict) else ""
                    text = str(error.get("message"))[:2000] if isinstance(error, dict) else ""
                    raise _ERRORS.get(code, FileTransferFailed)(text or f"the kernel refused: {code[:40]}")
                return data, msg
        finally:
            self.conn.forget(queue)

    async def call(self, data: dict[str, Any], buffers: list[bytes] | None = None,
                   opening: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        return await self.answer(await self.request(data, buffers, opening))

    async def close(self) -> None:
        if self.opened and self.conn.is_open:
            try:
                await self.conn.send("shell", "comm_close", {"comm_id": self.comm_id, "data": {}},
                                     expect_reply=False, subshell_id=self.subshell)
            except KernelmodeError:
                pass


class Download:
    """A file being read from the kernel: ``size`` as announced, then ``chunks()``."""

    def __init__(self, comm: _Comm, first: dict[str, Any], msg: dict[str, Any], max_bytes: int) -> None:
        self.comm = comm
        self.max_bytes = max_bytes
        size = first.get("size")
        if type(size) is not int or size < 0:
            raise FileTransferFailed("the kernel announced no valid size")
        if size > max_bytes:
            raise PayloadTooLarge(f"the file is {size} bytes, over the limit of {max_bytes}")
        self.size = size
        self._first: tuple[dict[str, Any], dict[str, Any]] | None = (first, msg)

    def _take(self, data: dict[str, Any], msg: dict[str, Any], received: int) -> tuple[bytes, bool]:
        bufs = msg.get("buffers") or []
        if len(bufs) != 1:
            raise FileTransferFailed("the kernel's chunk lacks its buffer")
        chunk = bytes(bufs[0])
        if len(chunk) > CHUNK:
            raise FileTransferFailed(f"the kernel sent a chunk of {len(chunk)} bytes, more than the {CHUNK} asked")
        if received + len(chunk) > self.size:
            raise FileTransferFailed(f"the kernel sent more than the {self.size} bytes it announced")
        return chunk, data.get("eof") is True

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The file's bytes, checked; the next chunk is asked for before one is handed on."""
        h = hashlib.sha256()
        received = 0
        assert self._first is not None, "chunks() once"
        data, msg = self._first
        self._first = None
        pending: asyncio.Queue[dict[str, Any]] | None = None
        try:
            while True:
                chunk, eof = self._take(data, msg, received)
                received += len(chunk)
                h.update(chunk)
                pending = None if eof else await self.comm.request({"op": "next"})
                if eof:
                    if data.get("sha256") != h.hexdigest():
                        raise FileTransferFailed("the file's sha256 does not match the bytes received")
                    if received != self.size:  # changed while read: the announced length is a promise
                        raise FileTransferFailed(f"the file changed while it was read ({received} of "
                                                 f"{self.size} bytes)")
                if chunk:
                    yield chunk
                if pending is None:
                    return
                queue, pending = pending, None
                data, msg = await self.comm.answer(queue)
        finally:
            if pending is not None:  # the reader stopped early: the chunk asked for is not awaited
                self.comm.conn.forget(pending)
            await self.comm.close()

    async def read_all(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return b"".join(parts)


class FileChannel:
    """File operations on one kernel's workspace (its file agent, over ``conn``)."""

    def __init__(self, conn: KernelConnection | None, timeout: float = TIMEOUT, use_subshell: bool = True) -> None:
        if conn is None or not conn.is_open:
            raise KernelUnavailable("the session's kernel is not connected")
        if not conn.binary:
            raise KernelUnavailable("the gateway speaks only the legacy JSON protocol: file transfers "
                                    "need v1.kernel.websocket.jupyter.org (binary buffers)")
        self.conn = conn
        self.timeout = timeout
        self.use_subshell = use_subshell
        self.subshell: str | None = None

    def _comm(self) -> _Comm:
        return _Comm(self.conn, self.timeout, self.subshell)

    async def _ready(self) -> None:
        if self.use_subshell and self.subshell is None:
            self.subshell = await files_subshell(self.conn)

    async def _once(self, data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        await self._ready()
        comm = self._comm()
        try:
            return await comm.call(data, opening=True)
        finally:
            await comm.close()

    async def scan(self, rebase: bool = False) -> Listing:
        """The workspace's files (bounded walk in the kernel); ``rebase``: the agent's next
        change note starts from this listing."""
        _, msg = await self._once({"op": "list", "rebase": rebase})
        return parse_listing(_json_buffer(msg, MAX_LISTING_BYTES))

    async def changes(self, max_files: int) -> Changes:
        """What changed since the agent last looked (when its post-run note did not arrive)."""
        _, msg = await self._once({"op": "changes"})
        return parse_changes(_json_buffer(msg, MAX_LISTING_BYTES), max_files)

    async def delete(self, rel: PurePosixPath) -> str:
        await self._once({"op": "delete", "path": path_hex(rel)})
        return f"{WORKSPACE_MOUNT}/{rel}"

    async def open_read(self, rel: PurePosixPath | str, max_bytes: int) -> Download:
        """Start reading a file; FileNotFound, PayloadTooLarge (over ``max_bytes``) at once."""
        await self._ready()
        comm = self._comm()
        try:
            first, msg = await comm.call({"op": "read", "path": path_hex(rel), "max_bytes": max_bytes,
                                          "chunk": CHUNK}, opening=True)
            return Download(comm, first, msg, max_bytes)
        except BaseException:
            await comm.close()
            raise

    async def write(self, rel: PurePosixPath, chunks: AsyncIterator[bytes] | Iterator[bytes], size: int | None,
                    overwrite: bool, quota: dict[str, int] | None = None) -> tuple[str, FileEntry]:
        """Write a file (temp file + rename in the kernel) from ``chunks`` of at most CHUNK bytes,
        exactly ``size`` in all (None: unchecked); WINDOW chunks in flight. (path in the kernel, its entry)."""
        await self._ready()
        comm = self._comm()
        h = hashlib.sha256()
        sent = 0
        pending: deque[tuple[int, asyncio.Queue[dict[str, Any]]]] = deque()

        async def settle(queue_item: tuple[int, asyncio.Queue[dict[str, Any]]]) -> None:
            seq, queue = queue_item
            data, _ = await comm.answer(queue)
            if data.get("seq") != seq:
                raise FileTransferFailed("the kernel acknowledged a chunk it was not sent")

        try:
            await comm.call({"op": "write", "path": path_hex(rel), "overwrite": overwrite, "size": size,
                             "quota": quota}, opening=True)
            seq = 0
            async for chunk in _aiter(chunks):
                if not chunk:
                    continue
                sent += len(chunk)
                if size is not None and sent > size:
                    raise InvalidRequest(f"the upload is longer than its declared {size} bytes")
                h.update(chunk)
                pending.append((seq, await comm.request({"seq": seq}, [chunk])))
                seq += 1
                if len(pending) >= WINDOW:
                    await settle(pending.popleft())
            while pending:
                await settle(pending.popleft())
            if size is not None and sent != size:
                raise InvalidRequest(f"the upload ended after {sent} of its {size} bytes")
            done, _ = await comm.call({"op": "commit", "sha256": h.hexdigest()})
        finally:
            for _, queue in pending:
                self.conn.forget(queue)
            await comm.close()
        entry = done.get("entry")
        rel_s = str(rel)
        return f"{WORKSPACE_MOUNT}/{rel}", _entry([rel_s, *entry] if isinstance(entry, list) else None)


async def _aiter(chunks: AsyncIterator[bytes] | Iterator[bytes]) -> AsyncIterator[bytes]:
    if isinstance(chunks, Iterator):
        for c in chunks:
            yield c
    else:
        async for c in chunks:
            yield c




def file_channel(conn: KernelConnection | None, timeout: float = TIMEOUT) -> FileChannel | None:
    """The kernel's file channel, or None when its connection cannot carry one."""
    try:
        return FileChannel(conn, timeout)
    except KernelUnavailable:
        return None


async def receive_file(channel: FileChannel, rel: PurePosixPath | str, max_bytes: int,
                       directory: Path) -> tuple[Path, int, str]:
    """A workspace file copied from the kernel into a private temp file in ``directory``:
    (path, size, sha256), the checksum verified against the kernel's. Stores then read the
    copy, so a kernel changing the file meanwhile cannot swap what is stored for what was checked."""
    download = await channel.open_read(rel, max_bytes)
    h = hashlib.sha256()
    size = 0
    fd, name = tempfile.mkstemp(dir=directory)
    tmp = Path(name)
    chunks = download.chunks()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:  # Download checks it too; counted here, where it is stored
                    raise FileTransferFailed(f"the kernel sent more than the {max_bytes} bytes allowed")
                h.update(chunk)
                await asyncio.to_thread(out.write, chunk)
    except BaseException:
        tmp.unlink(missing_ok=True)  # noqa: ASYNC240 (a local temp file)
        raise
    finally:
        await chunks.aclose()
    return tmp, size, h.hexdigest()
