"""SessionManager: create, run code in, interrupt, restart, reap and delete sessions.

Each session is one kernel in the gateway plus one websocket to it. Executions in a session are
serialised by an asyncio.Lock (FIFO), so concurrent calls run in arrival order. A failure in user
code is a RunResult; a failure of the gateway or the kernel's plumbing is a KernelmodeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import tempfile
import time
import uuid
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, BinaryIO

from ..artifacts.base import StoreError
from ..artifacts.harvester import SESSION_FILES, Harvester
from ..artifacts.volume import WorkspaceVolumes
from ..artifacts.workspace import FileEntry, Workspace, WorkspaceFull, clean_path, mime_type
from ..audit import audit
from ..config import ADMIN_TENANT, Settings
from ..errors import (
    KernelmodeError,
    KernelUnavailable,
    PayloadTooLarge,
    QuotaExceeded,
    RunNotFound,
    SessionExists,
    SessionNotFound,
    TooManySessions,
    ValidationError,
)
from ..gateway.client import KERNEL_DEAD, GatewayClient, KernelConnection
from ..gateway.execution import OutputCollector
from ..kernel.preamble import MARKER, boot_code
from ..metrics import Metrics
from ..models import (
    Artifact,
    DeathCause,
    FileList,
    Limits,
    RunError,
    RunResult,
    RunStatus,
    SessionCreate,
    SessionInfo,
    ToolCall,
    UploadResult,
    WorkspaceFile,
)
from ..sandbox import cgroups
from ..sandbox.spec import KernelParams, pop_death_record
from ..tenants import ADMIN, Principal
from ..tools.broker import ToolBroker
from .runs import LiveRun, RunRegistry
from .store import SessionStore

log = logging.getLogger("kernelmode.sessions")

# Synthetic events the manager puts into a run's message queue.
_KERNEL_STATUS = "kernelmode_kernel_status"
_DISCONNECTED = "kernelmode_disconnected"


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class LiveSession:
    info: SessionInfo
    kernel_id: str
    workspace: Path
    conn: KernelConnection | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    needs_ready: bool = False  # the kernel restarted: reconnect and wait for kernel_info
    state_lost_pending: bool = False  # tell the next result that variables are gone
    interrupt_requested: bool = False
    # ipykernel ignores SIGINT between cells, so an interrupt asked for before the run's cell has
    # started (kernel being readied, preamble, request in flight) is held and sent at its start.
    cell_started: bool = True
    interrupt_held: bool = False
    console_cells: int = 0  # cells a console attached to the session has running or queued
    kernel_state: str = "alive"  # alive | restarting | dead (from the gateway)
    pending_cause: DeathCause | None = None
    closed: bool = False  # deleted: a run in progress must not wait for its kernel
    tools_installed: str | None = None  # the tool specs (JSON) the kernel's preamble holds
    files: dict[str, FileEntry] = field(default_factory=dict)  # workspace as of the last harvest

    def workspace_view(self) -> Workspace:
        st = self.workspace.stat()
        owner = (st.st_uid, st.st_gid) if os.getuid() == 0 and st.st_uid != 0 else None
        return Workspace(self.workspace, owner)

    def touch(self) -> None:
        now = _now()
        self.info.last_activity = now
        self.info.expires_at = now + timedelta(seconds=self.info.ttl_seconds)


class SessionManager:
    def __init__(self, settings: Settings, gateway: GatewayClient, store: SessionStore, data_dir: Path,
                 state_dir: Path, sandbox: str, broker: ToolBroker, harvester: Harvester | None = None) -> None:
        self.settings = settings
        self.broker = broker
        self.harvester = harvester
        self.gateway = gateway
        self.store = store
        self.workspaces = data_dir / "workspaces"
        self.volumes = WorkspaceVolumes(self.workspaces, settings.sandbox.workspace_quota)
        self.quota = "off"
        self.state_dir = state_dir
        self.sandbox = sandbox
        self._live: dict[str, LiveSession] = {}
        self._creating: dict[str, str] = {}  # session id -> tenant, while its kernel starts
        self._reaper: asyncio.Task[None] | None = None
        self._strays: asyncio.Task[None] | None = None
        # Warm pool: started, sandboxed, preamble-ready kernels that no session has used yet.
        self._pool: list[LiveSession] = []
        self._pool_task: asyncio.Task[None] | None = None
        # The pool kernel being started (done when its start ends), and whether a create waits
        # for it: one that comes while it starts takes it rather than start a second beside it.
        self._pool_next: asyncio.Future[None] | None = None
        self._pool_claimed = False
        self._stopping = False
        self.runs = RunRegistry(settings.sessions.run_retention_seconds)
        self.metrics = Metrics()
        self.metrics.watch(self._gauges)
        # Where each kernel's memory use can be read (its cgroup), if anywhere.
        self._cgroups = cgroups.detect() if sandbox == "bwrap" and settings.sandbox.cgroups != "off" else None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, running_kernels: set[str] | frozenset[str] = frozenset()) -> None:
        """``running_kernels``: kernels of an adopted gateway (left by a crashed manager); the
        sessions they belong to are taken over with their variables, the rest become ``lost``."""
        adoptable = [i for i in self.store.all()
                     if i.status != "lost" and i.kernel_id in running_kernels and i.kernel_id]
        lost = self.store.mark_all_lost(keep={i.session_id for i in adoptable})
        if lost:
            log.info("%d session(s) of a previous run are marked lost", lost)
        self.workspaces.mkdir(parents=True, exist_ok=True)
        self.workspaces.chmod(0o711)
        keep_mounted = {w for i in adoptable if (w := self.store.workspace(i.session_id)) is not None}
        self.quota = await asyncio.to_thread(self.volumes.start, keep_mounted)
        log.info("workspace quota: %s", self.quota)
        in_flight = {r.session_id: r for r in self.store.runs_in_flight()}
        adopted = await self._adopt(adoptable, in_flight)
        for run in in_flight.values():  # the server died under them: they end as interrupted
            self.store.end_run(run.model_copy(update={
                "status": "interrupted", "state_lost": run.session_id not in adopted,
                "error": RunError(ename="ServerRestarted", evalue="the server stopped while this code "
                                  "ran; its output after that is lost", traceback="")}))
        strays = running_kernels - {s.kernel_id for s in self._live.values()}
        if strays:  # pool kernels of the dead manager, and the like: after start, in the background
            self._strays = asyncio.create_task(self._shut_down(strays), name="strays")
        # Workspaces of kernels that belong to no session (a previous run's pool) are litter.
        keep = self.store.workspaces()
        for d in self.workspaces.iterdir():
            if d.suffix != ".img" and d not in keep:
                await asyncio.to_thread(self.volumes.destroy, d)
        self._reaper = asyncio.create_task(self._reap_forever(), name="reaper")
        self._refill_pool()

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._reaper, self._pool_task, self._strays):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for s in list(self._live.values()):
            self.store.mark_lost(s.info)
        # At once, not one by one: an MCP client gives its stdio server 2 s to exit.
        await asyncio.gather(*(s.conn.close() for s in self._live.values() if s.conn),
                             *(self._discard(s) for s in self._pool), return_exceptions=True)
        self._pool.clear()
        await asyncio.to_thread(self.volumes.sweep, {s.workspace for s in self._live.values()})
        self._live.clear()

    async def _shut_down(self, kernel_ids: set[str] | frozenset[str]) -> None:
        for kernel_id in kernel_ids:
            with contextlib.suppress(KernelmodeError):
                await self.gateway.shutdown_kernel(kernel_id)
        # Their workspaces are no session's: the start-up sweep of workspaces/ removed them.

    async def _adopt(self, infos: list[SessionInfo], in_flight: dict[str, RunResult]) -> set[str]:
        """Reconnect to the running kernels of sessions a crashed manager held; an interrupted
        run is stopped first (a kernel that does not answer then is given up: its session is lost)."""
        timeout = self.settings.sessions.kernel_start_timeout_seconds

        async def adopt(info: SessionInfo) -> str | None:
            assert info.kernel_id is not None
            workspace = self.store.workspace(info.session_id)
            if workspace is None:
                return None
            s = LiveSession(info=info, kernel_id=info.kernel_id, workspace=workspace)
            try:
                if info.session_id in in_flight:
                    await self.gateway.interrupt_kernel(s.kernel_id)
                await self._connect(s, min(timeout, 30.0))
                s.files = await asyncio.to_thread(s.workspace_view().scan)
            except KernelmodeError as e:
                log.warning("session %s: its kernel could not be adopted (%s)", info.session_id, e)
                if s.conn is not None:
                    await s.conn.close()
                with contextlib.suppress(KernelmodeError):
                    await self.gateway.shutdown_kernel(s.kernel_id)
                self.store.mark_lost(info)
                return None
            s.info.status = "idle"
            s.touch()
            self._live[info.session_id] = s
            self.store.save(s.info, s.kernel_id, s.workspace)
            audit("session_adopted", session_id=info.session_id, tenant=info.tenant, kernel_id=s.kernel_id)
            return info.session_id

        done = await asyncio.gather(*(adopt(i) for i in infos))
        adopted = {sid for sid in done if sid is not None}
        if infos:
            log.info("adopted %d of %d session(s) whose kernels outlived the previous manager",
                     len(adopted), len(infos))
        return adopted

    async def gateway_lost(self) -> None:
        """The Kernel Gateway died, and every kernel with it: each session is marked ``dead``
        (its next run gets a fresh kernel on the same workspace and reports ``state_lost``), and
        the warm pool is dropped (refilled once a new gateway answers)."""
        for s in list(self._live.values()):
            if s.conn is not None:
                await s.conn.close()
            self._on_kernel_status(s, KERNEL_DEAD)
            self.store.save(s.info, s.kernel_id, s.workspace)
        for s in self._pool:
            await self._discard(s, shutdown=False)
        self._pool.clear()

    def gateway_back(self) -> None:
        self._refill_pool()

    # -- warm pool ---------------------------------------------------------------------------------
    @property
    def pool_size(self) -> int:
        return len(self._pool)

    def _refill_pool(self, delay: float = 0.0) -> None:
        if self._stopping or self.settings.sessions.pool_size <= 0:
            return
        if self._pool_task is None or self._pool_task.done():
            self._pool_task = asyncio.create_task(self._fill_pool(delay), name="pool")

    async def _fill_pool(self, delay: float) -> None:
        # After a take, let the new session's first runs have the CPU before a kernel starts.
        await asyncio.sleep(delay)
        backoff = 0.5
        while len(self._pool) < self.settings.sessions.pool_size and not self._stopping:
            now = _now()
            placeholder = SessionInfo(
                session_id="pool", status="idle", created_at=now, last_activity=now,
                ttl_seconds=self.settings.sessions.ttl_seconds, limits=self.settings.sandbox.limits,
                sandbox=self.sandbox,
            )
            self._pool_next = asyncio.get_running_loop().create_future()
            try:
                self._pool.append(await self._new_kernel(placeholder))
                backoff = 0.5
            except KernelmodeError as e:
                self._pool_started()
                log.warning("warm pool: could not start a kernel (%s); retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            finally:
                self._pool_started()

    def _pool_started(self) -> None:
        """The pool kernel's start ended (in the pool, failed or cancelled): wake its claimant."""
        if self._pool_next is not None and not self._pool_next.done():
            self._pool_next.set_result(None)
        self._pool_next, self._pool_claimed = None, False

    def _take_warm(self, limits: Limits) -> LiveSession | None:
        """A pool kernel for a session with the default limits; never one that ran any code."""
        if limits != self.settings.sandbox.limits:
            return None
        while self._pool:
            s = self._pool.pop(0)
            if s.kernel_state == "alive" and not s.needs_ready and s.conn is not None and s.conn.is_open:
                return s
            asyncio.create_task(self._discard(s))  # died while waiting: replaced by the refill
        return None

    async def _new_kernel(self, info: SessionInfo) -> LiveSession:
        """Start a sandboxed kernel with its own workspace, connect, install the preamble."""
        kernel_id = str(uuid.uuid4())
        workspace = self.workspaces / kernel_id
        create = asyncio.ensure_future(asyncio.to_thread(self.volumes.create, workspace, info.limits.disk_mb))
        try:
            await asyncio.shield(create)
        except asyncio.CancelledError:
            # Cancelling does not stop the thread: it would mount the volume after the stop's
            # sweep, and the mount would outlive the server. Undo it once it is made.
            with contextlib.suppress(Exception):
                await create
            with contextlib.suppress(KernelmodeError):
                await asyncio.to_thread(self.volumes.destroy, workspace)
            raise
        s = LiveSession(info=info, kernel_id=kernel_id, workspace=workspace)
        timeout = self.settings.sessions.kernel_start_timeout_seconds
        started = False
        try:
            params = KernelParams(workspace=workspace, limits=info.limits, session_id=info.session_id)
            await self.gateway.start_kernel(kernel_id, params.to_env(), timeout)
            started = True
            await self._connect(s, timeout)
        except BaseException as e:
            cause = pop_death_record(self.state_dir, kernel_id) if started else None
            await self._discard(s, shutdown=started)
            if cause is not None and isinstance(e, KernelmodeError):
                raise KernelUnavailable(f"the kernel died while starting ({cause.kind}): {e}") from e
            raise
        return s

    async def _discard(self, s: LiveSession, shutdown: bool = True) -> None:
        """Close, shut down and forget a kernel and its workspace."""
        s.closed = True
        if s.conn is not None:
            await s.conn.close()
        if shutdown:
            with contextlib.suppress(KernelmodeError):
                await self.gateway.shutdown_kernel(s.kernel_id)
        pop_death_record(self.state_dir, s.kernel_id)
        with contextlib.suppress(KernelmodeError):
            await asyncio.to_thread(self.volumes.destroy, s.workspace)

    # -- queries -----------------------------------------------------------------------------------
    def _gauges(self) -> tuple[dict[str, int], int, int]:
        by_status: dict[str, int] = dict(Tally(str(s.info.status) for s in self._live.values()))
        by_status["lost"] = sum(1 for i in self.store.all() if i.status == "lost")
        return by_status, len(self._pool), self.pool_size

    def _with_usage(self, s: LiveSession) -> SessionInfo:
        if self._cgroups is None:
            return s.info
        memory = cgroups.existing(s.kernel_id, self._cgroups).memory_bytes()
        return s.info.model_copy(update={"memory_bytes": memory})

    def all(self, principal: Principal = ADMIN) -> list[SessionInfo]:
        """The sessions ``principal`` may see (a tenant: its own; the admin: all)."""
        live = {sid: self._with_usage(s) for sid, s in self._live.items()}
        infos = [live.get(i.session_id, i) for i in self.store.all()]
        return [i for i in infos if principal.may_see(i.tenant)]

    def may_see(self, principal: Principal, session_id: str) -> bool:
        if principal.admin:
            return True
        live = self._live.get(session_id)
        return principal.may_see(live.info.tenant if live is not None else self.store.owner(session_id))

    def authorize(self, principal: Principal, session_id: str) -> None:
        """Another tenant's session id is answered exactly like an unknown one."""
        if not self.may_see(principal, session_id):
            raise SessionNotFound(f"no session {session_id!r}")

    def get(self, session_id: str) -> SessionInfo:
        if session_id in self._live:
            return self._with_usage(self._live[session_id])
        info = self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return info

    def _session(self, session_id: str) -> LiveSession:
        s = self._live.get(session_id)
        if s is None:
            info = self.store.get(session_id)
            if info is None:
                raise SessionNotFound(f"no session {session_id!r}")
            raise KernelUnavailable(
                f"session {session_id!r} is {info.status}: its kernel is gone (the server restarted); "
                "delete it and create a new one"
            )
        return s

    @property
    def live_count(self) -> int:
        return len(self._live) + len(self._creating)

    # -- create / delete ---------------------------------------------------------------------------
    async def create(self, req: SessionCreate, principal: Principal = ADMIN) -> SessionInfo:
        sid = req.session_id or uuid.uuid4().hex
        tenant = principal.tenant
        owner = self.store.owner(sid)
        if (sid in self._live or sid in self._creating or self.store.get(sid) is not None
                or owner not in (None, tenant)):  # a closed session's records stay its tenant's
            raise SessionExists(f"session {sid!r} already exists")
        if self.live_count >= self.settings.sessions.max_sessions:
            raise TooManySessions(
                f"the server holds its maximum of {self.settings.sessions.max_sessions} sessions; "
                "delete one or wait for idle sessions to expire"
            )
        cap = principal.max_sessions
        if cap is not None:
            held = (sum(1 for s in self._live.values() if s.info.tenant == tenant)
                    + sum(1 for t in self._creating.values() if t == tenant))
            if held >= cap:
                audit("quota_refused", tenant=tenant, quota="max_sessions", limit=cap)
                raise QuotaExceeded(f"tenant {tenant!r} holds its maximum of {cap} sessions; "
                                    "delete one or wait for idle sessions to expire")
        self.broker.registry.check_allow_list(req.tools)
        limits = principal.limits(req.limits, self.settings.sandbox)  # 422 above a ceiling
        ttl = req.ttl_seconds or self.settings.sessions.ttl_seconds
        now = _now()
        info = SessionInfo(
            session_id=sid, status="idle", created_at=now, last_activity=now,
            expires_at=now + timedelta(seconds=ttl), ttl_seconds=ttl, limits=limits,
            sandbox=self.sandbox, tools=req.tools, tenant=tenant,
        )
        self._creating[sid] = tenant
        try:
            s = self._take_warm(limits)
            if s is None and self._pool_next is not None and not self._pool_claimed \
                    and limits == self.settings.sandbox.limits:
                # A pool kernel is starting: it is ready sooner than one started now beside it
                # (the first session after start, e.g. the embedded MCP server's).
                self._pool_claimed = True
                await asyncio.shield(self._pool_next)
                s = self._take_warm(limits)
            if s is not None:
                info.from_pool = True
                s.info = info
                self._refill_pool(delay=self.settings.sessions.pool_refill_delay_seconds)
                if req.tools is not None:  # the pool kernel's preamble offers every tool
                    try:
                        await self._install_preamble(s, self.settings.sessions.kernel_start_timeout_seconds)
                    except BaseException:
                        await self._discard(s)
                        raise
            else:
                s = await self._new_kernel(info)
        finally:
            self._creating.pop(sid, None)
        info.kernel_id = s.kernel_id
        self._live[sid] = s
        self.metrics.sessions_created.labels("true" if info.from_pool else "false", tenant).inc()
        self.store.take_id(sid, tenant)  # runs of an earlier session with this id are not this one's
        self.store.save(info, s.kernel_id, s.workspace)
        log.info("session %s created (kernel %s, tenant %s)", sid, s.kernel_id, tenant)
        audit("session_created", session_id=sid, tenant=tenant, kernel_id=s.kernel_id,
              from_pool=info.from_pool, sandbox=self.sandbox)
        return info

    async def _connect(self, s: LiveSession, timeout: float) -> None:
        if s.conn is not None:
            await s.conn.close()
        s.conn = await self.gateway.connect(s.kernel_id, lambda state: self._on_kernel_status(s, state))
        await s.conn.kernel_info(timeout)
        s.tools_installed = None  # a new or restarted kernel has no preamble yet
        await self._install_preamble(s, timeout)
        s.needs_ready = False
        s.kernel_state = "alive"

    async def _install_preamble(self, s: LiveSession, timeout: float) -> None:
        """Define ``tools`` in the kernel (again when the set of tools changed)."""
        specs = [info.model_dump() for info in self.broker.registry.infos(s.info.tools)]
        digest = json.dumps(specs, sort_keys=True)
        if digest == s.tools_installed:
            return
        # The boot code ends with a ping over stdin. A kernel's stdin socket drops what it sends
        # before the gateway's stdin connection is up (ZMQ ROUTER), which would leave the first
        # tool call of a run blocked forever; so retry (after an interrupt) until it answers.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            outcome, collector = await self._run_boot(s, specs, min(deadline, loop.time() + 3.0))
            if outcome != "timeout" or loop.time() >= deadline:
                break
            log.info("session %s: stdin not connected yet; retrying the preamble", s.info.session_id)
        if outcome != "done" or collector.reply_status != "ok":
            detail = collector.error.evalue if collector.error else outcome
            raise KernelUnavailable(f"could not set up the kernel's tools: {detail}")
        s.tools_installed = digest

    def _on_kernel_status(self, s: LiveSession, state: str) -> None:
        """The gateway saw the kernel die (and is restarting it, or gave up)."""
        s.kernel_state = state
        s.needs_ready = True
        s.state_lost_pending = True
        s.info.status = "dead" if state == KERNEL_DEAD else "restarting"
        log.warning("session %s: kernel %s is %s", s.info.session_id, s.kernel_id, state)
        audit("kernel_died", session_id=s.info.session_id, tenant=s.info.tenant, kernel_id=s.kernel_id,
              then=state)

    async def delete(self, session_id: str, keep_notebook: bool = True, reason: str = "closed") -> None:
        """Stop the session's kernel and remove its workspace; its history is kept as a notebook
        among its artifacts (``keep_notebook``) and its runs stay in the store."""
        if keep_notebook and self.harvester is not None and session_id in self._live and \
                self.store.has_runs(session_id):
            try:
                await self._keep_notebook(session_id, "notebook.ipynb")
            except (KernelmodeError, StoreError) as e:
                log.warning("session %s: the notebook could not be kept: %s", session_id, e)
        s = self._live.pop(session_id, None)
        tenant = s.info.tenant if s is not None else self.store.owner(session_id)
        if s is None:
            workspace = self.store.workspace(session_id)
            if self.store.get(session_id) is None:
                raise SessionNotFound(f"no session {session_id!r}")
            if workspace is not None:  # a lost session: only its files are left
                with contextlib.suppress(KernelmodeError):
                    await asyncio.to_thread(self.volumes.destroy, workspace)
        else:
            await self._discard(s)
            self.broker.forget_session(session_id)
        self.store.delete(session_id)
        self.metrics.sessions_ended.labels(reason, tenant or ADMIN_TENANT).inc()
        log.info("session %s deleted (%s)", session_id, reason)
        audit("session_closed", session_id=session_id, tenant=tenant, reason=reason)

    def live_session(self, session_id: str) -> LiveSession:
        """The live session (SessionNotFound, or KernelUnavailable when it is lost)."""
        return self._session(session_id)

    def record_console_run(self, s: LiveSession, code: str, result: RunResult,
                           events: list[dict[str, Any]]) -> None:
        """A run typed in an attached console: in the session's history like any other."""
        if s.info.session_id not in self._live:
            return
        self.store.add_run(code, result, events)
        self.store.save(s.info, s.kernel_id, s.workspace)
        self.metrics.observe_run(result, s.info.tenant or ADMIN_TENANT, source="console")
        audit("console_run", session_id=s.info.session_id, tenant=s.info.tenant, run_id=result.run_id,
              status=result.status)

    # -- running code ------------------------------------------------------------------------------
    def _timeout(self, timeout_seconds: float | None) -> float:
        cfg = self.settings.sessions
        timeout = timeout_seconds or cfg.default_timeout_seconds
        if timeout > cfg.max_timeout_seconds:
            raise ValidationError(
                f"timeout_seconds={timeout:g} is above this server's maximum of {cfg.max_timeout_seconds:g}"
            )
        return timeout

    def submit(self, session_id: str, code: str, timeout_seconds: float | None = None) -> LiveRun:
        """Start a run in its own task and return it at once (it queues behind earlier runs)."""
        s = self._session(session_id)
        if len(code.encode("utf-8", errors="replace")) > self.settings.sessions.max_code_bytes:
            raise PayloadTooLarge(
                f"code is larger than this server's limit of {self.settings.sessions.max_code_bytes} bytes; "
                "upload data as a file instead of pasting it into code"
            )
        timeout = self._timeout(timeout_seconds)
        run = LiveRun(run_id=uuid.uuid4().hex, session_id=session_id, code=code,
                      collector=self._collector())
        run.collector.on_change = run.changed.set
        run.task = asyncio.create_task(self._execute(s, run, timeout), name=f"run-{run.run_id}")
        # A run nobody waits for any more still has its failure read (kept in run.failure).
        run.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.runs.add(run)
        return run

    async def execute(self, session_id: str, code: str, timeout_seconds: float | None = None,
                      wait_seconds: float | None = None) -> RunResult:
        """Run code; wait for the end, or at most ``wait_seconds`` (then status ``running``)."""
        return await self.wait(self.submit(session_id, code, timeout_seconds), wait_seconds)

    async def one_shot(self, code: str, files: list[tuple[str, bytes]], timeout_seconds: float | None = None,
                       tools: list[str] | None = None, principal: Principal = ADMIN) -> RunResult:
        """Run code in a fresh kernel (from the warm pool when there is one), then discard it.

        The result's artifacts stay in the store under the throw-away session's id.
        """
        self._timeout(timeout_seconds)  # refuse a bad timeout before taking a kernel
        info = await self.create(SessionCreate(session_id=f"oneshot-{uuid.uuid4().hex[:20]}", tools=tools),
                                 principal)
        sid = info.session_id
        try:
            for path, data in files:
                await self.upload(sid, path, io.BytesIO(data), len(data), overwrite=False)
            return await self.execute(sid, code, timeout_seconds)
        finally:
            with contextlib.suppress(SessionNotFound):
                await self.delete(sid)

    @staticmethod
    async def wait(run: LiveRun, wait_seconds: float | None = None) -> RunResult:
        """The run's result once it ends, or its snapshot (``running``) after ``wait_seconds``.

        The run's task is shielded: a caller that gives up (or is cancelled) does not stop it.
        """
        assert run.task is not None
        if wait_seconds is None:
            return await asyncio.shield(run.task)
        await asyncio.wait({run.task}, timeout=wait_seconds)
        return run.task.result() if run.task.done() else run.snapshot()

    def _collector(self) -> OutputCollector:
        cfg = self.settings.sessions
        return OutputCollector(cfg.max_output_bytes, max_display_bytes=cfg.max_display_bytes)

    def get_run(self, run_id: str, principal: Principal = ADMIN) -> LiveRun:
        """The run, if ``principal`` may see its session (another tenant's run is unknown)."""
        run = self.runs.get(run_id)
        if run is None or run.stored:
            # Finished: its result and output events are read from the store, for this answer only.
            stored = self.store.get_run(run_id)
            run = None
            if stored is not None:
                run = LiveRun(run_id=run_id, session_id=stored.session_id, result=stored,
                              collector=self._collector(), finished_at=time.monotonic())
                run.collector.events = self.store.run_events(run_id)
        if run is None or not self.may_see(principal, run.session_id):
            raise RunNotFound(f"no run {run_id!r} (finished runs stay for "
                              f"{self.settings.sessions.run_retention_seconds:g} s)")
        return run

    async def _execute(self, s: LiveSession, run: LiveRun, timeout: float) -> RunResult:
        session_id = s.info.session_id
        try:
            async with s.lock:
                if session_id not in self._live:  # deleted while we waited for the lock
                    raise SessionNotFound(f"no session {session_id!r}")
                started = time.monotonic()
                s.info.status = "busy"
                # From here an interrupt is this run's, even before its cell starts in the kernel.
                s.interrupt_requested, s.interrupt_held, s.cell_started = False, False, False
                try:
                    await self._ensure_ready(s)
                    await self._install_preamble(s, self.settings.sessions.kernel_start_timeout_seconds)
                    # Recorded as running first: if this server dies now, its successor can say
                    # the run was interrupted.
                    self.store.add_run(run.code, run.snapshot())
                    result = await self._run(s, run, timeout)
                finally:
                    s.cell_started, s.interrupt_held = True, False
                    s.touch()
                    if s.info.status == "busy":
                        s.info.status = "idle"
                if session_id not in self._live:  # deleted (or reaped) while the code ran
                    raise SessionNotFound(f"session {session_id!r} was deleted while the code ran")
                if self.harvester is not None and result.status == "ok":
                    # Never raises: a harvest problem is a note on the result, which stands.
                    s.files = await self.harvester.harvest(session_id, result, s.workspace_view(), s.files)
                result.duration_ms = round((time.monotonic() - started) * 1000, 3)
                if result.execution_count is not None:
                    s.info.execution_count = result.execution_count
                self.store.add_run(run.code, result, run.collector.events)
                self.store.save(s.info, s.kernel_id, s.workspace)
        except Exception as e:
            run.failure = e if isinstance(e, KernelmodeError) else KernelmodeError(
                f"internal error ({type(e).__name__}); see the server log")
            self.store.forget_run_if_running(run.run_id)  # it failed as a request, not as code
            raise
        finally:
            self.runs.finished(run)
        run.result = result
        self.metrics.observe_run(result, s.info.tenant or ADMIN_TENANT)
        audit("run", session_id=session_id, tenant=s.info.tenant, run_id=run.run_id, status=result.status,
              duration_ms=result.duration_ms, state_lost=result.state_lost,
              cause=result.cause.model_dump() if result.cause else None,
              tool_calls=len(result.tool_calls), artifacts=len(result.artifacts))
        return result

    async def _ensure_ready(self, s: LiveSession) -> None:
        timeout = self.settings.sessions.kernel_start_timeout_seconds
        if s.kernel_state == KERNEL_DEAD:
            # The gateway gave up restarting it (a crash loop) and forgot it: a fresh kernel
            # for the session, on the same workspace.
            await self._replace_kernel(s)
        elif s.conn is None or not s.conn.is_open or s.needs_ready:
            # After a restart, a fresh websocket: the gateway then opens its ZMQ channels to the
            # new kernel's sockets instead of reusing ones bound to the old process.
            await self._connect(s, timeout)

    async def _run(self, s: LiveSession, run: LiveRun, timeout: float) -> RunResult:
        assert s.conn is not None
        run_id, code, collector = run.run_id, run.code, run.collector
        state_lost = s.state_lost_pending
        s.state_lost_pending = False
        cause = s.pending_cause
        s.pending_cause = None
        tool_calls: list[ToolCall] = []
        answering: set[asyncio.Task[None]] = set()

        def on_input(msg: dict[str, Any]) -> None:
            task = asyncio.create_task(self._answer_input(s, run_id, msg, tool_calls))
            answering.add(task)
            task.add_done_callback(answering.discard)

        held_interrupt: list[asyncio.Task[None]] = []

        def on_start() -> None:
            s.cell_started = True
            if s.interrupt_held:
                s.interrupt_held = False
                held_interrupt.append(asyncio.create_task(self._quiet_interrupt(s)))

        # allow_stdin: tool calls come back as input_requests (the preamble makes a plain
        # input() fail inside the kernel). stop_on_error off: the manager queues nothing of its
        # own behind a run, so an abort would only hit someone else's cell (a console's).
        queue = await s.conn.send("shell", "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": True, "stop_on_error": False,
        })
        loop = asyncio.get_running_loop()
        try:
            outcome = await self._collect(queue, collector, loop.time() + timeout, on_input, on_start)
            status: RunStatus
            if outcome == "done":
                status = "ok" if collector.reply_status == "ok" else "error"
                if status == "error" and s.interrupt_requested and collector.error and \
                        collector.error.ename == "KeyboardInterrupt":
                    status = "interrupted"
            elif outcome == "timeout":
                status = "timeout"
                state_lost |= await self._stop_runaway(s, queue, collector, on_input, on_start)
                collector.error = RunError(
                    ename="TimeoutError",
                    evalue=f"the run exceeded its timeout of {timeout:g} s and was "
                    + ("stopped by restarting the kernel: variables are gone" if state_lost
                       else "interrupted"),
                    traceback="",
                )
            elif outcome == "restarted":
                status, state_lost = "interrupted", True
                s.state_lost_pending = False
            else:  # the kernel died, or its websocket closed under us
                status, state_lost = "kernel_died", True
                cause = DeathCause(kind="unknown") if s.closed else await self._death_cause(s)
                s.state_lost_pending = True
                s.needs_ready = True
        finally:
            s.conn.forget(queue)
            for task in list(answering):
                task.cancel()
            if held_interrupt:  # delivered before the next run can start, so it cannot hit that one
                await asyncio.gather(*held_interrupt, return_exceptions=True)
        return RunResult(
            run_id=run_id, session_id=s.info.session_id, status=status,
            stdout=collector.stdout, stderr=collector.stderr, result=collector.result,
            outputs=collector.outputs, error=collector.error,
            execution_count=collector.execution_count, truncated=collector.truncated,
            outputs_dropped=collector.dropped_outputs, state_lost=state_lost,
            cause=cause if status == "kernel_died" else None,
            tool_calls=tool_calls,
            tool_calls_truncated=len(tool_calls) >= self.settings.tool_calls.max_recorded_calls,
        )

    async def _run_boot(self, s: LiveSession, specs: list[dict[str, Any]],
                        deadline: float) -> tuple[str, OutputCollector]:
        assert s.conn is not None
        collector = self._collector()
        answering: set[asyncio.Task[None]] = set()

        def on_input(msg: dict[str, Any]) -> None:
            task = asyncio.create_task(self._answer_input(s, "preamble", msg, []))
            answering.add(task)
            task.add_done_callback(answering.discard)

        queue = await s.conn.send("shell", "execute_request", {
            "code": boot_code(specs), "silent": True, "store_history": False,
            "user_expressions": {}, "allow_stdin": True, "stop_on_error": False,
        })
        try:
            outcome = await self._collect(queue, collector, deadline, on_input)
            if outcome == "timeout":
                # Unblock the kernel (waiting for a reply that was dropped) before a retry.
                with contextlib.suppress(KernelmodeError):
                    await self.gateway.interrupt_kernel(s.kernel_id)
                    await self._collect(queue, collector, asyncio.get_running_loop().time() + 2.0, on_input)
        finally:
            s.conn.forget(queue)
            for task in list(answering):
                task.cancel()
        return outcome, collector

    async def _answer_input(self, s: LiveSession, run_id: str, msg: dict[str, Any],
                            tool_calls: list[ToolCall]) -> None:
        """Answer an input_request of the run: a tool call from the preamble, else nothing."""
        prompt = str(msg.get("content", {}).get("prompt", ""))
        record: ToolCall | None
        if msg.get("dropped"):  # too large to read: answered at once, the call fails in the kernel
            reply, record = self.broker.refuse_unread(s.info.session_id, run_id, msg["dropped"])
            if len(tool_calls) < self.settings.tool_calls.max_recorded_calls:
                tool_calls.append(record)
        elif prompt.startswith(MARKER):
            reply, record = await self.broker.handle(
                s.info.session_id, run_id, s.info.tools, prompt[len(MARKER):])
            if record is not None and len(tool_calls) < self.settings.tool_calls.max_recorded_calls:
                tool_calls.append(record)
        else:
            reply = ""  # only a kernel that bypassed the preamble asks for typed input
        if s.conn is not None and s.conn.is_open:
            with contextlib.suppress(KernelmodeError):
                await s.conn.send("stdin", "input_reply", {"value": reply}, expect_reply=False)

    @staticmethod
    async def _collect(queue: asyncio.Queue[dict[str, Any]], collector: OutputCollector, deadline: float,
                       on_input: Callable[[dict[str, Any]], None] | None = None,
                       on_start: Callable[[], None] | None = None) -> str:
        """Read until execute_reply and idle: 'done', 'timeout', 'died' or 'restarted'.

        One timer for the whole run (not one per message); what arrived before the deadline
        stays in ``collector``.
        """
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        try:
            return await asyncio.wait_for(SessionManager._drain(queue, collector, on_input, on_start), remaining)
        except asyncio.TimeoutError:
            return "timeout"

    @staticmethod
    async def _drain(queue: asyncio.Queue[dict[str, Any]], collector: OutputCollector,
                     on_input: Callable[[dict[str, Any]], None] | None,
                     on_start: Callable[[], None] | None = None) -> str:
        got_reply = got_idle = False
        while not (got_reply and got_idle):
            msg = await queue.get()
            kind = msg.get("msg_type")
            if kind == _KERNEL_STATUS:
                return "restarted" if msg.get("state") == "restarted" else "died"
            if kind == _DISCONNECTED:
                return "died"
            if kind == "status":
                got_idle = msg["content"].get("execution_state") == "idle"
                continue
            if kind == "input_request":
                if on_input is not None:
                    on_input(msg)
                continue
            if kind == "execute_input" and on_start is not None:
                on_start()
                on_start = None
            if kind == "execute_reply":
                got_reply = True
            collector.add(msg)
        return "done"

    async def _stop_runaway(self, s: LiveSession, queue: asyncio.Queue[dict[str, Any]],
                            collector: OutputCollector,
                            on_input: Callable[[dict[str, Any]], None] | None,
                            on_start: Callable[[], None] | None = None) -> bool:
        """Interrupt a run past its timeout; restart the kernel if that does not stop it.

        Returns True when the kernel was restarted (the session's state is lost).
        """
        cfg = self.settings.sessions
        loop = asyncio.get_running_loop()
        with contextlib.suppress(KernelmodeError):
            if s.cell_started:
                await self.gateway.interrupt_kernel(s.kernel_id)
            else:  # timed out before its cell started (a busy kernel): stop the cell once it does
                s.interrupt_held = True
            outcome = await self._collect(queue, collector, loop.time() + cfg.interrupt_grace_seconds,
                                          on_input, on_start)
            if outcome == "done":
                return False
        log.warning("session %s: interrupt did not stop the run; restarting its kernel", s.info.session_id)
        await self._restart_kernel(s)
        return True

    async def _replace_kernel(self, s: LiveSession) -> None:
        timeout = self.settings.sessions.kernel_start_timeout_seconds
        if s.conn is not None:
            await s.conn.close()
        with contextlib.suppress(KernelmodeError):
            await self.gateway.shutdown_kernel(s.kernel_id)
        pop_death_record(self.state_dir, s.kernel_id)
        s.kernel_id = str(uuid.uuid4())
        s.info.kernel_id = s.kernel_id
        s.state_lost_pending = True
        params = KernelParams(workspace=s.workspace, limits=s.info.limits, session_id=s.info.session_id)
        await self.gateway.start_kernel(s.kernel_id, params.to_env(), timeout)
        await self._connect(s, timeout)
        self.store.save(s.info, s.kernel_id, s.workspace)
        log.warning("session %s: its kernel was replaced (now %s)", s.info.session_id, s.kernel_id)
        audit("kernel_replaced", session_id=s.info.session_id, tenant=s.info.tenant, kernel_id=s.kernel_id)

    async def _restart_kernel(self, s: LiveSession) -> None:
        timeout = self.settings.sessions.kernel_start_timeout_seconds
        s.needs_ready = True
        try:
            await self.gateway.restart_kernel(s.kernel_id, timeout)
            await self._connect(s, timeout)
            audit("kernel_restarted", session_id=s.info.session_id, tenant=s.info.tenant,
                  kernel_id=s.kernel_id)
        except KernelmodeError as e:
            log.error("session %s: kernel restart failed: %s", s.info.session_id, e)
            s.kernel_state = KERNEL_DEAD

    async def _death_cause(self, s: LiveSession) -> DeathCause:
        """The provisioner's record of why the kernel died (it may take a moment to appear)."""
        deadline = time.monotonic() + 3 * self.settings.gateway.poll_interval_seconds + 1.0
        while time.monotonic() < deadline:
            cause = pop_death_record(self.state_dir, s.kernel_id)
            if cause is not None:
                return cause
            await asyncio.sleep(0.05)
        return DeathCause(kind="unknown")

    # -- files -----------------------------------------------------------------------------------
    async def upload(self, session_id: str, path: str, body: BinaryIO, size: int, overwrite: bool) -> UploadResult:
        """Write ``size`` bytes read from ``body`` to the workspace (atomically)."""
        s = self._session(session_id)
        rel = clean_path(path)
        ws = s.workspace_view()
        cap = s.info.limits.disk_mb * 1024 * 1024
        used, count = await asyncio.to_thread(ws.usage)
        if used + size > cap:
            raise WorkspaceFull(f"the workspace would exceed its {s.info.limits.disk_mb} MB "
                                f"({used} bytes used); delete files or ask for a larger disk_mb")
        if count >= self.settings.sessions.max_workspace_files:
            raise WorkspaceFull(f"the workspace holds its maximum of {count} files")
        chunks = iter(lambda: body.read(1 << 20), b"")
        shown = await asyncio.to_thread(ws.write, rel, chunks, overwrite)
        # An upload is an input, not something a run made: not an artifact of the next run.
        entry = await asyncio.to_thread(ws.entry, rel)
        if entry is not None:
            s.files[str(rel)] = entry
        return UploadResult(path=shown, size_bytes=size)

    async def list_files(self, session_id: str) -> FileList:
        """The workspace's files, as far as its bounded walk got (``note`` says where it stopped)."""
        s = self._session(session_id)
        files = await asyncio.to_thread(s.workspace_view().scan)
        return FileList(files=[WorkspaceFile.model_validate(e.info()) for _, e in sorted(files.items())],
                        truncated=files.stopped is not None, note=files.stopped)

    def open_file(self, session_id: str, path: str) -> tuple[int, int, str]:
        """(fd, size, mime type) of a workspace file, opened without following links."""
        s = self._session(session_id)
        rel = clean_path(path)
        fd, st = s.workspace_view().open_file(rel)
        return fd, st.st_size, mime_type(rel.name)

    async def artifacts(self, session_id: str) -> list[Artifact]:
        """Artifacts of the session's runs (also after the session was deleted), fresh links."""
        if self.harvester is None:
            return []
        runs = self.store.runs(session_id)
        if not runs and session_id not in self._live and self.store.get(session_id) is None:
            raise SessionNotFound(f"no session {session_id!r}")
        kept = [await self.harvester.relink(session_id, r.run_id, a) for _, r in runs for a in r.artifacts]
        return kept + [await self.harvester.relink(session_id, SESSION_FILES, a)
                       for a in self.store.session_files(session_id)]

    def notebook(self, session_id: str, out: BinaryIO) -> None:
        """Write the session's runs as an .ipynb to ``out`` (also after the session was deleted),
        one run at a time from the store: memory holds one run's output, not the history's."""
        runs = self.store.run_count(session_id)
        info = self._live[session_id].info if session_id in self._live else self.store.get(session_id)
        if info is None and not runs:
            raise SessionNotFound(f"no session {session_id!r}")
        # Imported here: nbformat's jsonschema costs seconds of start-up otherwise (embedded MCP).
        from .. import notebook

        notebook.write_notebook(out, session_id, info, self.store.history_iter(session_id), runs)

    async def _keep_notebook(self, session_id: str, name: str) -> Artifact:
        assert self.harvester is not None
        with tempfile.TemporaryFile(dir=self.harvester.scratch) as f:
            await asyncio.to_thread(self.notebook, session_id, f)
            f.seek(0)
            data = await asyncio.to_thread(f.read)
        from ..notebook import MIME

        artifact = await self.harvester.keep_session_file(session_id, name, data, MIME)
        self.store.add_session_file(session_id, artifact)
        return artifact

    async def export_notebook(self, session_id: str) -> Artifact:
        """Keep the session's notebook as it is now among its artifacts, with a download link."""
        if self.harvester is None:
            raise KernelUnavailable("this server keeps no artifacts")
        stamp = _now().strftime("%Y%m%d-%H%M%S")
        try:
            return await self._keep_notebook(session_id, f"notebook-{stamp}.ipynb")
        except StoreError as e:
            raise KernelUnavailable(f"the artifact store failed: {e}") from e

    async def find_artifact(self, session_id: str, ref: str) -> tuple[str, Artifact] | None:
        """(run id, artifact with a fresh link) of the latest artifact whose path is ``ref``."""
        if self.harvester is None:
            return None
        rel = ref.removeprefix("/mnt/data/").lstrip("/")
        for _, r in reversed(self.store.runs(session_id)):
            for a in r.artifacts:
                if a.path == ref or a.path.removeprefix("/mnt/data/") == rel:
                    return r.run_id, await self.harvester.relink(session_id, r.run_id, a)
        for a in reversed(self.store.session_files(session_id)):
            if a.path == rel:
                return SESSION_FILES, await self.harvester.relink(session_id, SESSION_FILES, a)
        return None

    async def artifact_bytes(self, session_id: str, run_id: str, artifact: Artifact) -> bytes:
        assert self.harvester is not None
        return await self.harvester.fetch(session_id, run_id, artifact)

    # -- interrupt / restart -----------------------------------------------------------------------
    async def interrupt(self, session_id: str) -> SessionInfo:
        s = self._session(session_id)
        s.interrupt_requested = True
        if not s.cell_started and not s.console_cells:
            s.interrupt_held = True  # the run sends it when its cell starts
        else:  # the run's cell, or a person's console cell, is what the kernel is running
            await self.gateway.interrupt_kernel(s.kernel_id)
        return s.info

    async def _quiet_interrupt(self, s: LiveSession) -> None:
        try:
            await self.gateway.interrupt_kernel(s.kernel_id)
        except KernelmodeError as e:
            log.warning("session %s: interrupt not delivered: %s", s.info.session_id, e)

    async def restart(self, session_id: str) -> SessionInfo:
        """Restart the kernel now (a running call ends as ``interrupted`` with state lost)."""
        s = self._session(session_id)
        if s.conn is not None:
            s.conn.broadcast({"msg_type": _KERNEL_STATUS, "state": "restarted"})
        s.info.status = "restarting"
        await self._restart_kernel(s)
        s.state_lost_pending = True
        if not s.lock.locked():
            s.info.status = "idle" if s.kernel_state != KERNEL_DEAD else "dead"
        s.touch()
        self.store.save(s.info, s.kernel_id, s.workspace)
        return s.info

    # -- reaping -----------------------------------------------------------------------------------
    async def reap_expired(self) -> list[str]:
        now = _now()
        expired = [sid for sid, s in self._live.items()
                   if not s.lock.locked() and s.info.expires_at and s.info.expires_at <= now]
        for sid in expired:
            log.info("session %s expired after %d s idle", sid, self._live[sid].info.ttl_seconds)
            with contextlib.suppress(SessionNotFound):
                await self.delete(sid, reason="expired")
        return expired

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sessions.reap_interval_seconds)
            try:
                await self.reap_expired()
            except Exception:
                log.exception("reaper pass failed")
