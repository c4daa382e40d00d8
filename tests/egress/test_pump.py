"""The tunnel pump (egress/pump.py) on real sockets: a unix socket pair for the kernel's side, a
loopback TCP connection for the upstream, os.splice in between. The cap is carried exactly, a
half-close is passed on, and a client that stops reading holds at most a pipe's worth."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
from collections.abc import Awaitable, Callable

import pytest

from kernelmode.egress import pump
from kernelmode.egress.pump import Pump
from kernelmode.egress.streams import Link, Meter
from kernelmode.errors import EgressCapReached

from .conftest import Rig

pytestmark = pytest.mark.skipif(not pump.available(), reason="os.splice is Linux-only")


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


Scenario = Callable[[Pump, asyncio.Task[None], socket.socket, socket.socket], Awaitable[None]]


def _run(cap: int, scenario: Scenario, idle: float = 30) -> None:
    """Pump between (kernel, client end) and (upstream end, upstream); ``scenario`` drives the
    outer ends (``kernel``, ``upstream``, both non-blocking) while the pump runs."""

    async def main() -> None:
        kernel, client = socket.socketpair()
        upstream, server = _tcp_pair()
        for s in (kernel, client, upstream, server):
            s.setblocking(False)
        link = Link(Meter(cap), idle)
        p = Pump(link, client, server)
        task = asyncio.ensure_future(p.run())
        link.watch(task)
        try:
            await scenario(p, task, kernel, upstream)
        finally:
            link.unwatch()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for s in (kernel, client, upstream, server):
                s.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while chunk := await loop.sock_recv(sock, 1 << 16):
        out += chunk
    return bytes(out)


async def _until(check: Callable[[], bool]) -> None:
    loop, met = asyncio.get_running_loop(), asyncio.Event()

    def poll() -> None:
        if check():
            met.set()
        else:
            loop.call_later(0.01, poll)
    poll()
    await met.wait()


def test_the_cap_is_carried_exactly() -> None:
    cap = 3 * pump.PIPE + 12345  # several pipefuls, and a remainder

    async def scenario(p: Pump, task: asyncio.Task[None], kernel: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        payload = os.urandom(cap)
        await loop.sock_sendall(kernel, payload)
        kernel.shutdown(socket.SHUT_WR)
        assert await _read_all(upstream) == payload  # every byte of the budget, then the EOF
        upstream.shutdown(socket.SHUT_WR)
        await task  # both ways ended: no error, the budget spent to the byte
        assert p.link.meter.used == cap

    _run(cap, scenario)


def test_one_byte_past_the_cap_fails_the_tunnel_and_is_not_forwarded() -> None:
    cap = pump.PIPE + 999

    async def scenario(p: Pump, task: asyncio.Task[None], kernel: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        payload = os.urandom(cap + 1)
        send = asyncio.ensure_future(loop.sock_sendall(kernel, payload))
        got = bytearray()
        while not task.done() or len(got) < cap:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(upstream, 1 << 16), 0.5 if task.done() else 30)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
        with pytest.raises(EgressCapReached):
            await task
        send.cancel()
        assert bytes(got) == payload[:cap]  # the cap exactly: byte cap + 1 stayed in the pipe

    _run(cap, scenario)


def test_a_half_close_is_passed_on_and_the_answer_still_comes_back() -> None:
    async def scenario(p: Pump, task: asyncio.Task[None], kernel: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(kernel, b"request")
        kernel.shutdown(socket.SHUT_WR)
        assert await _read_all(upstream) == b"request"  # EOF reached the upstream
        answer = os.urandom(2 << 20)
        await loop.sock_sendall(upstream, answer)
        upstream.shutdown(socket.SHUT_WR)
        assert await _read_all(kernel) == answer
        await task
        assert (p.link.up, p.link.down) == (7, len(answer))

    _run(1 << 30, scenario)


def test_a_client_that_stops_reading_holds_a_pipe_not_the_download() -> None:
    size = 64 << 20

    async def scenario(p: Pump, task: asyncio.Task[None], kernel: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        payload = os.urandom(size)
        send = asyncio.ensure_future(loop.sock_sendall(upstream, payload))
        down = p.ways[1]
        # The kernel reads nothing: the pump fills its pipe, stops reading the upstream, and the
        # upstream's send stalls (back-pressure reaches the server, not the proxy's memory).
        await _until(lambda: not down.reading and down.pending > 0)
        assert down.pending <= down.size <= pump.PIPE
        assert not send.done()
        got = hashlib.sha256()
        n = 0
        while n < size:  # the client reads again: everything arrives, in order
            chunk = await loop.sock_recv(kernel, 1 << 20)
            assert chunk
            got.update(chunk)
            n += len(chunk)
        await send
        assert got.digest() == hashlib.sha256(payload).digest()

    _run(1 << 40, scenario)


def test_an_idle_tunnel_is_closed() -> None:
    async def scenario(p: Pump, task: asyncio.Task[None], kernel: socket.socket, upstream: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(kernel, b"x")
        assert await loop.sock_recv(upstream, 10) == b"x"
        with pytest.raises(asyncio.CancelledError):  # no byte for the idle time: cancelled
            await task
        assert p.ways == []  # the pipes are closed, the callbacks gone

    _run(1 << 20, scenario, idle=0.3)


def test_a_tunnel_through_the_proxy_stops_at_the_byte_cap(rig: Rig, open_session) -> None:
    cap = 4 << 20
    s = open_session(max_bytes_per_session=cap)
    ctx = rig.trust_upstream()
    got = 0
    with socket.create_connection(("127.0.0.1", s.hop_port), timeout=30) as raw:
        raw.sendall(f"CONNECT secure.test:{rig.https.port} HTTP/1.1\r\nHost: secure.test\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with pytest.raises((ssl.SSLError, OSError)), ctx.wrap_socket(raw, server_hostname="secure.test") as tls:
            tls.sendall(f"GET /bytes/{16 << 20} HTTP/1.1\r\nHost: secure.test\r\n\r\n".encode())
            while chunk := tls.recv(1 << 16):
                got += len(chunk)
            raise OSError("the tunnel ended")  # a clean EOF would also do: the cut is what counts
    assert 0 < got < cap


def test_a_tunnel_through_the_proxy_is_closed_when_idle(rig: Rig, open_session) -> None:
    s = open_session(idle_timeout_seconds=0.3)
    ctx = rig.trust_upstream()
    with socket.create_connection(("127.0.0.1", s.hop_port), timeout=30) as raw:
        raw.sendall(f"CONNECT secure.test:{rig.https.port} HTTP/1.1\r\nHost: secure.test\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with ctx.wrap_socket(raw, server_hostname="secure.test", suppress_ragged_eofs=True) as tls:
            # Closed by the proxy: the socket's own 30 s timeout would raise instead of this EOF.
            assert tls.recv(100) == b""
