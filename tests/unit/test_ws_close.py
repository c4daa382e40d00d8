"""``KernelConnection.close`` never leaves a kernel websocket open: against a real local websocket
peer that answers the opening handshake and then ignores everything, close frames included, a
close ends with our side of the socket closed (the peer reads EOF), whether the closing
handshake timed out or the close was cancelled (a handover's close cut short by a deadline).
Before, a cancelled close left the socket open until the garbage collector found it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest_asyncio

from kernelmode.gateway.client import WS_PROTOCOL, GatewayClient, KernelConnection

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's
CLOSE_TIMEOUT = 0.3  # the client's bound on the closing handshake


@dataclass
class DeafPeer:
    """Accepts websockets, then reads and drops every byte (never answers a close); ``eof`` is
    set for each connection whose other end closed the socket."""

    port: int = 0
    connected: asyncio.Queue[asyncio.Event] = field(default_factory=asyncio.Queue)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        key = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                   if line.lower().startswith("sec-websocket-key:"))
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        writer.write(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     f"Sec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {WS_PROTOCOL}\r\n\r\n".encode())
        await writer.drain()
        eof = asyncio.Event()
        await self.connected.put(eof)
        while await reader.read(65536):  # the close frame too: read, never answered
            pass
        eof.set()
        writer.close()


@pytest_asyncio.fixture(loop_scope="session")
async def peer() -> AsyncIterator[tuple[DeafPeer, GatewayClient]]:
    deaf = DeafPeer()
    server = await asyncio.start_server(deaf.handle, "127.0.0.1", 0)
    deaf.port = server.sockets[0].getsockname()[1]
    async with server:
        yield deaf, GatewayClient(f"http://127.0.0.1:{deaf.port}", "token", close_timeout=CLOSE_TIMEOUT)


async def _open(deaf: DeafPeer, gateway: GatewayClient) -> tuple[KernelConnection, asyncio.Event]:
    conn = await gateway.connect("k1", lambda state: None)
    assert conn.is_open and conn.binary
    return conn, await asyncio.wait_for(deaf.connected.get(), 10)


async def test_a_close_the_peer_never_answers_ends_with_the_socket_closed(
        peer: tuple[DeafPeer, GatewayClient]) -> None:
    conn, eof = await _open(*peer)
    await conn.close()  # bounded by close_timeout: websockets' own, or ours (then aborted)
    assert not conn.is_open
    await asyncio.wait_for(eof.wait(), 10)  # our end is closed: the peer reads EOF


async def test_a_cancelled_close_aborts_the_socket(peer: tuple[DeafPeer, GatewayClient]) -> None:
    conn, eof = await _open(*peer)
    closing = asyncio.create_task(conn.close())
    await asyncio.sleep(0)  # the close frame is sent, the handshake awaited
    await asyncio.sleep(0.05)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert closing.cancelled()  # the caller's cancellation goes on
    # Before: the socket stayed open (the peer never read EOF) until the garbage collector.
    await asyncio.wait_for(eof.wait(), 10)
