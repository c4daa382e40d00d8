"""A load balancer stand-in: each HTTP request and each websocket goes to the next of the
managers' URLs in turn (round robin, no stickiness), as a Kubernetes Service or a plain reverse
proxy would send them. Bodies are passed as they are, answers streamed back as they come (an MCP
event stream included); a websocket is passed frame by frame. Runs in a thread of its own.

    with RoundRobin([m0.url, m1.url, m2.url]) as lb:
        httpx.get(lb.url + "/healthz")
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from tornado import httpclient, httputil, web, websocket
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "te", "trailer",
        "content-length", "date", "server"}
_WS_HOP = _HOP | {"origin", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                  "sec-websocket-protocol"}


class _Pick:
    def __init__(self, urls: list[str]) -> None:
        self._next = itertools.cycle(urls)
        self.lock = threading.Lock()
        self.sent: list[str] = []  # which upstream each request went to, in order

    def __call__(self) -> str:
        with self.lock:
            url = next(self._next)
            self.sent.append(url)
            return url


class _Http(web.RequestHandler):
    """Any request: to the next manager; its status, headers and body back, streamed."""

    SUPPORTED_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD")

    def initialize(self, pick: _Pick) -> None:
        self.pick = pick

    def set_default_headers(self) -> None:
        self.clear_header("Content-Type")

    async def _proxy(self, *_: Any) -> None:
        req = self.request
        headers = httputil.HTTPHeaders()
        for k, v in req.headers.get_all():
            if k.lower() not in _HOP:
                headers.add(k, v)
        started = False
        got = httputil.HTTPHeaders()

        def header_line(line: str) -> None:
            nonlocal started
            if line.startswith("HTTP/"):
                parsed = httputil.parse_response_start_line(line.strip())
                self.set_status(parsed.code, parsed.reason)
            elif line.strip():
                got.parse_line(line)
            elif not started:  # the blank line: the headers are complete
                started = True
                for k, v in got.get_all():
                    if k.lower() not in _HOP:
                        self.add_header(k, v)

        def chunk(data: bytes) -> None:
            self.write(data)
            asyncio.ensure_future(self.flush())

        body = req.body if req.method in ("POST", "PUT", "PATCH") else None
        try:
            await httpclient.AsyncHTTPClient().fetch(
                self.pick() + req.uri, method=req.method, headers=headers, body=body,
                allow_nonstandard_methods=True, follow_redirects=False, decompress_response=False,
                header_callback=header_line, streaming_callback=chunk, raise_error=False,
                connect_timeout=10, request_timeout=600)
        except (OSError, httpclient.HTTPClientError) as e:  # the balancer's own answer: no manager there
            if started:  # the manager died mid-answer: the client sees the connection break
                self.request.connection.close()  # type: ignore[union-attr]
                return
            self.set_status(502)
            self.finish(f"balancer: upstream unreachable: {e}")
            return
        self.finish()

    get = post = put = delete = patch = head = _proxy


class _Ws(websocket.WebSocketHandler):
    """A websocket: to the next manager, frame by frame, closed together."""

    upstream: websocket.WebSocketClientConnection | None = None

    def initialize(self, pick: _Pick) -> None:
        self.pick = pick

    async def get(self, *args: Any, **kwargs: Any) -> None:
        req = self.request
        headers = {k: v for k, v in req.headers.get_all() if k.lower() not in _WS_HOP}
        offered = [p.strip() for p in req.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        url = "ws" + self.pick().removeprefix("http") + req.uri
        try:
            self.upstream = await websocket.websocket_connect(
                httpclient.HTTPRequest(url, headers=headers), subprotocols=offered or None, max_message_size=1 << 30)
        except httpclient.HTTPClientError as e:
            self.set_status(e.code)
            self.finish(e.response.body if e.response is not None and e.response.body else b"")
            return
        await super().get(*args, **kwargs)

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        return self.upstream.selected_subprotocol if self.upstream is not None else None

    def open(self, *args: Any, **kwargs: Any) -> None:
        asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        assert self.upstream is not None
        while (msg := await self.upstream.read_message()) is not None:
            try:
                await self.write_message(msg, binary=isinstance(msg, bytes))
            except websocket.WebSocketClosedError:
                break
        self.close(self.upstream.close_code or 1000, self.upstream.close_reason)

    async def on_message(self, message: str | bytes) -> None:
        if self.upstream is not None:
            await self.upstream.write_message(message, binary=isinstance(message, bytes))

    def on_close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()


class RoundRobin:
    """The balancer on a free local port (``url``); ``sent`` lists each request's upstream."""

    def __init__(self, urls: list[str]) -> None:
        self.pick = _Pick(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="round-robin")
        self._server: HTTPServer | None = None
        self.url = ""

    @property
    def sent(self) -> list[str]:
        return self.pick.sent

    async def _start(self) -> None:
        # Tornado's client queues beyond 10 requests at a time by default: a balancer does not.
        httpclient.AsyncHTTPClient(max_clients=1000)
        app = web.Application([
            (r".*/channels", _Ws, {"pick": self.pick}),
            (r".*", _Http, {"pick": self.pick}),
        ])
        self._server = HTTPServer(app, max_body_size=1 << 30)
        socks = bind_sockets(0, "127.0.0.1")
        self._server.add_sockets(socks)
        self.url = f"http://127.0.0.1:{socks[0].getsockname()[1]}"

    def __enter__(self) -> RoundRobin:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
