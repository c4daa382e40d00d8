"""Wire the pieces together: sandbox check, kernelspec, gateway child, SessionManager, REST API.

``KernelmodeApp`` builds the service and hands its front doors a ``Services`` (services.py);
``running`` is the one place that starts and stops it, for `serve` and the embedded `kernelmode mcp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tornado import httpserver, web
from tornado.netutil import bind_sockets

from . import readiness
from .api.forwarding import Router
from .api.handlers import NotFoundHandler, route_table
from .api.jupyter_api import jupyter_routes
from .artifacts.base import ArtifactStore
from .artifacts.harvester import Harvester
from .artifacts.local import LocalStore
from .banner import TokenSource, startup_block
from .code_policy import CodePolicy
from .config import Settings
from .early_start import LocalStart, message_limit, start_host_tools
from .errors import KernelmodeError, SandboxUnavailable, StoreError
from .gateway.client import GatewayClient
from .gateway.process import GatewayProcess, raise_open_files_limit
from .gateway.remote import connect_external
from .gateway_watch import watch_embedded, watch_external
from .heap import release_large_buffers
from .sandbox import cgroups
from .sandbox.docker_engine import server_id
from .services import Services
from .sessions import SessionManager
from .sessions.ownership import Ownership
from .sessions.store import SessionStore, new_manager_id, open_store
from .tenants import Tenants
from .tools.broker import ToolBroker
from .tools.registry import ToolRegistry

if TYPE_CHECKING:
    from .early_start import EarlyStart
    from .mcp.app import KernelmodeMCP
    from .mcp.http import McpHttp

log = logging.getLogger("kernelmode")


class KernelmodeApp:
    """One running service: what `kernelmode serve` starts and stops."""

    def __init__(self, settings: Settings, tools: ToolRegistry | None = None, *,
                 early: EarlyStart | None = None) -> None:
        """``tools``: a registry with the host application's own callables (library mode); the
        tools and MCP servers of the settings are added to it. ``early``: what the embedded
        `kernelmode mcp` started before importing this module (the tools among it)."""
        self.settings = settings
        self.tools = tools if tools is not None else ToolRegistry()
        self.token = settings.server.token or secrets.token_urlsafe(24)
        self.token_generated = settings.server.token is None
        self.tenants = Tenants(settings, self.token)
        self.data_dir = settings.server.data_dir.resolve()
        # The data dir and the gateway child: made, spawned and checked by LocalStart.
        self.local = early.local if early is not None else LocalStart(settings, self.data_dir)
        self.sandbox_report = ""
        self.gateway_process: GatewayProcess | None = None
        self.gateway: GatewayClient | None = None
        self.sessions: SessionManager
        self.store: SessionStore | None = None
        self.manager_id = new_manager_id()  # this process's name in the store's leases
        self.http: httpserver.HTTPServer | None = None
        self.port = settings.server.port
        self.services: Services | None = None  # what the front doors get, once started
        self.mcp: KernelmodeMCP | None = None  # the MCP tools (mcp_server()), for /mcp and stdio
        self.mcp_http: McpHttp | None = None
        self.router: Router | None = None  # forwarding to other managers (PostgreSQL store)
        self._gateway_watch: asyncio.Task[None] | None = None
        self.stopping = False
        self._tools_started = early is not None
        self.policy: CodePolicy | None = early.policy if early is not None else None  # policy.module
        if early is not None:
            self.mcp = early.mcp
        self._starting: asyncio.Task[None] | None = None  # start_in_background's
        self.gateway_restarts = 0

    # -- start -------------------------------------------------------------------------------------
    def _choose_backend(self) -> None:
        """'auto': Docker when an engine answers and the kernel image exists, else bubblewrap."""
        sb = self.settings.sandbox
        if sb.backend != "auto":
            return
        from .sandbox.docker_engine import engine_status

        usable, why = engine_status(sb.docker_image)
        sb.backend = "docker" if usable else "bwrap"
        log.info("sandbox backend: %s (auto: docker %s)", sb.backend,
                 "usable" if usable else f"not usable: {why}")

    async def start_tools(self) -> None:
        """The host tools (and upstream MCP servers' tools): all that the MCP tool list and
        instructions need, so an embedded MCP server can answer ``initialize`` before ``start``."""
        if self._tools_started:
            return
        self.policy = await start_host_tools(self.settings, self.tools)
        self._tools_started = True

    def mcp_server(self) -> KernelmodeMCP:
        """The MCP server of this service (one for /mcp and stdio), made on first use; its tool
        list and instructions need only the tools (``start_tools``), its tools wait for ``start``."""
        if self.mcp is None:
            from .mcp.app import KernelmodeMCP

            self.mcp = KernelmodeMCP(self.settings, self.tools, self.started)
        return self.mcp

    async def started(self) -> Services:
        """The front doors' services, once ``start`` is done (raises what stopped it)."""
        await self.ready()
        if self.services is None:
            raise KernelmodeError("kernelmode is not started")
        return self.services

    def start_in_background(self) -> None:
        """``start`` in a task of its own; whatever needs the sessions awaits ``ready()``."""
        self._starting = asyncio.create_task(self.start(), name="start")

    async def ready(self) -> None:
        """Until a background start is done; raises its error if it failed."""
        if self._starting is not None:
            # Shielded: a caller that gives up (a cancelled tool call) must not cancel the start.
            await asyncio.shield(self._starting)

    async def start(self) -> None:
        s = self.settings
        await self.start_tools()
        dirs = self.local.prepare_dirs()
        await asyncio.to_thread(self._choose_backend)  # may ask a Docker engine (up to 5 s)
        if s.gateway.url:  # an external gateway: none of our own, no local sandbox check
            self.gateway, running_kernels = await connect_external(s, message_limit(s))
            self.sandbox_report = self.limits_mechanism = f"the external gateway at {s.gateway.url}"
            await self._start_rest(dirs, running_kernels)
            self._gateway_watch = asyncio.create_task(watch_external(self), name="gateway-watch")
            return
        # Adopted or spawned (already, in the embedded `kernelmode mcp`); the gateway's own start
        # (a second of imports) overlaps the sandbox check, and a failed check stops it (stop()).
        await self.local.launch()
        self.gateway_process = self.local.process
        assert self.gateway_process is not None
        adopted = self.local.adopted
        self.local.start_check()
        if s.sandbox.backend == "docker":  # its check removes this server's stray containers: first
            self.sandbox_report = await self.local.sandbox_checked()
        self.limits_mechanism = (
            f"cgroups {cgroups.detect()} (memory, pids) + rlimits (cpu, fsize, nofile)"
            if s.sandbox.backend == "bwrap" and s.sandbox.cgroups == "auto" and cgroups.detect()
            else "the Docker engine (memory, pids, cpus) + ulimits (nofile, fsize)"
            if s.sandbox.backend == "docker"
            else "rlimits (as, nproc, cpu, fsize, nofile)"
        )
        log.info("kernel limits enforced by %s", self.limits_mechanism)
        if adopted is None:
            await self.gateway_process.wait_ready(s.gateway.startup_timeout_seconds)
        self.gateway = GatewayClient(self.gateway_process.url, self.gateway_process.token,
                                     request_timeout=s.sessions.kernel_start_timeout_seconds + 10,
                                     max_message_bytes=message_limit(s),
                                     poll_interval=s.gateway.poll_interval_seconds)
        await self._start_rest(dirs, set(adopted or ()))
        self._gateway_watch = asyncio.create_task(watch_embedded(self), name="gateway-watch")

    async def _start_rest(self, dirs: dict[str, Path], running_kernels: set[str]) -> None:
        """Everything after the gateway: stores, sessions (adopting those of ``running_kernels``),
        the front doors."""
        s = self.settings
        assert self.gateway is not None
        self.store = await asyncio.to_thread(open_store, s.store.url, self.data_dir)  # may migrate
        log.info("session store: %s; manager id %s", self.store.describe(), self.manager_id)
        if s.gateway.url:  # a shared gateway runs others' kernels too: only ours are adopted or shut
            running_kernels &= self.store.kernel_ids()
        self.artifact_store = await self._start_store()
        scratch = self.data_dir / "scratch"
        scratch.mkdir(exist_ok=True, mode=0o700)
        self.harvester = Harvester(self.artifact_store, s.artifacts, scratch)
        # Bound now (served once the routes exist): this manager's address goes in the store first.
        socks = bind_sockets(s.server.port, s.server.host)
        self.port = socks[0].getsockname()[1]
        self.ownership = Ownership(self.store, s, self.manager_id, (s.server.advertise_url or self.url).rstrip("/"),
                                   f"{socket.gethostname()}:{self.data_dir}")
        self.sessions = SessionManager(s, self.gateway, self.store, self.data_dir, dirs["state"],
                                       s.sandbox.backend, ToolBroker(self.tools, s.tool_calls),
                                       self.harvester, self.policy, self.ownership)
        await self.sessions.start(running_kernels)
        # The pool's first kernels start beside the sandbox check (no user code runs in them before
        # a session takes one); nothing is served before the check has passed.
        if not s.gateway.url:
            self.sandbox_report = await self.local.sandbox_checked()
        if self.ownership.active:  # several managers: a session's requests go to its owner
            self.router = Router(self.sessions, self.store, self.ownership, s.store.lease_seconds,
                                 s.server.forward_max_connections)
        self.services = services = Services(
            settings=s, tenants=self.tenants, tools=self.tools, sessions=self.sessions,
            gateway=self.gateway, artifact_store=self.artifact_store, metrics=self.sessions.metrics,
            readiness=self.readiness, router=self.router)
        routes = route_table(services)
        routes += [(pattern, handler, {"services": services}) for pattern, handler in jupyter_routes()]
        if s.mcp.enabled:
            from .mcp.http import McpHandler, McpHttp

            self.mcp_http = McpHttp(self.mcp_server(), s.mcp.max_request_bytes)
            self.sessions.rebalance.pinned = self.mcp_server().tools.connections.own.values  # kept here
            if self.router is not None:  # where each MCP connection lives, for the other managers
                self.mcp_http.record = self.router.record_mcp
                self.mcp_http.forget = self.router.forget_mcp
            await self.mcp_http.start()
            # First: tornado tries the rules in order, and /mcp is the agents' hot path.
            routes.insert(0, (r"/mcp/?", McpHandler, {"services": services, "mcp_http": self.mcp_http}))
        app = web.Application(routes, default_handler_class=NotFoundHandler,
                              default_handler_args={"services": services})
        self.http = httpserver.HTTPServer(app, max_body_size=s.server.max_body_bytes, xheaders=False)
        self.http.add_sockets(socks)
        self.harvester.public_url = (s.artifacts.public_url or self.url).rstrip("/")

    async def _start_store(self) -> ArtifactStore:
        cfg = self.settings.artifacts
        store: ArtifactStore
        if cfg.store == "s3":
            from .artifacts.s3 import S3Store

            store = S3Store(cfg)
        else:
            store = LocalStore(self.data_dir / "artifacts", cfg.link_ttl_seconds)
        try:
            await store.start()
            self.store_error = None
        except StoreError as e:
            # Runs still work; their results say that artifacts could not be kept.
            self.store_error = str(e)
            log.error("artifact store unavailable: %s", e)
        return store

    @property
    def url(self) -> str:
        host = self.settings.server.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    async def readiness(self) -> dict[str, Any]:
        gateway_ok = bool((self.gateway_process is None or self.gateway_process.running) and self.gateway
                          and await self.gateway.ping())
        return {
            "gateway": {"ok": gateway_ok, "restarts": self.gateway_restarts,
                        "mode": "external" if self.settings.gateway.url else "embedded"},
            "artifacts": {"ok": getattr(self, "store_error", None) is None,
                          "store": self.settings.artifacts.store,
                          "error": getattr(self, "store_error", None)},
            "workspace_quota": readiness.workspace_quota(getattr(self, "sessions", None), self.data_dir),
            "pool": readiness.pool(getattr(self, "sessions", None), self.settings.sessions.pool_size,
                                   self.data_dir),
            "drain": readiness.drain(getattr(self, "sessions", None)),
            "sandbox": {"ok": bool(self.sandbox_report), "backend": self.settings.sandbox.backend,
                        "detail": self.sandbox_report, "limits": getattr(self, "limits_mechanism", "")},
        }

    # -- stop --------------------------------------------------------------------------------------
    async def drain(self, cut: asyncio.Event | None = None) -> None:
        """A stop's first step (`serve` on SIGTERM): ``/readyz`` fails, no new run, create or
        wake starts here (503 server_busy), and the runs in flight finish and are recorded, for
        ``server.drain_seconds`` at most (``cut``: a second signal ends it at once)."""
        if getattr(self, "sessions", None) is None:
            return
        await self.sessions.ownership.drain()  # no other manager hands it sessions any more
        if self.settings.server.drain_seconds <= 0:
            return
        self.sessions.drain.begin()
        await self.sessions.drain.wait(self.settings.server.drain_seconds, cut)

    async def stop(self) -> None:
        self.stopping = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.wait([self._starting])
        if self._gateway_watch is not None:
            self._gateway_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gateway_watch
        if self.http is not None:
            self.http.stop()
        if self.mcp_http is not None:
            await self.mcp_http.stop()
        if self.router is not None:
            await self.router.forwarder.close()
        if getattr(self, "sessions", None) is not None:
            # An external gateway keeps running, with the kernels of live sessions: adoptable.
            await self.sessions.stop(keep_sessions=bool(self.settings.gateway.url))
        await self.local.stop()  # the gateway child (ours or adopted) and its lease
        if self.gateway_process is not None:
            if self.settings.sandbox.backend == "docker":
                # Our gateway and its kernels are gone: no container of this server may run on
                # (a launcher SIGKILLed with the gateway's group cannot remove its own).
                from .sandbox.docker_engine import remove_orphans

                await asyncio.to_thread(remove_orphans, server_id(self.data_dir))
        await self.tools.stop()
        if getattr(self, "artifact_store", None) is not None:
            await self.artifact_store.stop()
        if self.store is not None:
            self.store.close()
        self.local.release()  # the data dir is free for the next serve


@contextlib.asynccontextmanager
async def running(settings: Settings, tools: ToolRegistry | None = None, *,
                  background: bool = False, early: EarlyStart | None = None) -> AsyncIterator[KernelmodeApp]:
    """The one place that builds, starts and stops the service (`serve`, the embedded
    `kernelmode mcp`): everything started is stopped on the way out, start errors included.

    ``background``: only the tools start before this yields (enough for the MCP tool list);
    the rest starts in a task, and whatever needs it awaits ``app.started()``. ``early``: what
    the embedded `kernelmode mcp` started before (its tools, MCP server and gateway child)."""
    raise_open_files_limit()  # one websocket per session
    app = KernelmodeApp(settings, tools, early=early)
    try:
        if background:
            await app.start_tools()
            app.start_in_background()
        else:
            await app.start()
        yield app
    finally:
        with contextlib.suppress(Exception):
            await app.stop()


async def serve(settings: Settings, tools: ToolRegistry | None = None,
                token_source: TokenSource | None = None) -> int:
    """Run until SIGINT/SIGTERM; everything started is stopped before returning.
    ``token_source``: where a given token came from (for the start-up block), default config."""
    release_large_buffers()  # multi-MB requests must not stay resident after they are answered
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with running(settings, tools) as app:
            source: TokenSource = "generated" if app.token_generated else token_source or "config"
            print(startup_block(app.url, app.token, source, settings.sandbox.backend, settings.mcp.enabled),
                  flush=True)
            await stop.wait()
            stop.clear()  # set again by a second signal: the drain ends at once
            await app.drain(stop)
            log.info("shutting down")
        return 0
    except SandboxUnavailable as e:
        log.error("cannot start: %s", e.message)
        return 2
    except KernelmodeError as e:
        log.error("cannot start: %s", e.message)
        return 1
