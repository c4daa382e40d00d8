"""HTTP/1.1 for the egress proxy, with h11 doing all the parsing and framing: read a client's
request head, answer a refusal, and forward one request and its response between a client and an
upstream (adding the secret headers on the way out).

``Expect: 100-continue`` is answered by the proxy itself (as nginx does): the client gets its
``100 Continue`` at once and the upstream the whole body without the expectation. An
``Upgrade`` (a WebSocket over ``ws://``, or ``wss://`` to an intercepted host) is forwarded with
its headers; when the upstream answers ``101`` the connection becomes a byte pipe both ways,
still counted against the session's byte cap and idle timeout."""

from __future__ import annotations

from dataclasses import dataclass

import h11

from .streams import CHUNK, Link, Reader, Writer

HEAD_LIMIT = 64 * 1024  # a request or response head larger than this is refused
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
                        b"proxy-authenticate", b"te", b"trailer", b"upgrade"})
SERVER = b"kernelmode-egress"


def new_server() -> h11.Connection:
    return h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)


async def next_event(conn: h11.Connection, reader: Reader, link: Link, *,
                     upstream: bool) -> h11.Event:
    """The next h11 event of ``conn``, reading as needed (charged to ``link``)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await link.read(reader, upstream=upstream))
            continue
        if event is h11.PAUSED:
            raise h11.RemoteProtocolError("pipelined data after a protocol switch", 400)
        return event  # type: ignore[return-value]


async def next_request(conn: h11.Connection, reader: Reader, link: Link) -> h11.Request | None:
    """The client's next request head, or None when it closed between requests."""
    event = await next_event(conn, reader, link, upstream=False)
    if isinstance(event, h11.ConnectionClosed):
        return None
    if not isinstance(event, h11.Request):
        raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}", 400)
    return event


