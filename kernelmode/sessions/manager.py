"""SessionManager: the core every front door calls. It owns the live sessions (``live``: only
this module, creation, ownership, takeover and rebalance add or remove one; the rest get a read-only view)
and composes the rooms that do the work: ``creation`` (a create), ``kernels`` (one kernel's lifecycle), ``pool`` (warm kernels),
``runner`` (a run from submit to RunResult), ``drain`` (a stop's first step), ``files`` (workspace, artifacts, notebook),
``forks`` (checkpoints on demand, forks, resume), ``gateway_loss`` (what a gateway's failure
means to the sessions), ``admission`` (ids and caps), ``listing`` (pages), ``lifecycle`` (start
and stop), ``recovery`` (adoption after a restart), ``reaper``, ``ownership`` (leases, when
managers share a store), ``takeover`` (what dead managers left) and ``rebalance`` (idle sessions
handed to an underloaded manager). Here: get, delete,
authorize, and delegation: the front doors call only this facade.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter as Tally
from pathlib import Path
from typing import Any, BinaryIO

from ..artifacts.channel import Download
from ..artifacts.harvester import Harvester
from ..artifacts.volume import WorkspaceVolumes
from ..audit import audit
from ..code_policy import CodePolicy
from ..config import ADMIN_TENANT, Settings
from ..errors import (
    KernelmodeError,
    KernelUnavailable,
    RunNotFound,
    SessionNotFound,
    SessionOwnedElsewhere,
    StoreError,
)
from ..gateway.client import GatewayClient
from ..gateway.exchange import KERNEL_STATUS_EVENT, RESTARTED
from ..metrics import Metrics
from ..models import (
    ApprovalAnswer,
    Artifact,
    CheckpointInfo,
    EgressNarrowing,
    FileList,
    PackagesResult,
    RunResult,
    SessionCreate,
    SessionInfo,
    SessionList,
    UploadResult,
)
from ..packages.service import PackageService
from ..protocol import PIP
from ..sandbox import cgroups
from ..tenants import ADMIN, Principal
from ..tools.broker import ToolBroker
from . import creation, listing
from .admission import Admission
from .checkpoints import Checkpoints
from .drain import Drain
from .egress_wiring import EgressWiring
from .files import SessionFiles
from .forks import Forks
from .gateway_loss import GatewayLoss
from .hibernation import Hibernation
from .kernel_env import Kernels
from .lifecycle import Lifecycle
from .live import LiveSession, LiveSessions
from .liveness import Liveness
from .one_shot import one_shot
from .ownership import Ownership
from .packages import SessionPackages
from .pool import WarmPool
from .readying import restart_asked
from .reaper import Reaper, reap_pass
from .rebalance import Rebalance
from .runner import Runner
from .runs import LiveRun, run_tag
from .store import SessionStore
from .takeover import Takeover

log = logging.getLogger("kernelmode.sessions")

__all__ = ["LiveSession", "SessionManager"]


class SessionManager:
    def __init__(self, settings: Settings, gateway: GatewayClient, store: SessionStore, data_dir: Path,
                 state_dir: Path, sandbox: str, broker: ToolBroker, harvester: Harvester | None = None,
                 policy: CodePolicy | None = None, ownership: Ownership | None = None) -> None:
        self.settings = settings
        self.ownership = ownership or Ownership(store, settings)  # which sessions are this manager's
        self.broker = broker
        self.harvester = harvester
        self.gateway = gateway
        self.store = store
        self.workspaces = data_dir / "workspaces"
        self.volumes = WorkspaceVolumes(self.workspaces, settings.sandbox.workspace_quota)
        self.quota = "off"
        self.state_dir = state_dir
        self.sandbox = sandbox
        self.live = LiveSessions()
        self.creating: dict[str, str] = {}  # session id -> tenant, while its kernel starts
        self.admission = Admission(settings, store, self.live, self.creating)
        self.metrics = Metrics(known_tool=broker.knows)
        self.packages = SessionPackages(PackageService(settings, data_dir, sandbox), self.live.get)
        broker.reserved[PIP] = self.packages.from_kernel  # %pip install in a cell
        self.egress = EgressWiring(settings, data_dir, self.metrics, data_dir / "run" if sandbox != "none" else None,
                                   store.egress_tokens)
        self.kernels = Kernels(settings, gateway, self.volumes, state_dir, broker, self.packages.service, self.egress)
        self.ownership.attach(self.live, self.kernels)  # leases taken on add, kernels marked
        # Where each kernel's memory use can be read (its cgroup), if anywhere.
        self._cgroups = cgroups.detect() if sandbox == "bwrap" and settings.sandbox.cgroups != "off" else None
        self.pool = WarmPool(
            settings, self.kernels, sandbox,
            busy=lambda: bool(self.creating) or any(s.info.status == "busy" for s in self.live),
            room=lambda: settings.sessions.max_sessions - self.admission.count,
            usage=self._kernel_memory, usable=self.ownership.fresh)
        self.ownership.revived = self._pool_again
        self.checkpoints = Checkpoints(settings, store, harvester.store if harvester else None,
                                       harvester.scratch if harvester else state_dir)
        self.runner = Runner(settings, store, harvester, self.metrics, self.live, self.kernels.collector,
                             broker.approvals, policy, before_run=self.checkpoints.before_run,
                             after_run=self.checkpoints.after_run, revive=self.live_session)
        if self.ownership.active:  # its runs' ids name it: another manager forwards their polls here
            self.runner.run_tag = run_tag(self.ownership.manager_id)
        self.runs = self.runner.runs
        self.drain = Drain(self.runs)  # a stop's first step: no new work, runs in flight finish
        self.reaper = Reaper(settings.sessions.reap_interval_seconds, self.reap_expired)
        self.files = SessionFiles(settings, store, harvester, self.live.get, self.live_session,
                                  self.checkpoints.reseed)
        self.forks = Forks(self)
        self.gateway_loss = GatewayLoss(self.live, self.pool, store)
        self.lifecycle = Lifecycle(self, self.live)
        self.ownership.scan = Takeover(self, self.live).scan
        self.rebalance = Rebalance(self, self.live)  # idle sessions handed to an underloaded manager
        if self.rebalance.enabled:
            self.ownership.rebalance = self.rebalance.round
        self.hibernation = Hibernation(settings, store, self.checkpoints, self.kernels, self.live)
        self.liveness = Liveness(settings, self.live, self.pool,
                                 lambda s: self.store.save(s.info, s.kernel_id, s.workspace))
        self.metrics.watch(self._gauges)  # after the rooms: registering reads the gauges once

    def _kernel_memory(self, kernel_id: str) -> int | None:
        """A kernel's memory use in bytes, from its cgroup (None where none can be read)."""
        return None if self._cgroups is None else cgroups.existing(kernel_id, self._cgroups).memory_bytes()

    # -- lifecycle (lifecycle) ---------------------------------------------------------------------
    async def start(self, running_kernels: set[str] | frozenset[str] = frozenset()) -> None:
        """``running_kernels``: kernels of an adopted gateway (left by a crashed manager); the
        sessions they belong to are taken over with their variables, the rest become ``lost``."""
        await self.ownership.start()  # alive in the store before anything is taken
        for s in await self.lifecycle.adopt(running_kernels):
            self.live.add(s)
        await self.lifecycle.begin(running_kernels)
        self.ownership.run()  # heartbeat; adoption of what dead managers leave (takeover.py)

    async def stop(self, keep_sessions: bool = False) -> None:
        """``keep_sessions``: their kernels outlive this manager (an external gateway keeps them),
        so they stay adoptable by the next `serve` instead of being marked lost."""
        await self.lifecycle.stop(keep_sessions)
        self.live.clear()
        await self.ownership.stop()

    # -- the gateway's failures (gateway_loss) -----------------------------------------------------
    async def gateway_lost(self) -> None:
        """The Kernel Gateway died, and every kernel with it: sessions are marked ``dead`` (their
        next run reports ``state_lost``), the warm pool dropped."""
        await self.gateway_loss.lost()

    def gateway_back(self) -> None:
        self.gateway_loss.back()

    def kernels_vanished(self, running: set[str]) -> bool:
        """Whether a live session's kernel is gone from an external gateway's list."""
        return self.gateway_loss.vanished(running)

    async def external_gateway_back(self, running: set[str]) -> tuple[list[str], list[str]]:
        """An external gateway answers again: (session ids that survived, those lost)."""
        return await self.gateway_loss.external_back(running)

    async def _pool_again(self) -> None:
        """This manager was dead to the others for a while: its warm kernels may be gone."""
        await self.pool.drop()
        self.pool.refill()

    @property
    def pool_size(self) -> int:
        """Warm kernels ready now (the configured size is ``settings.sessions.pool_size``)."""
        return self.pool.ready

    # -- queries -----------------------------------------------------------------------------------
    def _gauges(self) -> tuple[dict[str, int], int, int]:
        by_status: dict[str, int] = dict(Tally(str(s.info.status) for s in self.live))
        stored = self.store.status_counts()
        by_status["lost"], by_status["hibernated"] = stored.get("lost", 0), stored.get("hibernated", 0)
        return by_status, self.pool.ready, self.pool.size

    def _with_usage(self, s: LiveSession) -> SessionInfo:
        if self._cgroups is None:
            return s.info
        memory = cgroups.existing(s.kernel_id, self._cgroups).memory_bytes()
        return s.info.model_copy(update={"memory_bytes": memory})

    def with_kernels(self, principal: Principal = ADMIN) -> list[SessionInfo]:
        """The sessions ``principal`` may see that hold a kernel (live) or can wake one
        (hibernated), in creation order: the lost ones, most of a long-lived store, are not read."""
        live = {s.info.session_id: self._with_usage(s) for s in self.live if principal.may_see(s.info.tenant)}
        asleep = [i for i in self.store.hibernated(None if principal.admin else principal.tenant)
                  if i.session_id not in live]
        return sorted([*live.values(), *asleep], key=lambda i: (i.created_at, i.session_id))

    def page(self, principal: Principal = ADMIN, limit: int = listing.DEFAULT_LIMIT,
             cursor: str | None = None, newest_first: bool = False) -> SessionList:
        """One page of the sessions ``principal`` may see, after ``cursor`` (listing.py)."""
        shown, next_cursor = listing.page_from(self.store.page, principal, limit, cursor, newest_first)
        # The store orders and filters; a live session's own info (status, usage) is the one shown.
        return SessionList(sessions=[i if (s := self.live.get(i.session_id)) is None else self._with_usage(s)
                                     for i in shown], next_cursor=next_cursor)

    def may_see(self, principal: Principal, session_id: str) -> bool:
        if principal.admin:
            return True
        live = self.live.get(session_id)
        return principal.may_see(live.info.tenant if live is not None else self.store.owner(session_id))

    def authorize(self, principal: Principal, session_id: str) -> None:
        """Another tenant's session id is answered exactly like an unknown one."""
        if not self.may_see(principal, session_id):
            raise SessionNotFound(f"no session {session_id!r}")

    def get(self, session_id: str) -> SessionInfo:
        if (s := self.live.get(session_id)) is not None:
            return self._with_usage(s)
        info = self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return info

    def status(self, session_id: str) -> str:
        """A session's status alone (``get`` without its usage figures, read from the cgroup)."""
        live = self.live.get(session_id)
        info = live.info if live is not None else self.store.get(session_id)
        if info is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return str(info.status)

    def live_session(self, session_id: str) -> LiveSession:
        """The live session (SessionNotFound, or KernelUnavailable when it is lost)."""
        s = self.live.get(session_id)
        if s is None:
            info = self.store.get(session_id)
            if info is None:
                raise SessionNotFound(f"no session {session_id!r}")
            if info.status == "hibernated":
                self.drain.check("waking a hibernated session")  # another manager wakes it
                self.admission.check_wake(session_id, info.tenant)  # a wake is an admission
                self.ownership.claim(session_id)  # one manager wakes it
                s = self.hibernation.wake(info)  # its next run starts a kernel and restores
                self.live.add(s)
                return s
            raise self.ownership.refusal(info) or KernelUnavailable(
                f"session {session_id!r} is {info.status}: its kernel is gone (the server restarted); "
                "delete it and create a new one"
            )
        return s

    def peek(self, session_id: str) -> LiveSession | None:
        """The live session, or None; never wakes a hibernated one (for listings)."""
        return self.live.get(session_id)

    # -- create / delete ---------------------------------------------------------------------------
    async def create(self, req: SessionCreate, principal: Principal = ADMIN) -> SessionInfo:
        """A new live session (creation.py); a fork of ``fork_of`` or of ``from_checkpoint``."""
        return await creation.create(self, req, principal)

    async def install_packages(self, session_id: str, packages: list[str], source: str = "rest") -> PackagesResult:
        """Install packages into the session's layer (visible to its kernel at once)."""
        return await self.packages.install(self.live_session(session_id), packages, source)

    async def delete(self, session_id: str, keep_notebook: bool = True, reason: str = "closed") -> None:
        """Stop the session's kernel and remove its workspace; its history is kept as a notebook
        among its artifacts (``keep_notebook``) and its runs stay in the store."""
        if keep_notebook and self.harvester is not None and session_id in self.live and \
                self.store.has_runs(session_id):
            try:
                await self.files.keep_notebook(session_id, "notebook.ipynb")
            except (KernelmodeError, StoreError) as e:
                log.warning("session %s: the notebook could not be kept: %s", session_id, e)
        s = self.live.remove(session_id)
        tenant = s.info.tenant if s is not None else self.store.owner(session_id)
        if s is None:
            workspace = self.store.workspace(session_id)
            if (stored := self.store.get(session_id)) is None:
                raise SessionNotFound(f"no session {session_id!r}")
            if (refused := self.ownership.refusal(stored)) is not None:
                raise refused  # live on another manager: deleted there, never under it
            if workspace is not None:  # a lost or hibernated session: only its files are left
                with contextlib.suppress(KernelmodeError):
                    await asyncio.to_thread(self.volumes.destroy, workspace)
                await asyncio.to_thread(self.packages.service.layer(workspace.name).destroy)
        else:
            await s.kernel.discard()
            self.broker.forget_session(session_id)
        await self.egress.detach(session_id)
        await self.checkpoints.forget(session_id)
        self.store.delete(session_id)
        self.metrics.sessions_ended.labels(reason, tenant or ADMIN_TENANT).inc()
        log.info("session %s deleted (%s)", session_id, reason)
        audit("session_closed", session_id=session_id, tenant=tenant, reason=reason)

    def record_console_run(self, s: LiveSession, code: str, result: RunResult,
                           events: list[dict[str, Any]]) -> None:
        """A run typed in an attached console: in the session's history like any other."""
        if s.info.session_id not in self.live:
            return
        try:
            self.store.add_run(code, result, events)
            self.store.save(s.info, s.kernel_id, s.workspace)
        except SessionOwnedElsewhere:  # taken over meanwhile: dropped here, its console closed
            return
        self.metrics.observe_run(result, s.info.tenant or ADMIN_TENANT, source="console")
        audit("console_run", session_id=s.info.session_id, tenant=s.info.tenant, run_id=result.run_id,
              status=result.status)

    # -- running code (runner) ---------------------------------------------------------------------
    def submit(self, session_id: str, code: str, timeout_seconds: float | None = None,
               approvals: bool = True) -> LiveRun:
        """Start a run in its own task and return it at once (it queues behind earlier runs)."""
        self.drain.check("a new run")
        return self.runner.submit(self.live_session(session_id), code, timeout_seconds, approvals)

    async def execute(self, session_id: str, code: str, timeout_seconds: float | None = None,
                      wait_seconds: float | None = None, approvals: bool = True) -> RunResult:
        """Run code; wait for the end, or at most ``wait_seconds`` (then status ``running``), or
        until an approval waits (status ``awaiting_approval``)."""
        return await self.wait(self.submit(session_id, code, timeout_seconds, approvals), wait_seconds)

    @staticmethod
    async def wait(run: LiveRun, wait_seconds: float | None = None) -> RunResult:
        """The run's result once it ends, or its snapshot (``running``) after ``wait_seconds``."""
        return await Runner.wait(run, wait_seconds)

    async def one_shot(self, code: str, files: list[tuple[str, bytes]], timeout_seconds: float | None = None,
                       tools: list[str] | None = None, principal: Principal = ADMIN,
                       egress: EgressNarrowing | None = None) -> RunResult:
        """Run code in a fresh kernel (from the warm pool when there is one), then discard it."""
        return await one_shot(self, code, files, timeout_seconds, tools, principal, egress)

    def get_run(self, run_id: str, principal: Principal = ADMIN) -> LiveRun:
        """The run, if ``principal`` may see its session (another tenant's run is unknown)."""
        run = self.runner.find(run_id)
        if run is None or not self.may_see(principal, run.session_id):
            raise RunNotFound(f"no run {run_id!r} (finished runs stay for "
                              f"{self.settings.sessions.run_retention_seconds:g} s)")
        return run

    def decide_approval(self, run_id: str, call_id: str, approve: bool, reason: str | None,
                        principal: Principal = ADMIN, by: str = "rest") -> ApprovalAnswer:
        """Answer a pending approval of a run ``principal`` may see (another tenant's: 404)."""
        run = self.get_run(run_id, principal)
        d = self.broker.approvals.decide(run.run_id, call_id, approve, reason, by)
        return ApprovalAnswer(run_id=run_id, call_id=call_id, approved=d.approved, reason=d.reason, by=d.by)

    # -- interrupt / restart -----------------------------------------------------------------------
    async def interrupt(self, session_id: str) -> SessionInfo:
        """Interrupt the running code. A run still waiting for the code policy's approval is
        refused; a tool call waiting for approval ends with the cell (KeyboardInterrupt)."""
        if session_id not in self.live and (info := self.get(session_id)).status == "hibernated":
            return info  # nothing runs, and an interrupt is no reason to wake it
        s = self.live_session(session_id)
        for run in self.runs.in_flight(session_id):
            if run.gate is not None:
                run.gate.deny_pending("interrupted", "interrupt", tool="policy:run")
        if s.kernel.needs_new:  # nothing runs (woken from hibernation, given up, or crashed)
            return s.info
        if s.kernel.latch.request(console_busy=s.console_cells > 0):
            await s.kernel.interrupt()
        return s.info

    async def restart(self, session_id: str) -> SessionInfo:
        """Restart the kernel now (a running call ends as ``interrupted`` with state lost)."""
        s = self.live_session(session_id)
        if s.conn is not None:
            s.conn.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": RESTARTED})
        s.info.status = "restarting"
        await restart_asked(s, self.runner.readying)
        if not s.lock.locked():
            s.info.status = "dead" if s.kernel.needs_new else "idle"
        s.touch()
        self.store.save(s.info, s.kernel_id, s.workspace)
        return s.info

    # -- files (files) -----------------------------------------------------------------------------
    async def upload(self, session_id: str, path: str, body: BinaryIO, size: int, overwrite: bool) -> UploadResult:
        """Write ``size`` bytes read from ``body`` to the workspace (atomically)."""
        return await self.files.upload(await self.files.ready(session_id), path, body, size, overwrite)

    async def list_files(self, session_id: str) -> FileList:
        """The workspace's files, as far as its bounded walk got (``note`` says where it stopped)."""
        return await self.files.list_files(await self.files.ready(session_id))

    async def open_file(self, session_id: str, path: str, max_bytes: int | None = None) -> tuple[Download, str]:
        """(download, mime type) of a workspace file: ``download.size``, then ``download.chunks()``."""
        return await self.files.open_file(await self.files.ready(session_id), path, max_bytes)

    async def delete_file(self, session_id: str, path: str) -> str:
        """Remove a workspace file; its path in the kernel (FileNotFound if there is none)."""
        return await self.files.delete_file(await self.files.ready(session_id), path)

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

    # -- checkpoints, forks, resume (forks) --------------------------------------------------------
    async def checkpoint(self, session_id: str, auto: bool = False) -> CheckpointInfo:
        """Save the session's variables and files now (after the runs queued before it)."""
        return await self.forks.checkpoint(session_id, auto)

    def list_checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        self.get(session_id)
        return self.checkpoints.list(session_id)

    async def resume(self, session_id: str) -> LiveSession:
        """The live session with its kernel running: a woken or dead one is started and restored
        now (a console attaches to a kernel, not to a plan for one)."""
        return await self.forks.resume(session_id)

    # -- reaping -----------------------------------------------------------------------------------
    async def reap_expired(self) -> list[str]:
        """Hibernate or delete what is due (reaper.py): the sessions hibernated or deleted."""
        return await reap_pass(self)

    async def _hibernate(self, session_id: str) -> bool:
        """Hibernate the session (under its lock) and take it out of the live ones; False when
        it is gone meanwhile or its state could not be saved (it stays live)."""
        s = self.live.get(session_id)  # a due session may be deleted while an earlier one sleeps
        if s is None:
            return False
        async with s.lock:
            if self.live.get(session_id) is not s or not await self.hibernation.hibernate(s):
                return False
            self.live.remove(session_id)
        return True
