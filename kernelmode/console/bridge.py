"""Local Jupyter channels for a remote session: ZMQ sockets here, a websocket to kernelmode there.

Frontends (jupyter console, qtconsole, an editor's "existing kernel") speak ZMQ to a kernel
named by a connection file. The bridge binds those sockets on this machine (ipc in a private
0700 directory by default, or loopback TCP), signs with a key of its own, and relays every
message to ``/v1/sessions/{id}/channels`` on the server, with the API token. The kernel stays
in its sandbox with no port opened; signing on both sides is jupyter_client's Session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import tempfile
from pathlib import Path
from typing import Any

import websockets
import zmq
import zmq.asyncio
from jupyter_client.connect import write_connection_file
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from websockets.asyncio.client import ClientConnection

from ..errors import BridgeError

WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"
_ROUTED = ("shell", "control", "stdin")


def _pack(obj: Any) -> bytes:
    return json.dumps(obj, default=json_default).encode()


class ChannelBridge:
    def __init__(self, url: str, token: str, session_id: str, transport: str = "ipc") -> None:
        self.ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + \
            f"/v1/sessions/{session_id}/channels"
        self.token = token
        self.transport = transport
        self.session = Session(key=secrets.token_hex(32).encode(), signature_scheme="hmac-sha256",
                               username="kernelmode-console")
        self.dir = Path(tempfile.mkdtemp(prefix="kernelmode-console-"))  # 0700: ours alone
        self.connection_file = self.dir / "kernel.json"
        self._ctx = zmq.asyncio.Context()
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._routes: dict[str, list[bytes]] = {}  # request msg_id -> the frontend's identities
        self._ws: ClientConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = asyncio.Event()

    async def start(self) -> Path:
        try:
            self._ws = await websockets.connect(
                self.ws_url, additional_headers={"Authorization": f"Bearer {self.token}"},
                subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                max_size=256 * 1024 * 1024, compression=None, open_timeout=30, ping_interval=20,
            )
        except websockets.InvalidStatus as e:
            body = e.response.body.decode(errors="replace") if e.response.body else ""
            try:
                message = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = body or f"HTTP {e.response.status_code}"
            raise BridgeError(message) from e
        except (OSError, websockets.WebSocketException, asyncio.TimeoutError) as e:
            raise BridgeError(f"cannot reach {self.ws_url}: {e}") from e
        kinds = {"shell": zmq.ROUTER, "control": zmq.ROUTER, "stdin": zmq.ROUTER, "iopub": zmq.PUB,
                 "hb": zmq.REP}
        ports: dict[str, int] = {}
        ip = str(self.dir / "k") if self.transport == "ipc" else "127.0.0.1"
        for n, (name, kind) in enumerate(kinds.items(), start=1):
            sock = self._ctx.socket(kind)
            sock.linger = 0
            if self.transport == "ipc":
                sock.bind(f"ipc://{ip}-{n}")
                ports[name] = n
            else:
                ports[name] = sock.bind_to_random_port("tcp://127.0.0.1")
            self._sockets[name] = sock
        write_connection_file(
            str(self.connection_file), ip=ip, transport=self.transport, key=self.session.key,
            signature_scheme="hmac-sha256", kernel_name="kernelmode",
            shell_port=ports["shell"], iopub_port=ports["iopub"], stdin_port=ports["stdin"],
            control_port=ports["control"], hb_port=ports["hb"],
        )
        self._tasks = [asyncio.create_task(self._from_frontend(ch)) for ch in _ROUTED]
        self._tasks += [asyncio.create_task(self._from_server()), asyncio.create_task(self._heartbeat())]
        return self.connection_file

    async def _from_frontend(self, channel: str) -> None:
        sock = self._sockets[channel]
        assert self._ws is not None
        while True:
            frames = await sock.recv_multipart()
            try:
                idents, rest = self.session.feed_identities(frames)
                msg = self.session.deserialize(rest)  # checks the frontend's signature
            except Exception:  # noqa: BLE001 - a bad message from the frontend: drop it
                continue
            self._routes[msg["header"]["msg_id"]] = idents
            if len(self._routes) > 10_000:
                self._routes.pop(next(iter(self._routes)))
            out = {k: msg[k] for k in ("header", "parent_header", "metadata", "content")}
            out["buffers"] = msg.get("buffers", [])
            await self._ws.send(serialize_msg_to_ws_v1(out, channel, _pack))

    async def _from_server(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                if isinstance(raw, str):
                    continue
                channel, parts = deserialize_msg_from_ws_v1(raw)
                msg = {"header": json.loads(parts[0]), "parent_header": json.loads(parts[1]),
                       "metadata": json.loads(parts[2]), "content": json.loads(parts[3])}
                msg["msg_id"] = msg["header"].get("msg_id")
                msg["msg_type"] = msg["header"].get("msg_type")
                buffers: list[bytes | memoryview[bytes]] = [bytes(b) for b in parts[4:]]
                if channel == "iopub":
                    self.session.send(self._sockets["iopub"], msg, buffers=buffers)
                elif channel in _ROUTED:
                    idents = self._routes.get(msg["parent_header"].get("msg_id", ""))
                    if idents is not None:
                        self.session.send(self._sockets[channel], msg, ident=idents, buffers=buffers)
        except websockets.WebSocketException:
            pass
        finally:
            self.closed.set()

    async def _heartbeat(self) -> None:
        sock = self._sockets["hb"]
        while True:
            await sock.send_multipart(await sock.recv_multipart())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._ctx.term()
        for f in self.dir.iterdir():
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()
