"""A stand-in for the Kernel Gateway at the manager's boundary: the Python interface of
``GatewayClient`` and ``KernelConnection`` that sessions/ uses, with scripted kernels in the same
process. The code under test (Kernel, Runner, SessionManager) is the real one; only the backend is
fake, so runs take milliseconds and start no server (cf. docker-py's fake API, httpx's
MockTransport). The real thing is what tests/integration and tests/security run against.

A cell's code is a script for the fake kernel, one command:

- ``print:TEXT``: prints TEXT, and the cell's value is ``'TEXT'``;
- ``raise``: ``ValueError('boom')``;
- ``wait``: waits until the test calls ``FakeGateway.release()``, then prints ``done``;
- ``hang``: runs until interrupted (then ``KeyboardInterrupt``, as ipykernel answers);
- ``die:restarting`` / ``die:dead``: the kernel is killed by SIGKILL mid-cell (a death record is
  written, as the provisioner does); the gateway restarts it, or gives it up and forgets it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelmode.errors import KernelUnavailable
from kernelmode.gateway.exchange import DISCONNECTED_EVENT, KERNEL_STATUS_EVENT
from kernelmode.models import DeathCause
from kernelmode.sandbox.spec import write_death_record

Message = dict[str, Any]


class FakeKernel:
    """One kernel process: its execution count, and the events a cell may wait on."""

    def __init__(self) -> None:
        self.count = 0
        self.interrupted = asyncio.Event()


class FakeConnection:
    """``KernelConnection``'s interface: requests go to the fake kernel, answers come back in
    the request's queue."""

    def __init__(self, gateway: FakeGateway, kernel_id: str, on_status: Callable[[str], None]) -> None:
        self.gateway = gateway
        self.kernel_id = kernel_id
        self.on_kernel_status = on_status
        self.is_open = True
        self._listeners: dict[str, asyncio.Queue[Message]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, channel: str, msg_type: str, content: dict[str, Any],
                   expect_reply: bool = True) -> asyncio.Queue[Message]:
        if not self.is_open:
            raise KernelUnavailable(f"the websocket of kernel {self.kernel_id} is closed")
        msg_id = uuid.uuid4().hex
        queue: asyncio.Queue[Message] = asyncio.Queue()
        queue.msg_id = msg_id  # type: ignore[attr-defined]
        if expect_reply:
            self._listeners[msg_id] = queue
        if msg_type == "kernel_info_request":
            self._emit(msg_id, "kernel_info_reply", {"status": "ok"})
            self._emit(msg_id, "status", {"execution_state": "idle"})
        elif msg_type == "execute_request":
            if not content.get("silent"):
                self.gateway.cells.append(content["code"])
            task = asyncio.create_task(self._execute(msg_id, content))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return queue

    def forget(self, queue: asyncio.Queue[Message]) -> None:
        self._listeners.pop(getattr(queue, "msg_id", ""), None)

    def broadcast(self, event: Message) -> None:
        for queue in self._listeners.values():
            queue.put_nowait(event)

    async def kernel_info(self, timeout: float) -> dict[str, Any]:
        if self.kernel_id not in self.gateway.kernels:
            raise KernelUnavailable(f"kernel {self.kernel_id} did not answer")
        return {"status": "ok"}

    async def ping(self, timeout: float) -> bool:
        return self.is_open and self.kernel_id in self.gateway.kernels

    async def close(self) -> None:
        if self.is_open:
            self.is_open = False
            self.broadcast({"msg_type": DISCONNECTED_EVENT})
        for task in list(self._tasks):
            task.cancel()

    def _emit(self, parent: str, msg_type: str, content: dict[str, Any]) -> None:
        queue = self._listeners.get(parent)
        if queue is not None:
            queue.put_nowait({"msg_type": msg_type, "content": content, "parent_header": {"msg_id": parent}})

    async def _execute(self, msg_id: str, content: dict[str, Any]) -> None:
        kernel = self.gateway.kernels[self.kernel_id]
        emit = self._emit
        emit(msg_id, "status", {"execution_state": "busy"})
        code: str = content["code"]
        if content.get("silent"):  # the preamble: installed at once
            emit(msg_id, "execute_reply", {"status": "ok", "execution_count": kernel.count})
            emit(msg_id, "status", {"execution_state": "idle"})
            return
        kernel.count += 1
        emit(msg_id, "execute_input", {"code": code, "execution_count": kernel.count})
        command, _, arg = code.partition(":")
        error: tuple[str, str] | None = None
        if command == "print":
            emit(msg_id, "stream", {"name": "stdout", "text": arg + "\n"})
            emit(msg_id, "execute_result", {"data": {"text/plain": repr(arg)}, "execution_count": kernel.count})
        elif command == "raise":
            error = ("ValueError", "boom")
        elif command == "wait":
            await self.gateway.released.wait()
            emit(msg_id, "stream", {"name": "stdout", "text": "done\n"})
        elif command == "hang":
            kernel.interrupted.clear()
            await kernel.interrupted.wait()
            error = ("KeyboardInterrupt", "")
        elif command == "die":
            self.gateway.kill(self, arg)
            return
        if error is not None:
            emit(msg_id, "error", {"ename": error[0], "evalue": error[1], "traceback": [f"{error[0]}: {error[1]}"]})
        emit(msg_id, "execute_reply", {"status": "error" if error else "ok", "execution_count": kernel.count})
        emit(msg_id, "status", {"execution_state": "idle"})


