"""The manager's kernel websocket (kernelmode/gateway/client.py: KernelConnection over
FrameConnection) against a real websockets server speaking the v1 protocol over loopback: whole
frames are routed straight from the parser, a fragmented message (which tornado never sends)
moves the connection to websockets' own reader without reordering anything, and a frame over
the size cap still ends the connection, which every waiting request is told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from jupyter_client.session import Session
from websockets.asyncio.server import ServerConnection, serve

from kernelmode.gateway.client import WS_PROTOCOL, GatewayClient, KernelConnection
from kernelmode.gateway.exchange import DISCONNECTED_EVENT
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame

LIMIT = 64 * 1024  # the client's max_message_bytes: frames over LIMIT + FRAME_SLACK end it


def _reply(session: Session, parent: dict[str, Any], i: int, text: str = "") -> bytes:
    msg = session.msg("stream", {"name": "stdout", "text": text or str(i)}, parent=parent)
    return encode_frame(msg, "iopub")


async def _kernel(ws: ServerConnection) -> None:
    """Answers each request with a script of frames, by its code: "whole", "fragmented"
    (frames 3 and 6 of 8 sent in pieces), "text" (legacy JSON frames), "huge" (one frame over the
    client's cap after two good ones)."""
    session = Session(key=b"x")
    async for raw in ws:
        req = decode_frame(raw, Bounds(LIMIT))
        parent, code = req["header"], req["content"]["code"]
        for i in range(8):
            frame = _reply(session, parent, i)
            if code == "fragmented" and i in (3, 6):
                await ws.send([frame[:10], frame[10:20], frame[20:]])  # an iterable: fragments
            elif code == "text":
                msg = session.msg("stream", {"name": "stdout", "text": str(i)}, parent=parent)
                await ws.send(session.pack({**msg, "channel": "iopub"}).decode())
            elif code == "huge" and i == 2:
                await ws.send(_reply(session, parent, i, "x" * (2 * LIMIT + 70_000)))
                return
            else:
                await ws.send(frame)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway() -> AsyncIterator[GatewayClient]:
    async with serve(_kernel, "127.0.0.1", 0, subprotocols=[WS_PROTOCOL], compression=None,  # type: ignore[list-item]
                     max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield GatewayClient(f"http://127.0.0.1:{port}", "token", max_message_bytes=LIMIT)


async def _run(conn: KernelConnection, code: str, want: int) -> list[dict[str, Any]]:
    queue = await conn.send("shell", "execute_request", {"code": code})
    got = []
    while len(got) < want:
        msg = await asyncio.wait_for(queue.get(), 30)
        got.append(msg)
        if msg["msg_type"] == DISCONNECTED_EVENT:
            break
    conn.forget(queue)
    return got


async def test_whole_frames_are_routed_in_order(gateway: GatewayClient) -> None:
    conn = await gateway.connect("k1", lambda state: None)
    try:
        got = await _run(conn, "whole", 8)
        assert [m["content"]["text"] for m in got] == [str(i) for i in range(8)]
        assert conn._ws is not None and conn._ws.on_frame is not None  # type: ignore[attr-defined]
        assert conn.is_open
    finally:
        await conn.close()


async def test_a_fragmented_message_keeps_the_order(gateway: GatewayClient) -> None:
    conn = await gateway.connect("k2", lambda state: None)
    try:
        got = await _run(conn, "fragmented", 8)
        assert [m["content"]["text"] for m in got] == [str(i) for i in range(8)]
        # From the first fragment on, websockets' reader delivers (and goes on working).
        assert conn._ws is not None and conn._ws.on_frame is None  # type: ignore[attr-defined]
        again = await _run(conn, "whole", 8)
        assert [m["content"]["text"] for m in again] == [str(i) for i in range(8)]
    finally:
        await conn.close()


async def test_text_frames(gateway: GatewayClient) -> None:
    conn = await gateway.connect("k3", lambda state: None)
    try:
        got = await _run(conn, "text", 8)
        assert [m["content"]["text"] for m in got] == [str(i) for i in range(8)]
    finally:
        await conn.close()


async def test_a_frame_over_the_cap_ends_the_connection(gateway: GatewayClient) -> None:
    conn = await gateway.connect("k4", lambda state: None)
    try:
        got = await _run(conn, "huge", 3)
        assert [m["msg_type"] for m in got] == ["stream", "stream", DISCONNECTED_EVENT]
        assert conn._ws is not None and conn._ws.protocol.close_sent.code == 1009  # message too big
        for _ in range(100):
            if not conn.is_open:
                break
            await asyncio.sleep(0.01)
        assert not conn.is_open
    finally:
        await conn.close()
