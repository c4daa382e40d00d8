"""A stand-in for the manager's egress proxy: an HTTP proxy-speaking server on a unix socket,
started by a test in a kernel's egress dir (``proxy.sock``).

It answers every request (absolute-form, as clients send to a proxy) with a fixed body and
records its request line, headers and body; a ``CONNECT`` gets ``200`` and then an echo of the
tunnel's bytes until the client half-closes, which proves bytes both ways and the half-close.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from kernelmode.sandbox import egress


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: UnixProxy

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body_in = self.rfile.read(n) if n else b""
        self.server.requests.append({"line": self.requestline, "headers": dict(self.headers), "body": body_in})
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def do_CONNECT(self) -> None:
        self.server.requests.append({"line": self.requestline, "headers": dict(self.headers), "body": b""})
        self.send_response(200, "Connection established")
        self.end_headers()
        while data := self.rfile.read1(65536):  # read1: bytes already buffered with the head first
            self.wfile.write(data)
        self.connection.shutdown(socket.SHUT_WR)
        self.close_connection = True

    def address_string(self) -> str:
        return "unix"  # a unix socket's peer has no host to name

    def log_message(self, format: str, *args: Any) -> None:
        pass


class UnixProxy(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, body: bytes = b"hello from the egress proxy") -> None:
        self.path = path
        self.body = body
        self.requests: list[dict[str, Any]] = []
        super().__init__(str(path), _Handler)
        egress.grant(path)  # as the real proxy does: the kernel's uid may connect
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> UnixProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
