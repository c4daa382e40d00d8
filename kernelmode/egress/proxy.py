"""One session's egress proxy: a unix socket that speaks HTTP proxying (absolute-form requests and
``CONNECT``) under that session's policy.

``CONNECT`` to a host without a secret rule is a tunnel: the proxy connects to an address it
checked, answers 200, reads the ClientHello and refuses unless its SNI is the host ``CONNECT``
named, then moves bytes without decrypting them (pump.py: splice, counted and capped); a tunnel
that starts with a plain HTTP request instead (``ws://`` through ``CONNECT``) is forwarded as
``http://`` to that host would be. A host with a secret rule is intercepted: TLS
is terminated with a certificate from the deployment CA, each request is forwarded (h11) with the
secret header set, over TLS verified against the system store and ``egress.upstream_ca_file``.
Plain ``http://`` requests are forwarded the same way. Every refusal is a 403 whose body says why
in one line; every connection is an audit line, a metrics sample and an entry of the run's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import h11

from ..audit import audit
from ..errors import EgressCapReached
from ..metrics import Metrics
from . import pump
from .http import (
    Upstream,
    answer,
    forward,
    new_server,
    next_event,
    next_request,
    raw_refusal,
)
from .policy import Decision, EgressPolicy, IPAddress, decide_addresses, decide_name, ip_literal
from .streams import Link, Meter, Reader, TlsStream, Writer
from .tls import Certificates, ClientHelloReader
from .usage import Usage

CONNECT_TIMEOUT = 10.0  # resolving a name, connecting to an upstream, a TLS handshake
ORIGIN_FORM = re.compile(rb"[A-Z]{3,10} /")  # the start of an origin-form HTTP request line


@dataclass
class _Record:
    """What one client connection did, for its audit line and the run's usage."""

    run_id: str | None
    started: float
    host: str | None = None
    port: int | None = None
    allowed: bool = False
    rule: str | None = None
    reason: str | None = None
    mode: str = "http"
    requests: int = 0
    error: str | None = None

    def refuse(self, rule: str | None, reason: str) -> None:
        self.allowed, self.rule, self.reason = False, rule, reason


