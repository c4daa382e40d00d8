"""Wire the pieces together: sandbox check, kernelspec, gateway child, SessionManager, REST API.

``KernelmodeApp`` builds the service and hands its front doors a ``Services`` (services.py);
``running`` is the one place that starts and stops it, for `serve` and the embedded `kernelmode mcp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
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
from .audit import audit
from .banner import TokenSource, startup_block
from .code_policy import CodePolicy
from .config import Settings
from .errors import ConfigError, KernelmodeError, SandboxUnavailable, StoreError
from .gateway.client import GatewayClient, message_limit
from .gateway.process import GatewayProcess, raise_open_files_limit
from .gateway.remote import connect_external
from .heap import release_large_buffers
from .sandbox import cgroups
from .sandbox.docker_engine import server_id
from .sandbox.kernelspec import check_bwrap, install_kernelspec
from .services import Services
from .sessions import SessionManager
from .sessions.ownership import Ownership
from .sessions.store import SessionStore, new_manager_id, open_store
from .tenants import Tenants
from .tools.broker import ToolBroker
from .tools.registry import ToolRegistry

if TYPE_CHECKING:
    from .mcp.app import KernelmodeMCP
    from .mcp.http import McpHttp

log = logging.getLogger("kernelmode")


class KernelmodeApp:
    """One running service: what `kernelmode serve` starts and stops."""

    def __init__(self, settings: Settings, tools: ToolRegistry | None = None) -> None:
        """``tools``: a registry with the host application's own callables (library mode); the
        tools and MCP servers of the settings are added to it."""
        self.settings = settings
        self.tools = tools if tools is not None else ToolRegistry()
        self.token = settings.server.token or secrets.token_urlsafe(24)
        self.token_generated = settings.server.token is None
        self.tenants = Tenants(settings, self.token)
        self.data_dir = settings.server.data_dir.resolve()
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
        self._lease: asyncio.Task[None] | None = None
        self._stopping = False
        self._tools_started = False
        self.policy: CodePolicy | None = None  # policy.module, loaded with the tools
        self._starting: asyncio.Task[None] | None = None  # start_in_background's
        self.gateway_restarts = 0
        self._lock_fd: int | None = None

    # -- start -------------------------------------------------------------------------------------
    def _prepare_dirs(self) -> dict[str, Path]:
        dirs = {name: self.data_dir / name for name in ("run", "state", "gateway", "kernels")}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        # Kernels run as other uids and must traverse (not list) the data dir to their own parts.
        self.data_dir.chmod(0o711)
        for name, d in dirs.items():
            d.mkdir(exist_ok=True)
            d.chmod(0o711 if name == "run" else 0o700)
        return dirs

    def _lock_data_dir(self) -> None:
        """One `serve` per data dir: a second one would adopt (steal) the first one's gateway and
        kernels. The lock dies with its process, so a crashed manager's successor gets it."""
        fd = os.open(self.data_dir / "serve.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"another kernelmode serve (pid {owner}) is using the data dir "
                              f"{self.data_dir}: stop it, or give this one another --data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd  # held (open) until this process ends

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

    def _check_sandbox(self, adopted: set[str]) -> None:
        backend = self.settings.sandbox.backend
        if backend == "docker":
            from .sandbox.docker_engine import check_docker, remove_orphans, server_id

            self.sandbox_report = check_docker(self.settings.sandbox.docker_image,
                                               self.settings.sandbox.max_limits)
            removed = remove_orphans(server_id(self.data_dir), keep=adopted)
            if removed:
                log.info("removed %d kernel container(s) left by an earlier run", removed)
            log.info("sandbox: %s", self.sandbox_report)
            return
        if backend == "none":
            log.warning("=" * 72)
            log.warning("SANDBOX DISABLED (--sandbox none): kernels run as plain local processes")
            log.warning("with this server's user, files, network and environment. Development only.")
            log.warning("=" * 72)
            self.sandbox_report = "none: NO ISOLATION"
            return
        self.sandbox_report = check_bwrap(
            self.settings.sandbox.bwrap_path, self.settings.sandbox.kernel_python, self.data_dir
        )
        log.info("sandbox: %s", self.sandbox_report)
        version = cgroups.detect() if self.settings.sandbox.cgroups == "auto" else None
        if version and (swept := cgroups.sweep_stale(version)):
            log.info("removed %d empty kernel cgroup(s) left by killed servers", swept)

    async def start_tools(self) -> None:
        """The host tools (and upstream MCP servers' tools): all that the MCP tool list and
        instructions need, so an embedded MCP server can answer ``initialize`` before ``start``."""
        if self._tools_started:
            return
        s = self.settings
        self.tools.add_from_settings(s.tools, s.mcp_servers)  # a bad tool fails before anything runs
        if s.policy.module:  # so does a bad policy path (a ConfigError naming policy.module)
            self.policy = CodePolicy.load(s.policy.module, s.policy.timeout_seconds)
        await self.tools.start()
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
        dirs = self._prepare_dirs()
        await asyncio.to_thread(self._choose_backend)  # may ask a Docker engine (up to 5 s)
        if s.gateway.url:  # an external gateway: none of our own, no local sandbox check
            self.gateway, running_kernels = await connect_external(s, message_limit(s))
            self.sandbox_report = self.limits_mechanism = f"the external gateway at {s.gateway.url}"
            await self._start_rest(dirs, running_kernels)
            self._gateway_watch = asyncio.create_task(self._watch_external(), name="gateway-watch")
            return
        self.gateway_process = self._gateway_process(dirs)
        # A gateway that a crashed manager left running keeps its kernels: adopt them.
        adopted = await self.gateway_process.adopt()
        install_kernelspec(dirs["kernels"], s.sandbox.backend, s.sandbox.kernel_python,
                           s.gateway.config_dir / "kernelspec.json")
        # Renewed from here on: a gateway slow to start must not find its lease stale.
        self._lease = asyncio.create_task(self._renew_lease_forever(), name="gateway-lease")
        if adopted is None:
            # The gateway's own start (a second or more of imports) overlaps the sandbox check;
            # a failed check stops it with the rest (stop()).
            await self.gateway_process.spawn()
        await asyncio.to_thread(self._check_sandbox, set(adopted or ()))
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
                                     max_message_bytes=message_limit(s))
        await self._start_rest(dirs, set(adopted or ()))
        self._gateway_watch = asyncio.create_task(self._watch_gateway(), name="gateway-watch")

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

    def _gateway_process(self, dirs: dict[str, Path]) -> GatewayProcess:
        s = self.settings
        env = {
            "JUPYTER_PATH": str(self.data_dir),  # -> data_dir/kernels/kernelmode
            "KERNELMODE_GW_RUNTIME_DIR": str(dirs["run"]),
            "KERNELMODE_GW_STATE_DIR": str(dirs["state"]),
            "KERNELMODE_GW_LIMITS": s.sandbox.limits.model_dump_json(),
            "KERNELMODE_GW_BWRAP": s.sandbox.bwrap_path,
            "KERNELMODE_GW_UID_BASE": str(s.sandbox.uid_base),
            "KERNELMODE_GW_UID_COUNT": str(s.sandbox.uid_count),
            "KERNELMODE_GW_CGROUPS": s.sandbox.cgroups,
            "KERNELMODE_GW_POLL_INTERVAL": str(s.gateway.poll_interval_seconds),
            "KERNELMODE_GW_MAX_STREAM_CHARS": str(s.sessions.max_output_bytes + 1),
            "KERNELMODE_GW_MAX_MESSAGE_BYTES": str(message_limit(s)),
            "KERNELMODE_GW_DOCKER_IMAGE": s.sandbox.docker_image,
            "KERNELMODE_GW_DOCKER_CPUS": str(s.sandbox.docker_cpus),
            "KERNELMODE_GW_SERVER_ID": server_id(self.data_dir),
            **({"DOCKER_HOST": os.environ["DOCKER_HOST"]} if os.environ.get("DOCKER_HOST") else {}),
        }
        # What the running kernels depend on: a gateway started with other values is not adopted.
        fingerprint = hashlib.sha256(json.dumps(
            {**env, "backend": s.sandbox.backend, "python": str(s.sandbox.kernel_python),
             "config": str(s.gateway.config_dir)}, sort_keys=True).encode()).hexdigest()
        env["KERNELMODE_GW_EVENT_LOOP"] = s.server.event_loop  # the kernels do not depend on it
        return GatewayProcess(s.gateway.config_dir / "kernel_gateway_config.py", dirs["gateway"], env,
                              orphan_timeout=s.gateway.orphan_timeout_seconds, fingerprint=fingerprint)

    async def _renew_lease_forever(self) -> None:
        while True:
            if self.gateway_process is not None:
                with contextlib.suppress(OSError):
                    self.gateway_process.renew_lease()
            await asyncio.sleep(1.0)

    async def _watch_gateway(self) -> None:
        """The gateway's exit is seen at once (we are its parent): sessions are told their
        kernels are gone, then a new gateway is started (with backoff while that fails)."""
        assert self.gateway_process is not None and self.gateway is not None
        while not self._stopping:
            code = await self.gateway_process.wait()
            if self._stopping:
                return
            log.error("the kernel gateway exited (code %s), and its kernels with it; restarting it\n%s",
                      code, self.gateway_process.log_tail(1000))
            audit("gateway_died", exit_code=code)
            await self.sessions.gateway_lost()
            if self.settings.sandbox.backend == "docker":  # their launchers died with the gateway
                from .sandbox.docker_engine import remove_orphans, server_id

                await asyncio.to_thread(remove_orphans, server_id(self.data_dir))
            backoff = 0.5
            while not self._stopping:
                try:
                    await self.gateway_process.start(self.settings.gateway.startup_timeout_seconds)
                    break
                except KernelmodeError as e:
                    log.error("the kernel gateway did not restart (%s); retrying in %.1f s", e.message, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
            if self._stopping:
                return
            self.gateway.url = self.gateway_process.url  # a new port; same token
            self.gateway_restarts += 1
            self.sessions.metrics.gateway_restarts.inc()
            audit("gateway_restarted", restarts=self.gateway_restarts)
            self.sessions.gateway_back()

    async def _watch_external(self) -> None:
        """An external gateway is not our child: it is asked every few seconds. Once it answers
        again after it did not (restarted, or the network came back), the sessions whose kernels
        it lost are marked dead, and the log names those that survived."""
        assert self.gateway is not None
        down = False
        while not self._stopping:
            await asyncio.sleep(max(2.0, 4 * self.settings.gateway.poll_interval_seconds))
            try:
                # Bounded like a probe: a gateway that hangs is as down as one that refuses.
                running = {str(k["id"]) for k in await self.gateway.list_kernels(
                    timeout=self.settings.gateway.probe_timeout_seconds)}
            except KernelmodeError as e:
                if not down:
                    log.error("the external kernel gateway does not answer: %s", e.message)
                    audit("gateway_unreachable", url=self.settings.gateway.url)
                down = True
                continue
            if down or self.sessions.kernels_vanished(running):
                down = False
                survived, lost = await self.sessions.external_gateway_back(running)
                self.gateway_restarts += 1
                log.warning("the external kernel gateway answers again; sessions that survived: %s; "
                            "lost (kernel gone): %s", ", ".join(survived) or "none", ", ".join(lost) or "none")
                audit("gateway_back", survived=survived, lost=lost)

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
            "sandbox": {"ok": bool(self.sandbox_report), "backend": self.settings.sandbox.backend,
                        "detail": self.sandbox_report, "limits": getattr(self, "limits_mechanism", "")},
        }

    # -- stop --------------------------------------------------------------------------------------
    async def stop(self) -> None:
        self._stopping = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.wait([self._starting])
        for task in (self._gateway_watch, self._lease):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.http is not None:
            self.http.stop()
        if self.mcp_http is not None:
            await self.mcp_http.stop()
        if self.router is not None:
            await self.router.forwarder.close()
        if getattr(self, "sessions", None) is not None:
            # An external gateway keeps running, with the kernels of live sessions: adoptable.
            await self.sessions.stop(keep_sessions=bool(self.settings.gateway.url))
        if self.gateway_process is not None:
            await self.gateway_process.stop()
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
        if self._lock_fd is not None:  # the data dir is free for the next serve
            os.close(self._lock_fd)
            self._lock_fd = None


@contextlib.asynccontextmanager
async def running(settings: Settings, tools: ToolRegistry | None = None, *,
                  background: bool = False) -> AsyncIterator[KernelmodeApp]:
    """The one place that builds, starts and stops the service (`serve`, the embedded
    `kernelmode mcp`): everything started is stopped on the way out, start errors included.

    ``background``: only the tools start before this yields (enough for the MCP tool list);
    the rest starts in a task, and whatever needs it awaits ``app.started()``."""
    raise_open_files_limit()  # one websocket per session
    app = KernelmodeApp(settings, tools)
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
            log.info("shutting down")
        return 0
    except SandboxUnavailable as e:
        log.error("cannot start: %s", e.message)
        return 2
    except KernelmodeError as e:
        log.error("cannot start: %s", e.message)
        return 1
