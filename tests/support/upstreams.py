"""Real upstream servers for the egress tests, on 127.0.0.1 only: an HTTP server and an HTTPS one
with a test CA of their own (trusted by the proxy through egress.upstream_ca_file), a WebSocket
echo server (plain or TLS), and the
loopback hop that stands in for the in-sandbox bridge (TCP on 127.0.0.1 → the session's unix
socket), so ordinary clients (httpx) can use the proxy."""

from __future__ import annotations

import asyncio
import datetime
import functools
import hashlib
import ipaddress
import json
import ssl
import threading
from collections.abc import Coroutine
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NAMES = ["plain.test", "secure.test", "secret.test", "other.test", "denied.test", "far.test"]
T = TypeVar("T")


def make_test_ca(directory: Path) -> tuple[Path, Path]:
    """A CA and a server certificate for NAMES (and 127.0.0.1); returns (ca.pem, server.pem)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName(n) for n in NAMES] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "upstream")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, server_path = directory / "upstream-ca.pem", directory / "upstream.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return ca_path, server_path


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, value: Any) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))  # type: ignore[attr-defined]
        if self.path.startswith("/bytes/"):
            n = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                self.wfile.write(chunk[:n])
                n -= len(chunk)
            return
        if self.path.endswith(".csv"):  # a small table (pandas.read_csv over egress)
            body = b"city,rain_mm\nOslo,763\nBergen,2250\nTromso,1030\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/csv")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        # Answers which header names arrived, never their values (a real API does not echo them).
        self._json({"path": self.path, "header_names": sorted(k.lower() for k in self.headers)})

    def do_POST(self) -> None:
        self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._json({"length": len(body), "sha256": hashlib.sha256(body).hexdigest()})


class _Files(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # many clients at once (bench/egress_fleet.py), not socketserver's 5


class Upstream:
    """A threaded HTTP(S) server on 127.0.0.1 that records what it received (``seen``); with
    ``files``, a static file server of that directory instead (a git repository over "dumb" HTTP)."""

    def __init__(self, tls_cert: Path | None = None, files: Path | None = None) -> None:
        handler: Any = _Handler if files is None else functools.partial(_Files, directory=str(files))
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.seen = []  # type: ignore[attr-defined]
        if tls_cert is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[tuple[str, str, dict[str, str]]]:
        return self.httpd.seen  # type: ignore[attr-defined,no-any-return]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class WebSocketEcho:
    """A WebSocket server on 127.0.0.1 (``websockets``; TLS with ``tls_cert``) that echoes each
    message and records each handshake's headers (``seen``)."""

    def __init__(self, tls_cert: Path | None = None) -> None:
        from websockets.sync.server import ServerConnection, serve

        ctx = None
        if tls_cert is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_cert)
        self.seen: list[dict[str, str]] = []

        def echo(ws: ServerConnection) -> None:
            assert ws.request is not None
            self.seen.append({k.lower(): v for k, v in ws.request.headers.raw_items()})
            for message in ws:
                ws.send(message)

        self.server = serve(echo, "127.0.0.1", 0, ssl=ctx)
        self.port = self.server.socket.getsockname()[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()


class Loop:
    """An event loop in a thread: the proxy runs there while the tests use blocking clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def start_hop(socket_path: Path) -> tuple[asyncio.AbstractServer, int]:
    """What the in-sandbox bridge does: each TCP connection to 127.0.0.1:PORT is copied to a new
    connection to the unix socket."""

    async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except (ConnectionError, OSError):
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ureader, uwriter = await asyncio.open_unix_connection(str(socket_path))
        except OSError:
            writer.close()
            return
        await asyncio.gather(copy(reader, uwriter), copy(ureader, writer))
        writer.close()
        uwriter.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]