class SessionProxy:
    """The proxy of one session, listening on ``path`` until ``close`` (None: no listener of its
    own; the TCP front hands it the connections of the session's kernels, ``serve``)."""

    def __init__(self, session_id: str, tenant: str | None, policy: EgressPolicy, path: Path | None,
                 certs: Certificates, upstream_tls: ssl.SSLContext, own: frozenset[IPAddress],
                 metrics: Metrics | None = None) -> None:
        self.session_id, self.tenant, self.policy, self.path = session_id, tenant, policy, path
        self.certs, self.upstream_tls, self.own, self.metrics = certs, upstream_tls, own, metrics
        self.meter = Meter(policy.max_bytes)
        self.usage = Usage()
        self.run_id: str | None = None
        self._open = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None

    @property
    def busy(self) -> bool:
        """Whether a connection of the session is open."""
        return self._open > 0

    async def start(self) -> None:
        assert self.path is not None
        self.path.unlink(missing_ok=True)  # a socket left by an earlier manager
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=64 * 1024)
        # The directory is this kernel's alone; the socket itself must be reachable by its uid.
        os.chmod(self.path, 0o666)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)

    # -- one client connection ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.serve(reader, writer)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    first: tuple[h11.Connection, h11.Request] | None = None) -> None:
        """One client connection under this session's policy, to its end. ``first``: its first
        request, already read by the TCP front (egress/front.py) to learn whose it is."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        link = Link(self.meter, self.policy.idle_timeout_seconds)
        link.watch(task)
        rec = _Record(self.run_id, time.monotonic())
        over = self._open >= self.policy.max_connections
        self._open += 1
        try:
            # Refused before reading anything: no buffer, no head parsing, no byte charged.
            if over:
                rec.refuse("connections", f"this session already has {self.policy.max_connections} "
                           "egress connections open (egress.max_connections_per_session)")
            elif self.meter.spent:
                rec.refuse("bytes", self._bytes_spent())
            if rec.reason is not None:
                await Link.write(writer, raw_refusal(rec.reason))
                return
            await self._handle(reader, writer, link, rec, first)
        except EgressCapReached:
            rec.error = "byte cap reached (egress.max_bytes_per_session)"
        except asyncio.CancelledError:
            if not link.idled:
                raise  # the proxy is closing
            rec.error = f"idle for {self.policy.idle_timeout_seconds:g} s"
        except (h11.ProtocolError, ssl.SSLError, OSError, TimeoutError,
                asyncio.IncompleteReadError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            link.unwatch()
            self._open -= 1
            writer.close()
            self._tasks.discard(task)
            self._finish(rec, link)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link,
                      rec: _Record, first: tuple[h11.Connection, h11.Request] | None) -> None:
        if first is not None:
            await self._dispatch(first[1], first[0], reader, writer, link, rec)
            return
        client = new_server()
        try:
            request = await next_request(client, reader, link)
        except h11.RemoteProtocolError as e:
            rec.refuse("bad_request", f"a malformed proxy request ({e})")
            with contextlib.suppress(h11.LocalProtocolError):
                await answer(client, writer, e.error_status_hint, rec.reason or "")
            return
        if request is not None:
            await self._dispatch(request, client, reader, writer, link, rec)

    async def _dispatch(self, request: h11.Request, client: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, link: Link, rec: _Record) -> None:
        if request.method == b"CONNECT":
            await self._connect(request, client, reader, writer, link, rec)
        else:
            await self._requests(request, client, reader, writer, link, rec, None)

    async def _check(self, host: str, port: int) -> Decision:
        """The decision for ``host:port``, with the addresses to connect to when allowed."""
        if self.meter.spent:
            return Decision(False, host, port, "bytes", self._bytes_spent())
        decision = decide_name(self.policy, host, port)
        if not decision.allowed or decision.addresses:
            return decision
        if decision.host in self.policy.hosts:
            resolved = [self.policy.hosts[decision.host]]
        else:
            try:
                infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                    decision.host, port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT)
            except (OSError, TimeoutError):
                infos = []
            resolved = [str(info[4][0]).partition("%")[0] for info in infos]
        return decide_addresses(self.policy, decision, resolved, self.own)

    def _bytes_spent(self) -> str:
        return (f"this session's egress byte cap ({self.policy.max_bytes} bytes, "
                "egress.max_bytes_per_session) is spent")

    async def _dial(self, decision: Decision) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to one of the checked addresses (never to the name again)."""
        error: Exception = OSError(f"{decision.host} has no address")
        for address in decision.addresses:
            try:
                return await asyncio.wait_for(asyncio.open_connection(address, decision.port, limit=64 * 1024),
                                              CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as e:
                error = e
        raise error

    async def _connect(self, request: h11.Request, client: h11.Connection, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, link: Link, rec: _Record) -> None:
        host, port = _authority(request.target.decode("latin-1"))
        rec.host, rec.port, rec.requests = host, port, 1
        rec.mode = "intercept" if self.policy.secrets_for(host) else "tunnel"
        while not isinstance(await next_event(client, reader, link, upstream=False), h11.EndOfMessage):
            pass
        if port is None:
            rec.refuse("bad_request", "CONNECT needs host:port")
            await answer(client, writer, 400, rec.reason or "")
            return
        decision = await self._check(host, port)
        rec.rule = decision.rule
        if not decision.allowed:
            rec.refuse(decision.rule, decision.reason)
            await answer(client, writer, 403, decision.reason)
            return
        try:
            ureader, uwriter = await self._dial(decision)
        except (OSError, TimeoutError) as e:
            rec.error = f"connect: {e}"[:200]
            await answer(client, writer, 502, f"cannot connect to {host}:{port} ({type(e).__name__})")
            return
        rec.allowed = True
        try:
            await Link.write(writer, client.send(h11.Response(status_code=200, headers=[],
                                                             reason=b"Connection established")) or b"")
            early, _ = client.trailing_data
            if rec.mode == "tunnel":
                await self._tunnel(bytes(early), host, reader, writer, ureader, uwriter, link, rec)
            elif not early:  # a TLS client waits for the 200 before its ClientHello
                await self._intercept(host, port, reader, writer, ureader, uwriter, link, rec)
        finally:
            uwriter.close()

    async def _tunnel(self, early: bytes, host: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      ureader: asyncio.StreamReader, uwriter: asyncio.StreamWriter, link: Link,
                      rec: _Record) -> None:
        hello, parsed, data = early, ClientHelloReader(), early
        result = parsed.feed(data) if data else None
        while result is None:
            data = await link.read(reader, upstream=False)
            if not data:
                return
            hello += data
            result = parsed.feed(data)
        is_tls, sni = result
        sni = sni.lower().rstrip(".") if sni else None
        if not is_tls and ORIGIN_FORM.match(hello):
            # Plain HTTP in the tunnel (clients send ws:// through CONNECT): forwarded request by
            # request to the host CONNECT named, as an http:// URL to it would be.
            rec.mode = "http"
            client = new_server()
            client.receive_data(hello)
            await self._requests(None, client, reader, writer, link, rec, Upstream(ureader, uwriter, (host, rec.port or 0)))
            return
        if not is_tls or sni != host and not (sni is None and ip_literal(host)):
            # The 200 is sent: all the client gets now is a closed connection (said in the audit).
            rec.refuse("sni", f"the TLS ClientHello names {sni}, not {host} as CONNECT did" if is_tls
                       else f"the tunnel to {host} did not start with a TLS ClientHello")
            return
        rec.mode = "tunnel"
        link.on_bytes = self.usage.track(rec.run_id, host, rec.port or 0)
        link.on_bytes(len(hello))
        await Link.write(uwriter, hello)
        if pump.available():
            await pump.tunnel(link, (reader, writer), (ureader, uwriter))
        else:
            await link.splice((reader, writer), (ureader, uwriter))

    async def _intercept(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         ureader: asyncio.StreamReader, uwriter: asyncio.StreamWriter, link: Link,
                         rec: _Record) -> None:
        tls = TlsStream(reader, writer, self.certs.server_context(host), server_side=True)
        await tls.handshake(CONNECT_TIMEOUT)
        client = new_server()
        request = await next_request(client, tls, link)
        if request is None:
            return
        upstream_tls = TlsStream(ureader, uwriter, self.upstream_tls, server_side=False, server_hostname=host)
        try:
            await upstream_tls.handshake(CONNECT_TIMEOUT)
        except ssl.SSLCertVerificationError as e:
            rec.error = f"upstream certificate: {e.verify_message}"
            await answer(client, tls, 502, f"the certificate of {host} did not verify ({e.verify_message})")
            return
        try:
            await self._requests(request, client, tls, tls, link, rec, Upstream(upstream_tls, upstream_tls, (host, port)))
        finally:
            tls.close()

    async def _requests(self, request: h11.Request | None, client: h11.Connection, reader: Reader,
                        writer: Writer, link: Link, rec: _Record, fixed: Upstream | None) -> None:
        """Forward requests until the client or an upstream ends the connection. ``fixed``: the
        intercepted host's upstream (origin-form targets); else absolute ``http://`` targets."""
        upstream = fixed
        try:
            while True:
                if request is None:
                    request = await next_request(client, reader, link)
                    if request is None:
                        return
                if fixed is not None:
                    (host, port), target = fixed.key, request.target
                else:
                    parsed = _absolute(request.target.decode("latin-1"))
                    if parsed is None:
                        rec.refuse("bad_request", "send http:// URLs in absolute form, and https:// "
                                   "through CONNECT (set HTTP_PROXY/HTTPS_PROXY)")
                        await answer(client, writer, 400, rec.reason or "")
                        return
                    host, port, target = parsed
                    if rec.host is None:
                        rec.host, rec.port = host, port
                    decision = await self._check(host, port)
                    rec.rule = decision.rule
                    if not decision.allowed:
                        rec.refuse(decision.rule, decision.reason)
                        await answer(client, writer, 403, decision.reason)
                        return
                    rec.allowed = True
                    if upstream is None or upstream.closed or upstream.key != (host, port):
                        if upstream is not None:
                            upstream.close()
                        upstream = Upstream(*await self._dial(decision), (host, port))
                if upstream is None or upstream.closed:
                    return
                before = link.up + link.down
                host_header = host.encode() if port in (80, 443) else f"{host}:{port}".encode()
                secrets = [(s.header.lower().encode(), s.value.encode()) for s in self.policy.secrets_for(host)]
                exchange = await forward(request, target, host_header, secrets, client, reader, writer,
                                         upstream, link)
                rec.requests += 1
                self.usage.add(rec.run_id, host, port, True, 1, link.up + link.down - before)
                audit("egress_request", tenant=self.tenant, session_id=self.session_id, run_id=rec.run_id,
                      host=host, port=port, mode=rec.mode, method=exchange.method, path=exchange.path,
                      status=exchange.status, bytes=link.up + link.down - before)
                if not exchange.keep_alive:
                    return
                client.start_next_cycle()
                request = None
        finally:
            if upstream is not None and upstream is not fixed:
                upstream.close()

    def _finish(self, rec: _Record, link: Link) -> None:
        decision = "allowed" if rec.allowed else "refused"
        if rec.host is not None and rec.port is not None and not rec.allowed:
            self.usage.add(rec.run_id, rec.host, rec.port, False, 1, link.up + link.down)
        audit("egress", tenant=self.tenant, session_id=self.session_id, run_id=rec.run_id, host=rec.host,
              port=rec.port, decision=decision, rule=rec.rule, mode=rec.mode, reason=rec.reason,
              error=rec.error, requests=rec.requests, bytes_up=link.up, bytes_down=link.down,
              duration_ms=round((time.monotonic() - rec.started) * 1000, 1))
        if self.metrics is not None:
            self.metrics.egress_connections.labels(decision).inc()
            if link.up + link.down:
                self.metrics.egress_bytes.inc(link.up + link.down)


def _authority(target: str) -> tuple[str, int | None]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return target.lower(), None
    return host.strip("[]").lower().rstrip("."), int(port)


def _absolute(target: str) -> tuple[str, int, bytes] | None:
    """``(host, port, origin-form target)`` of an absolute ``http://`` URL, else None."""
    try:
        url = urlsplit(target)
        port = url.port or 80
    except ValueError:
        return None
    if url.scheme.lower() != "http" or not url.hostname:
        return None
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return url.hostname.lower().rstrip("."), port, path.encode("latin-1")
