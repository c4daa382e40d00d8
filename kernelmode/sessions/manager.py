"""SessionManager: the core every front door calls. It holds the live sessions and composes the
rooms that do the work: ``kernels`` (one kernel's lifecycle), ``pool`` (warm kernels),
``runner`` (a run from submit to RunResult), ``files`` (workspace, artifacts, notebook),
``recovery`` (adoption after a restart) and ``reaper``. Here: create, get, delete, authorize,
and delegation.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import uuid
from collections import Counter as Tally
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

from ..artifacts.base import StoreError
from ..artifacts.harvester import Harvester
from ..artifacts.volume import WorkspaceVolumes
from ..audit import audit
from ..config import ADMIN_TENANT, Settings
from ..errors import (
    KernelmodeError,
    KernelUnavailable,
    QuotaExceeded,
    RunNotFound,
    SessionExists,
    SessionNotFound,
    TooManySessions,
)
from ..gateway.client import KERNEL_DEAD, GatewayClient
from ..gateway.exchange import KERNEL_STATUS_EVENT, RESTARTED
from ..metrics import Metrics
from ..models import Artifact, FileList, RunResult, SessionCreate, SessionInfo, UploadResult
from ..sandbox import cgroups
from ..tenants import ADMIN, Principal
from ..tools.broker import ToolBroker
from . import recovery
from .files import SessionFiles
from .kernels import Kernels
from .live import LiveSession, now
from .pool import WarmPool
from .reaper import Reaper, expired
from .runner import Runner
from .runs import LiveRun
from .store import SessionStore

log = logging.getLogger("kernelmode.sessions")

__all__ = ["LiveSession", "SessionManager"]


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
        self._strays: asyncio.Task[None] | None = None
        self.metrics = Metrics()
        self.kernels = Kernels(settings, gateway, self.volumes, state_dir, broker)
        self.pool = WarmPool(settings, self.kernels, sandbox)
        self.runner = Runner(settings, store, harvester, self.metrics, self._live, self.kernels.collector)
        self.runs = self.runner.runs
        self.files = SessionFiles(settings, store, harvester, self._live.get)
        self.reaper = Reaper(settings.sessions.reap_interval_seconds, self.reap_expired)
        self.metrics.watch(self._gauges)  # after the rooms: registering reads the gauges once
        # Where each kernel's memory use can be read (its cgroup), if anywhere.
        self._cgroups = cgroups.detect() if sandbox == "bwrap" and settings.sandbox.cgroups != "off" else None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, running_kernels: set[str] | frozenset[str] = frozenset()) -> None:
        """``running_kernels``: kernels of an adopted gateway (left by a crashed manager); the
        sessions they belong to are taken over with their variables, the rest become ``lost``."""
        adoptable = recovery.adoptable(self.store, running_kernels)
        lost = self.store.mark_all_lost(keep={i.session_id for i in adoptable})
        if lost:
            log.info("%d session(s) of a previous run are marked lost", lost)
        self.workspaces.mkdir(parents=True, exist_ok=True)
        self.workspaces.chmod(0o711)
        keep_mounted = {w for i in adoptable if (w := self.store.workspace(i.session_id)) is not None}
        self.quota = await asyncio.to_thread(self.volumes.start, keep_mounted)
        log.info("workspace quota: %s", self.quota)
        in_flight = {r.session_id: r for r in self.store.runs_in_flight()}
        for s in await recovery.adopt(self.kernels, self.store, adoptable, in_flight):
            self._live[s.info.session_id] = s
        recovery.end_interrupted_runs(self.store, in_flight, set(self._live))
        strays = running_kernels - {s.kernel_id for s in self._live.values()}
        if strays:  # pool kernels of the dead manager, and the like: after start, in the background
            self._strays = asyncio.create_task(self._shut_down(strays), name="strays")
        # Workspaces of kernels that belong to no session (a previous run's pool) are litter.
        keep = self.store.workspaces()
        for d in self.workspaces.iterdir():
            if d.suffix != ".img" and d not in keep:
                await asyncio.to_thread(self.volumes.destroy, d)
        self.reaper.start()
        self.pool.refill()

    async def stop(self) -> None:
        await self.reaper.stop()
        if self._strays is not None:
            self._strays.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._strays
        for s in list(self._live.values()):
            self.store.mark_lost(s.info)
        # At once, not one by one: an MCP client gives its stdio server 2 s to exit. The kernels
        # of live sessions keep running (a successor may adopt them); only pool kernels go.
        await asyncio.gather(*(s.conn.close() for s in self._live.values() if s.conn),
                             self.pool.stop(), return_exceptions=True)
        await asyncio.to_thread(self.volumes.sweep, {s.workspace for s in self._live.values()})
        self._live.clear()

    async def _shut_down(self, kernel_ids: set[str] | frozenset[str]) -> None:
        for kernel_id in kernel_ids:
            with contextlib.suppress(KernelmodeError):
                await self.gateway.shutdown_kernel(kernel_id)
        # Their workspaces are no session's: the start-up sweep of workspaces/ removed them.

    async def gateway_lost(self) -> None:
        """The Kernel Gateway died, and every kernel with it: each session is marked ``dead``
        (its next run gets a fresh kernel on the same workspace and reports ``state_lost``), and
        the warm pool is dropped (refilled once a new gateway answers)."""
        for s in list(self._live.values()):
            if s.conn is not None:
                await s.conn.close()
            s.kernel.on_status(KERNEL_DEAD)
            self.store.save(s.info, s.kernel_id, s.workspace)
        await self.pool.drop(shutdown=False)

    def gateway_back(self) -> None:
        self.pool.refill()

    @property
    def pool_size(self) -> int:
        """Warm kernels ready now (the configured size is ``settings.sessions.pool_size``)."""
        return self.pool.ready

    # -- queries -----------------------------------------------------------------------------------
    def _gauges(self) -> tuple[dict[str, int], int, int]:
        by_status: dict[str, int] = dict(Tally(str(s.info.status) for s in self._live.values()))
        by_status["lost"] = sum(1 for i in self.store.all() if i.status == "lost")
        return by_status, self.pool.ready, self.pool.size

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

    def status(self, session_id: str) -> str:
        """A session's status alone (``get`` without its usage figures, read from the cgroup)."""
        live = self._live.get(session_id)
        info = live.info if live is not None else self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return str(info.status)

    def live_session(self, session_id: str) -> LiveSession:
        """The live session (SessionNotFound, or KernelUnavailable when it is lost)."""
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
    def _check_room(self, sid: str, principal: Principal) -> None:
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

    async def create(self, req: SessionCreate, principal: Principal = ADMIN) -> SessionInfo:
        sid = req.session_id or uuid.uuid4().hex
        tenant = principal.tenant
        self._check_room(sid, principal)
        self.broker.registry.check_allow_list(req.tools)
        limits = principal.limits(req.limits, self.settings.sandbox)  # 422 above a ceiling
        ttl = req.ttl_seconds or self.settings.sessions.ttl_seconds
        t = now()
        info = SessionInfo(
            session_id=sid, status="idle", created_at=t, last_activity=t,
            expires_at=t + timedelta(seconds=ttl), ttl_seconds=ttl, limits=limits,
            sandbox=self.sandbox, tools=req.tools, tenant=tenant,
        )
        self._creating[sid] = tenant
        try:
            k = await self.pool.claim(limits)
            if k is not None:
                info.from_pool = True
                k.info = info
                self.pool.refill(delay=self.settings.sessions.pool_refill_delay_seconds)
                if req.tools is not None:  # the pool kernel's preamble offers every tool
                    try:
                        await k.install_preamble(self.kernels.start_timeout)
                    except BaseException:
                        await k.discard()
                        raise
            else:
                k = await self.kernels.new(info)
        finally:
            self._creating.pop(sid, None)
        info.kernel_id = k.kernel_id
        s = self._live[sid] = LiveSession(kernel=k)
        self.metrics.sessions_created.labels("true" if info.from_pool else "false", tenant).inc()
        self.store.take_id(sid, tenant)  # runs of an earlier session with this id are not this one's
        self.store.save(info, s.kernel_id, s.workspace)
        log.info("session %s created (kernel %s, tenant %s)", sid, s.kernel_id, tenant)
        audit("session_created", session_id=sid, tenant=tenant, kernel_id=s.kernel_id,
              from_pool=info.from_pool, sandbox=self.sandbox)
        return info

    async def delete(self, session_id: str, keep_notebook: bool = True, reason: str = "closed") -> None:
        """Stop the session's kernel and remove its workspace; its history is kept as a notebook
        among its artifacts (``keep_notebook``) and its runs stay in the store."""
        if keep_notebook and self.harvester is not None and session_id in self._live and \
                self.store.has_runs(session_id):
            try:
                await self.files.keep_notebook(session_id, "notebook.ipynb")
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
            await s.kernel.discard()
            self.broker.forget_session(session_id)
        self.store.delete(session_id)
        self.metrics.sessions_ended.labels(reason, tenant or ADMIN_TENANT).inc()
        log.info("session %s deleted (%s)", session_id, reason)
        audit("session_closed", session_id=session_id, tenant=tenant, reason=reason)

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

    # -- running code (runner) ---------------------------------------------------------------------
    def submit(self, session_id: str, code: str, timeout_seconds: float | None = None) -> LiveRun:
        """Start a run in its own task and return it at once (it queues behind earlier runs)."""
        return self.runner.submit(self.live_session(session_id), code, timeout_seconds)

    async def execute(self, session_id: str, code: str, timeout_seconds: float | None = None,
                      wait_seconds: float | None = None) -> RunResult:
        """Run code; wait for the end, or at most ``wait_seconds`` (then status ``running``)."""
        return await self.wait(self.submit(session_id, code, timeout_seconds), wait_seconds)

    @staticmethod
    async def wait(run: LiveRun, wait_seconds: float | None = None) -> RunResult:
        """The run's result once it ends, or its snapshot (``running``) after ``wait_seconds``."""
        return await Runner.wait(run, wait_seconds)

    async def one_shot(self, code: str, files: list[tuple[str, bytes]], timeout_seconds: float | None = None,
                       tools: list[str] | None = None, principal: Principal = ADMIN) -> RunResult:
        """Run code in a fresh kernel (from the warm pool when there is one), then discard it.

        The result's artifacts stay in the store under the throw-away session's id.
        """
        self.runner.timeout(timeout_seconds)  # refuse a bad timeout before taking a kernel
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

    def get_run(self, run_id: str, principal: Principal = ADMIN) -> LiveRun:
        """The run, if ``principal`` may see its session (another tenant's run is unknown)."""
        run = self.runner.find(run_id)
        if run is None or not self.may_see(principal, run.session_id):
            raise RunNotFound(f"no run {run_id!r} (finished runs stay for "
                              f"{self.settings.sessions.run_retention_seconds:g} s)")
        return run

    # -- interrupt / restart -----------------------------------------------------------------------
    async def interrupt(self, session_id: str) -> SessionInfo:
        s = self.live_session(session_id)
        if s.kernel.latch.request(console_busy=s.console_cells > 0):
            await s.kernel.interrupt()
        return s.info

    async def restart(self, session_id: str) -> SessionInfo:
        """Restart the kernel now (a running call ends as ``interrupted`` with state lost)."""
        s = self.live_session(session_id)
        if s.conn is not None:
            s.conn.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": RESTARTED})
        s.info.status = "restarting"
        await s.kernel.restart()
        if not s.lock.locked():
            s.info.status = "idle" if s.kernel.state != KERNEL_DEAD else "dead"
        s.touch()
        self.store.save(s.info, s.kernel_id, s.workspace)
        return s.info

    # -- files (files) -----------------------------------------------------------------------------
    async def upload(self, session_id: str, path: str, body: BinaryIO, size: int, overwrite: bool) -> UploadResult:
        """Write ``size`` bytes read from ``body`` to the workspace (atomically)."""
        return await self.files.upload(self.live_session(session_id), path, body, size, overwrite)

    async def list_files(self, session_id: str) -> FileList:
        """The workspace's files, as far as its bounded walk got (``note`` says where it stopped)."""
        return await self.files.list_files(self.live_session(session_id))

    def open_file(self, session_id: str, path: str) -> tuple[int, int, str]:
        """(fd, size, mime type) of a workspace file, opened without following links."""
        return self.files.open_file(self.live_session(session_id), path)

    async def artifacts(self, session_id: str) -> list[Artifact]:
        """Artifacts of the session's runs (also after the session was deleted), fresh links."""
        return await self.files.artifacts(session_id)

    def notebook(self, session_id: str, out: BinaryIO) -> None:
        """Write the session's runs as an .ipynb to ``out`` (also after the session was deleted)."""
        self.files.notebook(session_id, out)

    async def export_notebook(self, session_id: str) -> Artifact:
        """Keep the session's notebook as it is now among its artifacts, with a download link."""
        return await self.files.export_notebook(session_id)

    async def find_artifact(self, session_id: str, ref: str) -> tuple[str, Artifact] | None:
        """(run id, artifact with a fresh link) of the latest artifact whose path is ``ref``."""
        return await self.files.find_artifact(session_id, ref)

    async def artifact_bytes(self, session_id: str, run_id: str, artifact: Artifact) -> bytes:
        return await self.files.artifact_bytes(session_id, run_id, artifact)

    # -- reaping -----------------------------------------------------------------------------------
    async def reap_expired(self) -> list[str]:
        gone = expired(self._live, now())
        for sid in gone:
            log.info("session %s expired after %d s idle", sid, self._live[sid].info.ttl_seconds)
            with contextlib.suppress(SessionNotFound):
                await self.delete(sid, reason="expired")
        return gone