class FakeGateway:
    """``GatewayClient``'s interface, with kernels in this process. ``cells``: the code of every
    cell the kernels were sent (the preamble left out), in order."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.kernels: dict[str, FakeKernel] = {}
        self.cells: list[str] = []
        self.started: list[str] = []
        self.interrupts = 0
        self.released = asyncio.Event()

    def release(self) -> None:
        """Cells waiting (``wait``) go on."""
        self.released.set()

    async def start_kernel(self, kernel_id: str, env: dict[str, str], timeout: float) -> None:
        self.kernels[kernel_id] = FakeKernel()
        self.started.append(kernel_id)

    async def shutdown_kernel(self, kernel_id: str, timeout: float | None = None) -> None:
        self.kernels.pop(kernel_id, None)

    async def interrupt_kernel(self, kernel_id: str) -> None:
        self.interrupts += 1
        kernel = self.kernels.get(kernel_id)
        if kernel is not None:
            kernel.interrupted.set()

    async def restart_kernel(self, kernel_id: str, timeout: float) -> None:
        if kernel_id not in self.kernels:
            raise KernelUnavailable(f"no kernel {kernel_id}")
        self.kernels[kernel_id] = FakeKernel()

    async def connect(self, kernel_id: str, on_kernel_status: Callable[[str], None]) -> FakeConnection:
        if kernel_id not in self.kernels:
            raise KernelUnavailable(f"no kernel {kernel_id}")
        return FakeConnection(self, kernel_id, on_kernel_status)

    async def ping(self, timeout: float = 5) -> bool:
        return True

    async def list_kernels(self, timeout: float | None = None) -> list[dict[str, Any]]:
        return [{"id": k} for k in self.kernels]

    def kill(self, conn: FakeConnection, then: str) -> None:
        """SIGKILL the kernel: its death record first (the provisioner's), then the gateway's
        status: ``restarting`` (a fresh process under the same id) or ``dead`` (forgotten)."""
        write_death_record(self.state_dir, conn.kernel_id, DeathCause(kind="signal", signal=9))
        if then == "dead":
            self.kernels.pop(conn.kernel_id, None)
        else:
            self.kernels[conn.kernel_id] = FakeKernel()
        # As KernelConnection._route does: the requests in flight hear it, then the kernel.
        conn.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": then})
        conn.on_kernel_status(then)
