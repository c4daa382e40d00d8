"""The kernel's file agent (kernel/file_agent.py) driven in-process, behind a KernelConnection-shaped
loopback: FileChannel and the harvester run against the real agent code on a real directory,
without a kernel. A test may swap the agent's answers (``tamper``) to act as a lying kernel."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelmode.kernel import file_agent as agent

Reply = tuple[dict[str, Any], list[bytes]]


class _Comm:
    def __init__(self, loop: Loopback, comm_id: str, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.loop, self.comm_id, self.queue = loop, comm_id, queue
        self.msg_cb: Callable[[dict[str, Any]], None] | None = None
        self.close_cb: Callable[[dict[str, Any]], None] | None = None

    def send(self, data: dict[str, Any], buffers: list[bytes] | None = None) -> None:
        data, bufs = self.loop.tamper(data, [bytes(b) for b in buffers or []])
        self.queue.put_nowait({"msg_type": "comm_msg", "content": {"comm_id": self.comm_id, "data": data},
                               "buffers": [memoryview(b) for b in bufs]})

    def on_msg(self, cb: Callable[[dict[str, Any]], None]) -> None:
        self.msg_cb = cb

    def on_close(self, cb: Callable[[dict[str, Any]], None]) -> None:
        self.close_cb = cb


class Loopback:
    """Enough of KernelConnection for FileChannel: send, forget, is_open, binary."""

    is_open = True
    binary = True

    def __init__(self, root: Path, **config: Any) -> None:
        agent.configure({"root": str(root), **config})
        self.comms: dict[str, _Comm] = {}
        self.tamper: Callable[[dict[str, Any], list[bytes]], Reply] = lambda d, b: (d, b)
        self.silent = False

    async def send(self, channel: str, msg_type: str, content: dict[str, Any], expect_reply: bool = True,
                   buffers: list[bytes] | None = None, subshell_id: str | None = None) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        queue.msg_id = uuid.uuid4().hex  # type: ignore[attr-defined]
        if self.silent:
            return queue
        if msg_type == "create_subshell_request":
            queue.put_nowait({"msg_type": "create_subshell_reply", "content": {"subshell_id": "loop"}})
            return queue
        cid = content["comm_id"]
        msg = {"content": content, "buffers": [memoryview(b) for b in buffers or []]}
        if msg_type == "comm_open":
            comm = self.comms[cid] = _Comm(self, cid, queue)
            agent.on_open(comm, msg)
        elif msg_type == "comm_msg" and cid in self.comms:
            comm = self.comms[cid]
            comm.queue = queue
            if comm.msg_cb is not None:
                comm.msg_cb(msg)
        elif msg_type == "comm_close" and cid in self.comms:
            comm = self.comms.pop(cid)
            if comm.close_cb is not None:
                comm.close_cb(msg)
        return queue

    def forget(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        pass
