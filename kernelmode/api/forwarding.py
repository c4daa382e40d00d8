"""Requests for a session another manager owns are forwarded to it (docs/scaling.md "Routing
between managers").

Several managers share one store; each session is owned by one of them at a time (a lease,
sessions/ownership.py), and only its owner holds the kernel's connection, the runs in flight and
the pending approvals. A request that reaches another manager (a round-robin load balancer) is
passed on to the owner as it came, body and answer streamed through without being held whole:
headers and status are the owner's. The owner checks the bearer token itself (every manager has
the same tokens and tenants): nothing the forwarding manager learned is sent as an identity.

A forwarded request carries ``FORWARDED_HEADER`` and is never forwarded again: if it reaches a
manager that is not the owner (the lease moved meanwhile) it is answered 503 ``session_owned_elsewhere`` and
the client sends it again. An owner that does not take the connection is answered 503
``manager_gone`` with a Retry-After of the lease bound: by then another manager has adopted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import TYPE_CHECKING, Any, Protocol

from tornado import web
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..errors import ManagerGone, ServerBusy, SessionOwnedElsewhere
from ..sessions.runs import TAG_CHARS, run_tag

if TYPE_CHECKING:
    import httpx

    from ..sessions import SessionManager
    from ..sessions.store import SessionStore


class _Lazy:
    """A module imported at the first use of one of its names, after which the module's global
    is the module itself."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.name)
        globals()[self.name] = module
        return getattr(module, attr)


if not TYPE_CHECKING:
    # httpx (~40 ms of imports) comes at the first forwarding: only several managers forward, and
    # every start (the embedded `kernelmode mcp` at each launch of its host) would pay for it.
    httpx = _Lazy("httpx")

log = logging.getLogger("kernelmode.api")

# Set on every forwarded request (to the forwarding manager's id): its receiver never forwards it.
# A client that sends it itself only keeps its own request from being forwarded.
FORWARDED_HEADER = "X-Kernelmode-Forwarded-By"
# Per connection, not end to end (RFC 9110 7.6.1): never passed on; Host is the owner's.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade", "host", "date", "server"})
CONNECT_SECONDS = 5.0  # an owner on another host that does not answer a SYN is as gone as a refusal
OWNER_CACHE_SECONDS = 1.0  # how long a session's owner, read from the store, is taken as known
_OWNERS_KEPT = 10_000


class Ownership(Protocol):
    """What routing needs of sessions/ownership.py's Ownership."""

    manager_id: str

    def owner_url(self, session_id: str) -> str | None: ...


