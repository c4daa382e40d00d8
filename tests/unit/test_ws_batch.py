"""The gateway's batched websocket writes (kernelmode/gateway_ext/ws_batch.py) on a real tornado
websocket server and a real websockets client over loopback TCP: the frames of one loop pass
arrive whole and in order, in one TCP segment (counted by the client's TCP stack), where
tornado's own writes make one send a frame."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import tornado.web
import tornado.websocket
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from websockets.asyncio.client import ClientConnection, connect

from kernelmode.gateway_ext.ws_batch import FLUSH_BYTES, BatchedWrites, frame_header
from tests.tcp_counts import data_segs_in


class _Writer(BatchedWrites):
    """The mixin on its own: what the gateway's connection class gives it."""

    def __init__(self, handler: tornado.websocket.WebSocketHandler) -> None:
        self.websocket_handler = handler
        self.channels = {}


class _Handler(tornado.websocket.WebSocketHandler):
    """On "<mode> <n> <size>": n frames of size bytes, numbered, made in one loop pass, through
    the batching writer ("batched", "text") or tornado's own write_message ("plain")."""

    last: _Writer | None = None

    def open(self, *args: Any, **kwargs: Any) -> None:
        self.set_nodelay(True)  # as the gateway's connections: one send, one segment
        self.writer = _Handler.last = _Writer(self)

    def on_message(self, message: str | bytes) -> None:
        mode, n, size = str(message).split()
        write = self.write_message if mode == "plain" else self.writer.write_message
        for i in range(int(n)):
            body = f"{i:08d}".encode() + b"x" * int(size)
            write(body.decode() if mode == "text" else body, binary=mode != "text")


@pytest_asyncio.fixture(loop_scope="session")
async def server() -> AsyncIterator[str]:
    sockets = bind_sockets(0, "127.0.0.1")
    http = HTTPServer(tornado.web.Application([(r"/ws", _Handler)]))
    http.add_sockets(sockets)
    yield f"ws://127.0.0.1:{sockets[0].getsockname()[1]}/ws"
    http.stop()


def _sock(ws: ClientConnection) -> socket.socket:
    return ws.transport.get_extra_info("socket")


async def _burst(ws: ClientConnection, mode: str, n: int, size: int) -> tuple[list[Any], int]:
    """The n frames of one burst, and the data segments they came in."""
    before = data_segs_in(_sock(ws))
    await ws.send(f"{mode} {n} {size}")
    got = [await asyncio.wait_for(ws.recv(), 60) for _ in range(n)]
    return got, data_segs_in(_sock(ws)) - before


async def test_one_pass_of_frames_is_one_segment_in_order(server: str) -> None:
    async with connect(server, max_size=None, compression=None) as ws:
        plain, _ = await _burst(ws, "plain", 50, 100)
        batched, batched_segs = await _burst(ws, "batched", 50, 100)
    want = [f"{i:08d}".encode() + b"x" * 100 for i in range(50)]
    assert plain == want and batched == want
    # One send. (tornado's 50 sends arrive in 10-50 segments: Linux's autocorking merges
    # some small sends made while the one before is still on its way.)
    assert batched_segs == 1


@pytest.mark.parametrize("size", [0, 117, 118, 65_527, 65_528, 70_000])
async def test_every_header_form_reads_back(server: str, size: int) -> None:
    """Payloads around the 7-bit, 16-bit and 64-bit length forms (8 bytes of number + size),
    text and binary, checked by the client's strict parser."""
    async with connect(server, max_size=None, compression=None) as ws:
        binary, _ = await _burst(ws, "batched", 3, size)
        text, _ = await _burst(ws, "text", 3, size)
    assert binary == [f"{i:08d}".encode() + b"x" * size for i in range(3)]
    assert text == [f"{i:08d}" + "x" * size for i in range(3)]


def test_frame_header_lengths() -> None:
    assert frame_header(125, True) == b"\x82\x7d"
    assert frame_header(126, False) == b"\x81\x7e\x00\x7e"
    assert frame_header(65_536, True) == b"\x82\x7f" + (65_536).to_bytes(8, "big")


async def test_large_frames_are_not_held(server: str) -> None:
    """Past FLUSH_BYTES the pending frames are written at once; nothing is reordered or lost."""
    size = FLUSH_BYTES // 2
    async with connect(server, max_size=None, compression=None) as ws:
        got, _ = await _burst(ws, "batched", 7, size)
    assert [g[:8] for g in got] == [f"{i:08d}".encode() for i in range(7)]
    assert all(len(g) == size + 8 for g in got)


async def test_a_closed_websocket_refuses_and_drops(server: str) -> None:
    async with connect(server, compression=None) as ws:
        await _burst(ws, "batched", 1, 1)
        writer = _Handler.last
        assert writer is not None
        writer.write_message(b"pending", binary=True)  # queued: flushed next pass, to a closed socket
    for _ in range(100):  # the server sees the close within a few loop passes
        if writer._ws_open() is None:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(tornado.websocket.WebSocketClosedError):
        writer.write_message(b"late", binary=True)
    await asyncio.sleep(0)  # the pending flush runs: dropped quietly
    assert writer._batch_state()["parts"] == []