async def answer(conn: h11.Connection, writer: Writer, status: int, text: str,
                 *, close: bool = True, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """A plain-text answer from the proxy itself (a refusal, a failed upstream)."""
    body = f"kernelmode: {text}\n".encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               (b"server", SERVER), *extra] + ([(b"connection", b"close")] if close else [])
    data = conn.send(h11.Response(status_code=status, headers=headers, reason=reason_phrase(text)))
    data = (data or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await Link.write(writer, data)


def reason_phrase(text: str) -> bytes:
    """The status line says why too: http.client shows only the status line of a refused
    ``CONNECT`` (requests' ProxyError, pip, git), and urllib's HTTPError its reason, not the body."""
    line = " ".join(f"kernelmode: {text}".split())[:300]
    return line.encode("ascii", "replace")


def raw_refusal(text: str) -> bytes:
    """A 403 sent before any request was read (the connection cap): h11 answers only requests."""
    body = f"kernelmode: {text}\n".encode()
    return (b"HTTP/1.1 403 " + reason_phrase(text) + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def upgrade_of(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``Connection: upgrade`` and the ``Upgrade`` header of a message that asks to switch
    protocols (what a proxy passes on for it), else []."""
    named = {v.strip().lower() for k, v in headers if k == b"connection" for v in v.split(b",")}
    upgrade = [(k, v) for k, v in headers if k == b"upgrade"]
    return [(b"connection", b"upgrade"), *upgrade] if upgrade and b"upgrade" in named else []


def forwarded_headers(headers: list[tuple[bytes, bytes]], host: bytes,
                      secrets: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers without hop-by-hop ones (and those its Connection header names) or
    a 100-continue expectation (the proxy answers it), with ``Host`` set, each secret header
    added or replacing the client's, and an upgrade passed on."""
    named = {v.strip().lower() for k, v in headers if k == b"connection" for v in v.split(b",")}
    replaced = {name.lower() for name, _ in secrets} | {b"host"}
    kept = [(k, v) for k, v in headers if k not in HOP_BY_HOP and k not in named and k not in replaced
            and not (k == b"expect" and v.strip().lower() == b"100-continue")]
    return [(b"host", host), *kept, *secrets, *upgrade_of(headers)]


def response_headers(headers: list[tuple[bytes, bytes]], *, switching: bool = False) -> list[tuple[bytes, bytes]]:
    named = {v.strip().lower() for k, v in headers if k == b"connection" for v in v.split(b",")}
    kept = [(k, v) for k, v in headers if k not in HOP_BY_HOP and k not in named]
    return kept + upgrade_of(headers) if switching else kept


@dataclass
class Exchange:
    method: str
    path: str
    status: int = 0
    keep_alive: bool = True


class Upstream:
    """One upstream connection, reused for the client's next requests to the same host."""

    def __init__(self, reader: Reader, writer: Writer, key: tuple[str, int]) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.writer.close()


async def forward(request: h11.Request, target: bytes, host_header: bytes,
                  secrets: list[tuple[bytes, bytes]], client: h11.Connection,
                  creader: Reader, cwriter: Writer,
                  up: Upstream, link: Link) -> Exchange:
    """One request to ``up`` (its body streamed) and its response back to the client."""
    ex = Exchange(request.method.decode("latin-1"), target.decode("latin-1")[:300])
    out = h11.Request(method=request.method, target=target, http_version=b"1.1",
                      headers=forwarded_headers(list(request.headers), host_header, secrets))
    await Link.write(up.writer, up.conn.send(out) or b"")
    if client.they_are_waiting_for_100_continue:
        await Link.write(cwriter, client.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")) or b"")
    while True:  # the request body, CHUNK at a time
        event = await next_event(client, creader, link, upstream=False)
        if isinstance(event, h11.Data):
            await Link.write(up.writer, up.conn.send(h11.Data(data=bytes(event.data))) or b"")
        elif isinstance(event, h11.EndOfMessage):
            await Link.write(up.writer, up.conn.send(h11.EndOfMessage(headers=list(event.headers))) or b"")
            break
        else:
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a request body", 400)
    while True:  # the response head (1xx first; a 101 switches to a byte pipe)
        event = await next_event(up.conn, up.reader, link, upstream=True)
        if isinstance(event, h11.InformationalResponse):
            if event.status_code == 101:  # h11 accepts one only when the request proposed it
                ex.status, ex.keep_alive = 101, False
                await switch(event, client, creader, cwriter, up, link)
                return ex
            if event.status_code not in (100, 101):  # the 100 was the proxy's to send
                await Link.write(cwriter, client.send(event) or b"")
            continue
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError(f"upstream sent {type(event).__name__}")
        ex.status = event.status_code
        await Link.write(cwriter, client.send(h11.Response(
            status_code=event.status_code, headers=response_headers(list(event.headers)),
            reason=event.reason)) or b"")
        break
    while True:  # the response body, streamed
        event = await next_event(up.conn, up.reader, link, upstream=True)
        if isinstance(event, h11.Data):
            await Link.write(cwriter, client.send(h11.Data(data=bytes(event.data))) or b"")
        elif isinstance(event, h11.EndOfMessage):
            await Link.write(cwriter, client.send(h11.EndOfMessage(headers=list(event.headers))) or b"")
            break
        elif isinstance(event, h11.ConnectionClosed):
            raise h11.RemoteProtocolError("upstream closed mid-response")
    ex.keep_alive = client.our_state is h11.DONE and client.their_state is h11.DONE
    if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
        up.conn.start_next_cycle()
    else:
        up.close()
        ex.keep_alive = False
    return ex


async def switch(response: h11.InformationalResponse, client: h11.Connection, creader: Reader,
                 cwriter: Writer, up: Upstream, link: Link) -> None:
    """The upstream accepted the upgrade: the client gets the 101, then bytes flow both ways
    (what either side sent past the handshake first) until both ends close."""
    if client.their_state is not h11.MIGHT_SWITCH_PROTOCOL:  # the client asked for no switch (h11 would refuse the 101)
        raise h11.RemoteProtocolError("upstream switched protocols unasked")
    await Link.write(cwriter, client.send(h11.InformationalResponse(
        status_code=101, headers=response_headers(list(response.headers), switching=True),
        reason=response.reason)) or b"")
    await Link.write(up.writer, client.trailing_data[0])
    await Link.write(cwriter, up.conn.trailing_data[0])
    up.closed = True  # not reusable: it speaks another protocol now
    await link.splice((creader, cwriter), (up.reader, up.writer))


__all__ = ["CHUNK", "Exchange", "Upstream", "answer", "forward", "new_server",
           "next_request", "raw_refusal"]