class Router:
    """Which manager serves a request: None means this one (the session is live here, nobody
    holds it, or this manager does), else the owner's base URL. A session live here costs no
    store call; only ids this manager does not hold ask the store."""

    def __init__(self, sessions: SessionManager, store: SessionStore, ownership: Ownership,
                 lease_seconds: float, max_connections: int = 256) -> None:
        self.sessions = sessions
        self.store = store
        self.ownership = ownership
        self.lease_seconds = lease_seconds
        self.forwarder = Forwarder(ownership.manager_id, max_connections)
        self._owners: dict[str, tuple[str, float]] = {}  # session id -> (owner's URL, until)

    @property
    def manager_id(self) -> str:
        return self.ownership.manager_id

    def for_session(self, session_id: str, forwarded: bool) -> str | None:
        if self.sessions.peek(session_id) is not None:
            return None
        url = self._owner_url(session_id)
        if url is not None and forwarded:
            raise SessionOwnedElsewhere(f"session {session_id!r} is owned by the manager at {url} (it changed "
                                        "hands while this request was forwarded): send it again")
        return url

    def _owner_url(self, session_id: str) -> str | None:
        """``owner_url``, remembered for ``OWNER_CACHE_SECONDS``: a client behind a balancer sends
        a session's requests through the same non-owner again and again, and the store read (a
        round trip to PostgreSQL on the event loop) was the largest part of a forwarding's cost.
        Stale for that long at most: a lease that moved meanwhile gets 503
        ``session_owned_elsewhere`` from the old owner (retried), a dead one ``manager_gone``
        (which forgets it at once)."""
        now = time.monotonic()
        hit = self._owners.get(session_id)
        if hit is not None and hit[1] > now:
            return hit[0]
        url = self.ownership.owner_url(session_id)
        if url is None:
            self._owners.pop(session_id, None)
            return None
        if len(self._owners) >= _OWNERS_KEPT:
            self._owners.clear()
        self._owners[session_id] = (url, now + OWNER_CACHE_SECONDS)
        return url

    def for_run(self, run_id: str, forwarded: bool) -> str | None:
        """A run in flight is its owner's; a finished one is in the store, which any manager reads."""
        live = self.sessions.runner.runs.get(run_id)
        if live is not None and not live.stored:
            return None
        stored = self.store.get_run(run_id)
        if stored is None or stored.status not in ("running", "awaiting_approval"):
            return None
        return self.for_session(stored.session_id, forwarded)

    def find_run(self, run_id: str) -> str | None:
        """A run that neither this manager nor the store knows may be queued (or waiting for the
        code policy's approval, or failed before it started) on the manager that took it, not
        yet written: its id names that manager (sessions/runs.py ``run_tag``), the one it is
        forwarded to if it is another live one. Any other id is nobody's: no other manager is
        asked (a made-up id costs one store read here, never a request per manager)."""
        tag = run_id[:TAG_CHARS]
        if len(tag) < TAG_CHARS or tag == run_tag(self.manager_id):
            return None
        named = [url for mid, url in self.store.managers.live().items()
                 if mid != self.manager_id and run_tag(mid) == tag]
        return named[0] if named else None

    def for_kernel(self, kernel_id: str, forwarded: bool) -> str | None:
        """A Jupyter kernel id is its session's id as a UUID (api/jupyter_api.py ``kernel_id_of``);
        ids derived from a session id that is not 32 hex digits are served here."""
        try:
            session_id = uuid.UUID(kernel_id).hex
        except ValueError:
            return None
        return self.for_session(session_id, forwarded)

    def for_mcp(self, mcp_session_id: str) -> str | None:
        """The manager whose SDK holds this MCP connection, if it is another live one."""
        manager = self.store.mcp_session_manager(mcp_session_id)
        if manager is None or manager == self.manager_id:
            return None
        return self.store.managers.live().get(manager)  # None: it is dead (the SDK's 404 here)

    def record_mcp(self, mcp_session_id: str) -> None:
        self.store.record_mcp_session(mcp_session_id, self.manager_id)

    def forget_mcp(self, mcp_session_id: str) -> None:
        self.store.forget_mcp_session(mcp_session_id)

    def gone(self, url: str, error: Exception, method: str = "GET") -> ManagerGone:
        """The answer when the manager at ``url`` does not answer (it is forgotten as an owner).
        A request that changes something and broke off after it was sent (not a refused or
        timed-out connect) may have been carried out there: the text says to look first, since
        sending a run again would run its code twice."""
        for sid in [k for k, (u, _) in self._owners.items() if u.rstrip("/") == url.rstrip("/")]:
            del self._owners[sid]
        lease = self.lease_seconds
        head = (f"the session's manager ({url}) does not answer ({type(error).__name__}): it is gone, and "
                f"another manager takes the session over within {lease:g} s (its lease)")
        if method.upper() in ("GET", "HEAD", "OPTIONS") or isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ManagerGone(f"{head}: send the request again then", details={"retry_after_seconds": lease})
        return ManagerGone(
            f"{head}. The request reached it and may have been carried out before it went (a run then "
            "ends 'interrupted'): after that time, look before sending it again (the session's history: "
            "GET /v1/sessions/{id}/notebook; or its variables and files) so that nothing runs twice",
            details={"retry_after_seconds": lease, "maybe_done": True})


class Forwarder:
    """One HTTP client (its connections kept alive) to the other managers, with at most
    ``max_connections`` requests through it at once: one more is refused at once (503
    ``server_busy``) rather than queued for a connection without end."""

    def __init__(self, manager_id: str, max_connections: int = 256) -> None:
        self.manager_id = manager_id
        self.max_connections = max_connections
        self.in_use = 0
        # One request holds one connection until its answer is closed, and a slot for as long:
        # the pool never waits (its timeout is a backstop, answered like a full gate).
        timeout = httpx.Timeout(None, connect=CONNECT_SECONDS, pool=CONNECT_SECONDS)
        self.extensions = {"timeout": timeout.as_dict()}  # what build_request would give a request
        self.client = httpx.AsyncClient(
            timeout=timeout, follow_redirects=False,
            # A jar that keeps nothing: one caller's cookies must never ride on another's request.
            cookies=httpx.Cookies(CookieJar(DefaultCookiePolicy(allowed_domains=[]))),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=min(64, max_connections)))

    def take(self) -> None:
        """A slot for one request to another manager, or ServerBusy when all are in use."""
        if self.in_use >= self.max_connections:
            raise self.busy()
        self.in_use += 1

    def give(self) -> None:
        self.in_use -= 1

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        self.take()
        try:
            yield
        finally:
            self.give()

    def busy(self, waited: bool = False) -> ServerBusy:
        """``waited``: no pooled connection came free in time (the backstop; the slots should
        have said so first)."""
        why = (f"no connection to the session's manager came free within {CONNECT_SECONDS:g} s" if waited else
               f"this manager is passing {self.in_use} requests on to the managers that own their sessions")
        return ServerBusy(f"{why}, its limit (server.forward_max_connections): send the request again in a moment",
                          details={"retry_after_seconds": 1})

    async def close(self) -> None:
        await self.client.aclose()


