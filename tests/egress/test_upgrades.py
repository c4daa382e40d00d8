"""What large uploads and WebSockets need from the proxy, with real clients (curl, websockets)
against real upstreams: ``Expect: 100-continue`` answered, ``wss://`` tunnelled or intercepted
(the secret header on the upgrade request), ``ws://`` through ``CONNECT`` and in absolute form."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.sync.client import connect

from tests.support.upstreams import WebSocketEcho

from .conftest import SECRET, Rig


@pytest.fixture(scope="module")
def echoes(rig: Rig) -> Iterator[tuple[WebSocketEcho, WebSocketEcho]]:
    """(ws://, wss://) echo servers on 127.0.0.1, the second with the upstream test CA."""
    plain, tls = WebSocketEcho(), WebSocketEcho(rig.root / "upstream.pem")
    yield plain, tls
    plain.stop()
    tls.stop()


def _session(rig: Rig, open_session, echoes: tuple[WebSocketEcho, WebSocketEcho]):
    plain, tls = echoes
    return open_session(allow=[*rig.settings.allow, f"plain.test:{plain.port}", f"secure.test:{tls.port}",
                               f"secret.test:{tls.port}"])


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.parametrize("scheme", ["http", "https"], ids=["forwarded", "intercepted"])
def test_a_large_post_with_expect_100_continue(rig: Rig, open_session, tmp_path: Path, scheme: str) -> None:
    """curl asks for a 100 before a large body and, told to, waits for it: the proxy answers it
    (a proxy that only read the body would stall the upload until curl's own timeout)."""
    s = open_session()
    body = os.urandom(4 << 20)
    (tmp_path / "body").write_bytes(body)
    host, port = ("plain.test", rig.http.port) if scheme == "http" else ("secret.test", rig.https.port)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    out = subprocess.run(
        ["curl", "-sS", "-v", "--fail", "--proxy", s.proxy, "--cacert", str(s.egress_dir / "ca-bundle.pem"),
         "-H", "Expect: 100-continue", "--expect100-timeout", "600", "--data-binary", f"@{tmp_path / 'body'}",
         f"{scheme}://{host}:{port}/upload"],
        capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "< HTTP/1.1 100 Continue" in out.stderr
    assert json.loads(out.stdout) == {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    method, path, headers = rig.http.seen[-1] if scheme == "http" else rig.https.seen[-1]
    assert (method, path) == ("POST", "/upload") and "expect" not in headers
    if scheme == "https":
        assert headers["authorization"] == SECRET


def test_wss_is_tunnelled(rig: Rig, open_session, echoes) -> None:
    s = _session(rig, open_session, echoes)
    _, tls = echoes
    with connect(f"wss://secure.test:{tls.port}/chat", proxy=s.proxy, ssl=rig.trust_upstream(),
                 additional_headers={"Authorization": "mine"}, open_timeout=30) as ws:
        for message in ("hello", "x" * 200_000, b"\x00\x01binary"):
            ws.send(message)
            assert ws.recv(timeout=30) == message
    assert tls.seen[-1]["authorization"] == "mine"  # end to end: not decrypted, nothing added


def test_wss_to_an_intercepted_host_carries_the_secret(rig: Rig, open_session, echoes) -> None:
    s = _session(rig, open_session, echoes)
    _, tls = echoes
    with connect(f"wss://secret.test:{tls.port}/chat", proxy=s.proxy, ssl=rig.trust_bundle(s),
                 additional_headers={"Authorization": "Bearer forged-by-kernel"}, open_timeout=30) as ws:
        ws.send("through the interception")
        assert ws.recv(timeout=30) == "through the interception"
    assert tls.seen[-1]["authorization"] == SECRET


def test_ws_through_connect(rig: Rig, open_session, echoes) -> None:
    """websockets (like browsers) sends even ws:// through CONNECT: a plain HTTP request in the
    tunnel is forwarded to the host CONNECT named."""
    s = _session(rig, open_session, echoes)
    plain, _ = echoes
    with connect(f"ws://plain.test:{plain.port}/chat", proxy=s.proxy, open_timeout=30) as ws:
        ws.send("plain")
        assert ws.recv(timeout=30) == "plain"
    assert plain.seen[-1]["host"] == f"plain.test:{plain.port}"


def _frame(payload: bytes) -> bytes:
    """A masked text frame (a client's), payload under 126 bytes."""
    mask = os.urandom(4)
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_ws_in_absolute_form_switches_to_a_byte_pipe(rig: Rig, open_session, echoes) -> None:
    s = _session(rig, open_session, echoes)
    plain, _ = echoes
    key = base64.b64encode(os.urandom(16))
    with socket.create_connection(("127.0.0.1", s.hop_port), timeout=30) as raw:
        raw.sendall(f"GET http://plain.test:{plain.port}/chat HTTP/1.1\r\nHost: plain.test\r\n"
                    "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n".encode()
                    + b"Sec-WebSocket-Key: " + key + b"\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += raw.recv(4096)
        head, rest = head.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        assert b"sec-websocket-accept: " + accept in head.lower().replace(accept.lower(), accept)
        raw.sendall(_frame(b"hello over ws://"))
        while len(rest) < 2 + len(b"hello over ws://"):
            rest += raw.recv(4096)
        assert rest == bytes([0x81, len(b"hello over ws://")]) + b"hello over ws://"  # the echo, unmasked


def test_a_tunnel_that_is_neither_tls_nor_http_is_refused(rig: Rig, open_session) -> None:
    s = open_session()
    before = len(rig.https.seen)
    with socket.create_connection(("127.0.0.1", s.hop_port), timeout=30) as raw:
        raw.sendall(f"CONNECT secure.test:{rig.https.port} HTTP/1.1\r\nHost: secure.test\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        raw.sendall(b"SSH-2.0-OpenSSH_9.0\r\n")
        assert raw.recv(4096) == b""  # closed, nothing relayed
    assert len(rig.https.seen) == before
