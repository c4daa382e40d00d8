"""The TCP front of the egress proxy, `kernelmode egress-proxy`: for kernels on other hosts
(Enterprise Gateway nodes, Kubernetes pods), which cannot be given a unix socket of their own.

Each kernel was launched with its id and a random token (egress_wiring.remote_launch), which it
sends as ``Proxy-Authorization: Basic`` with every request and ``CONNECT``. The front reads the
first request head, finds the token's kernel (only the token's hash is stored), that kernel's
session (by kernel id, at request time) and its stored policy, and hands the connection to that
session's ``SessionProxy``: the same protocol code, audit lines and metrics as the local proxy.
A missing or wrong credential is a 407; a session deleted, hibernated or without egress a 403.
What a token opens is its own kernel's session's policy, nothing else (docs/security-model.md).

Caps are per session *per front process*: two replicas each allow a session its caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import h11

from ..audit import audit
from ..config import EgressSettings
from ..metrics import Metrics
from .credentials import credentials, token_hash
from .http import answer, new_server, next_request
from .policy import EgressPolicy, stored_policy
from .proxy import SessionProxy
from .service import own_addresses
from .streams import Link, Meter
from .tls import Certificates, ca_directory, upstream_context

if TYPE_CHECKING:  # the store is a room above: the CLI opens it and hands its tokens in
    from ..sessions.store.egress_tokens import EgressTokens

log = logging.getLogger("kernelmode.egress")

CACHE_SECONDS = 2.0  # how long a token's session and policy are trusted without asking the store
REVALIDATE_SECONDS = 5.0  # how often open connections' sessions are checked again (see revalidate)
CACHE_MAX = 4096  # tokens remembered (wrong ones too: a flood of them is one store query each)
PENDING_MAX = 1024  # connections not yet past their first request head; more are closed at once
SESSIONS_MAX = 10_000  # session proxies kept; beyond it, those with no open connection go
LIVE = frozenset({"starting", "idle", "busy", "restarting"})
REALM = (b"proxy-authenticate", b'Basic realm="kernelmode egress"')
NO_CREDENTIAL = ("this proxy needs the kernel's own credential (Proxy-Authorization): use the "
                 "HTTP_PROXY the kernel was started with")
STORE_DOWN = "the egress proxy cannot read the session store now; try again shortly"
BAD_CREDENTIAL = "the Proxy-Authorization credential is not a kernel's (wrong token, or its kernel is gone)"


@dataclass
class _Known:
    """What a token stood for when the store was last asked."""

    until: float
    kernel_id: str | None
    session_id: str | None = None
    tenant: str | None = None
    policy: EgressPolicy | None = None
    refusal: str | None = None


class EgressFront:
    """Listens on TCP; each connection is served by its kernel's session's ``SessionProxy``."""

    def __init__(self, settings: EgressSettings, tokens: EgressTokens, data_dir: Path,
                 metrics: Metrics | None = None, cache_seconds: float = CACHE_SECONDS) -> None:
        self.settings = settings
        self.tokens = tokens
        self.cache_seconds = cache_seconds
        self.certs = Certificates(ca_directory(settings.ca_dir, data_dir))
        self.metrics = metrics
        self.own = own_addresses()
        self._known: dict[str, _Known] = {}
        self._proxies: dict[str, SessionProxy] = {}
        self._tls: dict[Path | None, ssl.SSLContext] = {}
        self._pending = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port); the address actually bound."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=64 * 1024)
        bound = self._server.sockets[0].getsockname()
        self._sweeper = asyncio.create_task(self._sweep(), name="egress-revalidate")
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(p.close() for p in self._proxies.values()), return_exceptions=True)
        self._proxies.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= PENDING_MAX:
            writer.close()
            return
        self._pending += 1
        task = asyncio.current_task()
        assert task is not None
        link = Link(Meter(1 << 62), self.settings.idle_timeout_seconds)  # the head is no session's bytes
        link.watch(task)
        client = new_server()
        try:
            request = await next_request(client, reader, link)
            if request is None:
                writer.close()
                return
            proxy, status, why, known = await self._resolve(request)
            if proxy is None:
                self._refused(request, status, why, known)
                await answer(client, writer, status, why, extra=(REALM,) if status == 407 else ())
                writer.close()
                return
        except h11.RemoteProtocolError as e:
            with contextlib.suppress(h11.LocalProtocolError, OSError):
                await answer(client, writer, e.error_status_hint, f"a malformed proxy request ({e})")
            writer.close()
            return
        except asyncio.CancelledError:
            writer.close()
            if not link.idled:
                raise
            return
        except OSError:
            writer.close()
            return
        finally:
            link.unwatch()
            self._pending -= 1
        await proxy.serve(reader, writer, (client, request))

    async def _resolve(self, request: h11.Request) -> tuple[SessionProxy | None, int, str, _Known | None]:
        """The session proxy this request's credential opens, or (None, status, why, what the
        token stood for if it is a kernel's)."""
        creds = credentials(list(request.headers))
        if creds is None:
            return None, 407, NO_CREDENTIAL, None
        user, token = creds
        key = token_hash(token)
        known = self._known.get(key)
        if known is None or known.until <= time.monotonic():
            try:
                known = await asyncio.to_thread(self._lookup, token)
            except Exception:  # the store down or cut (any backend's error): say so, keep serving
                log.warning("egress: the session store did not answer a credential lookup", exc_info=True)
                return None, 503, STORE_DOWN, None
            if len(self._known) >= CACHE_MAX:
                self._known.clear()
            self._known[key] = known
        # The id must match too: a token is one kernel's, and says so (constant-time compare).
        if known.kernel_id is None or not hmac.compare_digest(user.encode(), known.kernel_id.encode()):
            return None, 407, BAD_CREDENTIAL, None
        if known.refusal is not None or known.policy is None or known.session_id is None:
            return None, 403, known.refusal or "this kernel's session has no egress", known
        return self._proxy(known.session_id, known.tenant, known.policy), 200, "", known

    async def revalidate(self) -> None:
        """Close the open connections of sessions that lost their egress since (deleted,
        hibernated, given another kernel or policy): a kept-alive connection or a tunnel must not
        outlive its session's right to it. Run every REVALIDATE_SECONDS."""
        for key, known in list(self._known.items()):
            proxy = self._proxies.get(known.session_id or "")
            if known.kernel_id is None or proxy is None or not proxy.busy:
                continue
            now = await asyncio.to_thread(self._session, known.kernel_id)
            if now.session_id != known.session_id or now.refusal is not None or now.policy != proxy.policy:
                self._known.pop(key, None)
                if self._proxies.get(known.session_id or "") is proxy:
                    del self._proxies[known.session_id or ""]
                await proxy.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(REVALIDATE_SECONDS)
            try:
                await self.revalidate()
            except Exception:  # the store unavailable a moment: the next sweep tries again
                log.warning("egress: revalidating open connections failed", exc_info=True)

    def _lookup(self, token: str) -> _Known:
        """Token -> kernel -> its session now -> that session's policy (a thread: store reads)."""
        kernel_id = self.tokens.kernel_of(token)
        if kernel_id is None:
            return _Known(time.monotonic() + self.cache_seconds, None)
        return self._session(kernel_id)

    def _session(self, kernel_id: str) -> _Known:
        until = time.monotonic() + self.cache_seconds
        info = self.tokens.session_of(kernel_id)
        if info is None:
            return _Known(until, kernel_id, refusal=f"kernel {kernel_id} serves no session (not claimed "
                          "yet, or its session was deleted): it has no egress")
        if info.status not in LIVE:
            return _Known(until, kernel_id, info.session_id, info.tenant,
                          refusal=f"session {info.session_id} is {info.status}: it has no egress now")
        policy = stored_policy(self.settings, info.egress)
        if not policy.enabled:
            return _Known(until, kernel_id, info.session_id, info.tenant,
                          refusal=f"session {info.session_id} has no egress (its policy allows no host)")
        return _Known(until, kernel_id, info.session_id, info.tenant, policy)

    def _proxy(self, session_id: str, tenant: str | None, policy: EgressPolicy) -> SessionProxy:
        """The session's proxy (its caps and counters), new when its policy changed."""
        proxy = self._proxies.get(session_id)
        if proxy is not None and proxy.policy == policy:
            return proxy
        if len(self._proxies) >= SESSIONS_MAX:
            for sid in [sid for sid, p in self._proxies.items() if not p.busy]:
                del self._proxies[sid]
        tls = self._tls.get(policy.upstream_ca_file)
        if tls is None:
            tls = self._tls[policy.upstream_ca_file] = upstream_context(policy.upstream_ca_file)
        proxy = self._proxies[session_id] = SessionProxy(session_id, tenant, policy, None, self.certs, tls,
                                                         self.own, self.metrics)
        return proxy

    def _refused(self, request: h11.Request, status: int, why: str, known: _Known | None) -> None:
        audit("egress", tenant=known.tenant if known else None, session_id=known.session_id if known else None,
              kernel_id=known.kernel_id if known else None, host=request.target.decode("latin-1")[:253],
              decision="refused",
              rule={407: "credential", 503: "store"}.get(status, "session"), reason=why)
        if self.metrics is not None:
            self.metrics.egress_connections.labels("refused").inc()