def request_headers(handler: web.RequestHandler, manager_id: str) -> list[tuple[str, str]]:
    """The client's headers as the owner gets them (Authorization included: the owner checks it)."""
    headers = [(k, v) for k, v in handler.request.headers.get_all() if k.lower() not in HOP_BY_HOP]
    return [*headers, (FORWARDED_HEADER, manager_id)]


class Relay:
    """One request passed on to the owner: its body streamed as it arrives (``feed``, with
    backpressure), the owner's answer streamed back (``answer``)."""

    def __init__(self, handler: web.RequestHandler, router: Router, base_url: str,
                 body: bytes | None = None) -> None:
        """``body``: a body already read whole (a create's, small); else it streams in (``feed``)."""
        self.handler = handler
        self.router = router
        self.base_url = base_url.rstrip("/")
        req = handler.request
        self.has_body = body is None and bool(
            req.headers.get("Content-Length", "0") not in ("", "0")
            or "chunked" in req.headers.get("Transfer-Encoding", "").lower())
        router.forwarder.take()  # ServerBusy (503) at once when this manager forwards its most
        self._slot, self._answering = True, False
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=8)
        self._client_gone = asyncio.Event()
        url = f"{self.base_url}{req.uri}"
        # Built as it is, not through the client's build_request: no base URL, default headers or
        # cookies to merge (a fifth of a forwarding's CPU went to those merges).
        self._request = httpx.Request(
            req.method or "GET", url, headers=request_headers(handler, router.manager_id),
            content=self._body() if self.has_body else body, extensions=router.forwarder.extensions)
        self._response: asyncio.Task[httpx.Response] = asyncio.create_task(
            router.forwarder.client.send(self._request, stream=True))
        self._response.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved in answer

    async def _body(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk

    async def feed(self, chunk: bytes | None) -> None:
        """The next piece of the body (None: its end), at the pace the owner reads it; dropped
        once the owner has answered (early: a refusal reads no more)."""
        if self._response.done():
            return
        put = asyncio.ensure_future(self._chunks.put(chunk))
        await asyncio.wait({put, self._response}, return_when=asyncio.FIRST_COMPLETED)
        put.cancel()

    def _release(self) -> None:
        if self._slot:
            self._slot = False
            self.router.forwarder.give()

    async def answer(self) -> None:
        """Wait for the owner's answer and stream it to the client (called once the body is in)."""
        self._answering = True
        try:
            await self._answer()
        finally:
            self._release()

    async def _answer(self) -> None:
        h = self.handler
        if self.has_body:
            await self.feed(None)
        try:
            response = await self._response
        except httpx.PoolTimeout as e:  # the gate should have said so: answered alike
            raise self.router.forwarder.busy(waited=True) from e
        except httpx.HTTPError as e:  # refused or timed out; or it broke off (then it may have acted)
            log.warning("forwarding %s %s to %s broke off: %s", h.request.method, h.request.path, self.base_url, e)
            raise self.router.gone(self.base_url, e, h.request.method) from e
        # Streamed in a task of its own, so that a client that hangs up ends it at once (an event
        # stream of the owner's may stay silent for long).
        pump = asyncio.create_task(self._stream(response))
        gone = asyncio.create_task(self._client_gone.wait())
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not pump.done():
                pump.cancel()
            await asyncio.wait({pump})
            await response.aclose()
        if pump.cancelled() or not pump.result():
            with contextlib.suppress(Exception):
                h.request.connection.close()  # type: ignore[union-attr]
            return
        h.finish()

    async def _stream(self, response: httpx.Response) -> bool:
        """The owner's status, headers and body to the client: False if either side hung up midway."""
        h = self.handler
        if isinstance(h.request.connection, HTTP1Connection):  # several writes: Nagle would hold
            h.request.connection.stream.set_nodelay(True)  # the last for the client's ACK
        h.set_status(response.status_code, response.reason_phrase or "Unknown")
        for name in ("Content-Type", "Cache-Control"):
            h.clear_header(name)
        for k, v in response.headers.multi_items():
            if k.lower() not in HOP_BY_HOP:
                h.add_header(k, v)
        try:
            async for chunk in response.aiter_raw():
                h.write(chunk)
                await h.flush()
        except (StreamClosedError, httpx.HTTPError) as e:
            log.info("forwarded answer from %s cut: %s", self.base_url, e)
            return False
        return True

    def cancel(self) -> None:
        """The client went away: the request to the owner ends too."""
        self._response.cancel()
        self._client_gone.set()
        if not self._answering:  # no answer() to give the slot back
            self._release()
        with contextlib.suppress(asyncio.QueueFull):
            self._chunks.put_nowait(None)


def open_relay(handler: web.RequestHandler, router: Router, base_url: str, body_limit: int | None) -> Relay:
    """Start forwarding ``handler``'s request; the body cap is this route's (the owner's is the same)."""
    conn = handler.request.connection
    if body_limit is not None and isinstance(conn, HTTP1Connection):
        conn.set_max_body_size(body_limit)
    return Relay(handler, router, base_url)
