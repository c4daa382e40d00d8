"""The egress bridge's relay on its own (sandbox/egress_bridge.py): a real Bridge on a loopback
port of the test's, relaying to unix sockets the test makes. The sandboxed end to end is in
tests/security/test_egress_bridge.py."""

from __future__ import annotations

import hashlib
import os
import select
import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmode.sandbox import egress_bridge
from kernelmode.sandbox.egress_bridge import NO_EGRESS, NOT_ANSWERING, Bridge


@pytest.fixture()
def bridge(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """(the bridge's port, the socket path it relays to)."""
    listener = socket.create_server(("127.0.0.1", 0))
    path = tmp_path / "proxy.sock"
    threading.Thread(target=Bridge(listener, str(path)).serve_forever, daemon=True).start()
    yield listener.getsockname()[1], path


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)
        self.request.shutdown(socket.SHUT_WR)


def _echo_server(path: Path) -> socketserver.ThreadingUnixStreamServer:
    server = socketserver.ThreadingUnixStreamServer(str(path), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out


@pytest.mark.parametrize("request_head", [b"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n",
                                          b"CONNECT example.test:443 HTTP/1.1\r\n\r\n"])
def test_no_socket_is_a_403_naming_why(bridge, request_head):
    port, _ = bridge
    answer = _exchange(port, request_head)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.split(b"\r\n")[0] == f"HTTP/1.1 403 {NO_EGRESS}".encode()
    assert body == (NO_EGRESS + "\n").encode()


def test_a_refused_client_with_a_large_body_still_reads_the_answer(bridge):
    """The body is read and dropped before the bridge hangs up: closing with unread bytes would
    send a reset, and the client could lose the answer."""
    port, _ = bridge
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST http://example.test/ HTTP/1.1\r\nContent-Length: 300000\r\n\r\n" + b"x" * 300_000)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    assert answer.endswith((NO_EGRESS + "\n").encode()), answer[:200]


def test_a_socket_nobody_listens_on_is_a_503(bridge):
    port, path = bridge
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    answer = _exchange(port, b"GET http://example.test/ HTTP/1.1\r\n\r\n")
    assert answer.startswith(f"HTTP/1.1 503 {NOT_ANSWERING}".encode()), answer


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
def test_relays_both_ways_through_bounded_buffers_and_passes_the_half_close(bridge, monkeypatch, splice):
    if not splice:  # where os.splice is missing, or no pipe can be had
        monkeypatch.setattr(egress_bridge, "SPLICE", None)
    elif egress_bridge.SPLICE is None:
        pytest.skip("os.splice is Linux-only")
    port, path = bridge
    server = _echo_server(path)
    payload = os.urandom(8 << 20)  # 128 times the bridge's buffer, both ways at once
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            def send() -> None:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)  # the echo sees EOF only if the bridge passes it on

            t = threading.Thread(target=send)
            t.start()
            got = bytearray()
            while chunk := s.recv(1 << 16):
                got += chunk
            t.join()
        assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_stops_reading_holds_the_buffers_not_the_download(bridge):
    """The bridge stops reading the proxy's side once its pipe is full: the sender stalls, the
    bridge's memory does not grow with what is sent, and nothing is lost when reading resumes."""
    port, path = bridge
    size = 64 << 20
    payload = os.urandom(size)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(b"hello")
            server, _ = listener.accept()
            with server:
                assert server.recv(5) == b"hello"
                server.setblocking(False)
                sent, stalls = 0, 0
                while stalls < 20:  # the bridge stops taking bytes while the client reads none
                    try:
                        sent += server.send(memoryview(payload)[sent:sent + (1 << 20)])
                        stalls = 0
                    except BlockingIOError:
                        stalls += 1
                        select.select([], [server], [], 0.05)
                # socket buffers on both hops (a few MB on loopback) and one pipe: not the 64 MB
                assert sent < 24 << 20
                server.setblocking(True)
                t = threading.Thread(target=server.sendall, args=(memoryview(payload)[sent:],))
                t.start()
                got = hashlib.sha256()
                n = 0
                while n < size:
                    chunk = client.recv(1 << 20)
                    assert chunk
                    got.update(chunk)
                    n += len(chunk)
                t.join()
        assert got.digest() == hashlib.sha256(payload).digest()
    finally:
        listener.close()


def test_connections_beyond_the_cap_wait_in_the_backlog(bridge, monkeypatch):
    monkeypatch.setattr(egress_bridge, "MAX_CONNECTIONS", 2)
    port, path = bridge
    server = _echo_server(path)
    try:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for s in held:
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
        waiting = socket.create_connection(("127.0.0.1", port), timeout=0.5)  # in the backlog
        waiting.sendall(b"late")
        with pytest.raises(TimeoutError):
            waiting.recv(4)  # not relayed while two are open
        held[0].close()  # one closes: the waiting one is taken
        waiting.settimeout(10)
        assert waiting.recv(4) == b"late"
        for s in (held[1], waiting):
            s.close()
    finally:
        server.shutdown()
        server.server_close()


def test_the_kernel_argv_survives_its_encoding():
    argv = ["python", "-m", "ipykernel_launcher", "-f", "/d ir/ké\nrnel.json", ""]
    assert egress_bridge.decode_argv(egress_bridge.encode_argv(argv)) == argv
