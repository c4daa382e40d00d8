"""One kernel's lifecycle, one object per kernel (cf. jupyter_client's multikernelmanager and
restarter): start, connect, preamble, restart, replace, death cause, teardown, and its interrupt
latch. ``Kernels`` holds what every kernel shares and starts new ones.

The state a kernel carries is written here and nowhere else: whether it is alive (from the
gateway), whether it must be readied again (reconnect and preamble), whether the next result
must say that variables were lost, and whether an interrupt is held for a cell not started yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..artifacts.volume import WorkspaceVolumes
from ..audit import audit
from ..config import Settings
from ..errors import KernelmodeError, KernelUnavailable, SandboxUnavailable
from ..gateway.client import KERNEL_DEAD, GatewayClient, KernelConnection
from ..gateway.exchange import KERNEL_STATUS_EVENT, ExecuteExchange, Message, Outcome
from ..gateway.execution import OutputCollector
from ..gateway.launch import SAFE_VALUE, launch_env
from ..kernel.preamble import MARKER
from ..models import DeathCause, SessionInfo, ToolCall
from ..packages.layer import PackageLayer
from ..packages.service import PackageService
from ..sandbox.spec import ENV_SESSION, KernelParams, pop_death_record
from ..tools.base import ToolInfo
from ..tools.broker import ToolBroker
from .boot import kernel_boot
from .interrupts import InterruptLatch

__all__ = ["InterruptLatch", "Kernel", "Kernels"]

if TYPE_CHECKING:  # egress_wiring.py reads kernels: importing it here would be a cycle
    from .egress_wiring import EgressWiring

log = logging.getLogger("kernelmode.sessions")
REMOTE_ATTEMPT_SECONDS = 5.0  # a remote kernel's websocket that does not answer is replaced


@dataclass
class Kernels:
    """What every kernel shares (gateway, volumes, broker, settings); starts new kernels."""

    settings: Settings
    gateway: GatewayClient
    volumes: WorkspaceVolumes
    state_dir: Path
    broker: ToolBroker
    packages: PackageService | None = None  # the package layers, mounted into each kernel
    egress: EgressWiring | None = None  # the sessions' egress proxies, in the kernels' egress dirs
    # Background DELETEs of kernels given up (lost, or a failed start): nothing waits on them.
    retiring: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def remote(self) -> bool:
        """Kernels on a gateway the manager did not start (``gateway.url``): their workspaces
        live with them, none is made on this disk (no loop volume, no package layer)."""
        return self.settings.gateway.url is not None

    @property
    def start_timeout(self) -> float:
        gw = self.settings.gateway
        return gw.launch_timeout_seconds if gw.url else self.settings.sessions.kernel_start_timeout_seconds

    def collector(self) -> OutputCollector:
        cfg = self.settings.sessions
        return OutputCollector(cfg.max_output_bytes, max_display_bytes=cfg.max_display_bytes)

    def retire(self, kernel_id: str) -> None:
        """Ask the gateway to DELETE a kernel, in the background and bounded: a gateway whose
        node is gone can hold a DELETE for 30 s and then fail (Enterprise Gateway does)."""
        async def delete() -> None:
            try:
                await asyncio.wait_for(self.gateway.shutdown_kernel(kernel_id, self.settings.gateway.
                                                                    shutdown_timeout_seconds),
                                       self.settings.gateway.shutdown_timeout_seconds + 1)
            except (KernelmodeError, asyncio.TimeoutError) as e:
                log.warning("kernel %s: the gateway did not shut it down (%s); left to the gateway",
                            kernel_id, e)
                audit("kernel_orphaned", kernel_id=kernel_id, error=str(e)[:300])
            pop_death_record(self.state_dir, kernel_id)

        task = asyncio.create_task(delete(), name=f"retire-{kernel_id}")
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    async def new(self, info: SessionInfo) -> Kernel:
        """A started, connected, preamble-ready kernel: up to ``gateway.launch_attempts`` starts
        (a gateway with several nodes may place each on another), then KernelUnavailable (503)
        saying why the last one failed."""
        attempts = self.settings.gateway.launch_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self._start(info)
            except SandboxUnavailable:
                raise  # the sandbox refused these limits: another try gets the same answer
            except KernelmodeError as e:
                if attempt == attempts:
                    raise KernelUnavailable(f"could not start a kernel ({attempts} attempt(s)); "
                                            f"the last failed with: {e.message}") from e
                log.warning("kernel start %d of %d failed (%s); trying again", attempt, attempts, e.message)
                audit("kernel_start_failed", session_id=info.session_id, attempt=attempt, error=e.message[:300])
        raise AssertionError("unreachable")

    async def _start(self, info: SessionInfo) -> Kernel:
        """Start a sandboxed kernel with its own workspace, connect, install the preamble."""
        kernel_id = str(uuid.uuid4())
        workspace = self.volumes.root / kernel_id
        if self.remote:  # the gateway's kernel makes its own workspace
            return await self._start_kernel(Kernel(self, kernel_id, workspace, info))
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
        k = Kernel(self, kernel_id, workspace, info)
        if k.layer is not None:
            await asyncio.to_thread(k.layer.create)
        return await self._start_kernel(k)

    async def _start_kernel(self, k: Kernel) -> Kernel:
        kernel_id = k.kernel_id
        try:
            await asyncio.wait_for(self.launch(k), self.start_timeout + 5)
        except asyncio.TimeoutError:
            # A start past its deadline may still come up later: DELETEd in the background.
            await k.discard(shutdown=False)
            self.retire(kernel_id)
            raise KernelUnavailable(f"the kernel did not start within {self.start_timeout:g} s") from None
        except BaseException as e:
            cause = pop_death_record(self.state_dir, kernel_id)
            await k.discard(shutdown=False)
            self.retire(kernel_id)
            if cause is not None and isinstance(e, KernelmodeError):
                raise KernelUnavailable(f"the kernel died while starting ({cause.kind}): {e}") from e
            raise
        return k

    async def launch(self, k: Kernel) -> None:
        """Start ``k`` (its id) in the gateway and connect to it."""
        await self.gateway.start_kernel(k.kernel_id, k.start_env(), self.start_timeout)
        await k.connect(self.start_timeout)
        if self.egress is not None:  # its session's proxy moves into this kernel's egress dir
            await self.egress.attach(k)


class Kernel:
    """One kernel in the gateway, its websocket and its workspace, serving ``info`` (the
    session's, or a placeholder while the kernel waits in the warm pool)."""

    def __init__(self, env: Kernels, kernel_id: str, workspace: Path, info: SessionInfo) -> None:
        self.env = env
        self.kernel_id = kernel_id
        self.workspace = workspace
        self.info = info
        self.conn: KernelConnection | None = None
        self.state = "alive"  # alive | restarting | dead (from the gateway)
        self.needs_ready = False  # restarted or died: reconnect and install the preamble again
        self.state_lost = False  # the next result must say that variables are gone
        self.restore_pending = False  # died: the next run first restores the latest checkpoint
        # A remote kernel's workspace lives and dies with it on its node: after a death or a wake
        # the latest checkpoint's files go back first (Checkpoints.reseed).
        self.files_pending = False
        self.closed = False  # torn down: a run in progress must not wait for it
        self.lost_cause: DeathCause | None = None  # given up by the liveness probe (sessions/liveness.py)
        self.misses = 0  # liveness probes in a row without an answer
        self.silent_since: float | None = None  # loop time of the first of those
        self.tools_installed: str | None = None  # the tool specs (JSON) the preamble holds
        self._tools_infos: list[ToolInfo] = []  # the tool list tools_installed was made from
        self.latch = InterruptLatch()

    @property
    def ready(self) -> bool:
        """Alive, connected and preamble-ready (what a pool kernel must be to be handed out)."""
        return self.state == "alive" and not self.needs_ready and self.conn is not None and self.conn.is_open

    @property
    def layer(self) -> PackageLayer | None:
        """The session's package layer (keyed by its workspace, which a replaced kernel keeps)."""
        if self.env.packages is None or self.env.remote:
            return None
        return self.env.packages.layer(self.workspace.name)

    def params(self) -> KernelParams:
        return KernelParams(workspace=self.workspace, limits=self.info.limits, session_id=self.info.session_id,
                            packages=self.layer.site if self.layer is not None else None)

    def start_env(self) -> dict[str, str]:
        """What a kernel start sends: the sandbox's parameters, and to an external gateway the
        checked KERNEL_* launch parameters too (gateway/launch.py)."""
        if not self.env.remote:
            return self.params().to_env()
        # To a gateway the manager did not start, only checked values (launch.py): no JSON, no
        # host path. A remote kernel's workspace is its own; a kernelmode gateway reads the limits
        # from KERNEL_MEMORY_MB & co. (KernelParams.pop_from_env). KERNEL_ID: Enterprise Gateway
        # takes the id from there, not from the body.
        extra = {"KERNEL_ID": self.kernel_id}
        if SAFE_VALUE.fullmatch(self.info.session_id):  # else the label just goes without it
            extra[ENV_SESSION] = self.info.session_id
        return launch_env(self.info.tenant, self.info.limits, extra)

    def take_state_lost(self) -> bool:
        """Whether variables were lost since the last result said so (and forget it)."""
        lost, self.state_lost = self.state_lost, False
        return lost

    # -- connection and preamble -------------------------------------------------------------------
    async def connect(self, timeout: float) -> None:
        """A fresh websocket, kernel_info answered, the preamble installed."""
        if self.conn is not None:
            await self.conn.close()
        if self.env.remote:
            self.conn = None
            self.conn = await self._answering_connection(timeout)
        else:
            self.conn = await self.env.gateway.connect(self.kernel_id, self.on_status)
            await self.conn.kernel_info(timeout)
        self.tools_installed = None  # a new or restarted kernel has no preamble yet
        await self.install_preamble(timeout)
        self.needs_ready = False
        self.state = "alive"
        self.info.cause = None  # it answers: whatever befell its predecessor is over

    async def _answering_connection(self, timeout: float) -> KernelConnection:
        """A websocket whose kernel answers. Enterprise Gateway wires a websocket to the kernel
        process of the moment: one opened while it restarts a dead kernel (on another node)
        stays wired to the dead one and never answers, so a fresh one is tried every few s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            conn = await self.env.gateway.connect(self.kernel_id, self.on_status)
            try:
                await conn.kernel_info(max(0.5, min(REMOTE_ATTEMPT_SECONDS, deadline - loop.time())))
                return conn
            except KernelUnavailable:
                await conn.close()
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.2)  # a websocket that closes at once: no busy loop

    async def ensure_ready(self) -> bool:
        """Before a run: a fresh kernel if the gateway gave this one up (True: its id changed),
        else reconnect if needed."""
        if self.state == KERNEL_DEAD:
            # The gateway gave up restarting it (a crash loop) and forgot it: a fresh kernel
            # for the session, on the same workspace.
            await self.replace()
            return True
        if self.conn is None or not self.conn.is_open or self.needs_ready:
            # After a restart, a fresh websocket: the gateway then opens its ZMQ channels to the
            # new kernel's sockets instead of reusing ones bound to the old process.
            try:
                await self.connect(self.env.start_timeout)
            except KernelmodeError:
                if self.state != KERNEL_DEAD:
                    raise
                await self.replace()  # found lost meanwhile (the liveness probe)
                return True
        return False

    async def install_preamble(self, timeout: float) -> None:
        """Define ``tools`` in the kernel (again when the set of tools changed)."""
        infos = self.env.broker.registry.infos(self.info.tools)
        # Before every run: the same tools (the same objects, or equal ones) need no JSON made
        # of them (with 1,000 tools, ~10 ms a run); a list that differs is compared by its JSON.
        if self.tools_installed is not None and infos == self._tools_infos:
            return
        specs = [i.model_dump() for i in infos]
        digest = json.dumps(specs, sort_keys=True)
        if digest == self.tools_installed:
            self._tools_infos = infos
            return
        # The boot code ends with a ping over stdin. A kernel's stdin socket drops what it sends
        # before the gateway's stdin connection is up (ZMQ ROUTER), which would leave the first
        # tool call of a run blocked forever; so retry (after an interrupt) until it answers.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            outcome, collector = await self._run_boot(specs, min(deadline, loop.time() + 3.0))
            if outcome != "timeout" or loop.time() >= deadline:
                break
            log.info("session %s: stdin not connected yet; retrying the preamble", self.info.session_id)
        if outcome != "done" or collector.reply_status != "ok":
            detail = collector.error.evalue if collector.error else outcome
            raise KernelUnavailable(f"could not set up the kernel's tools: {detail}")
        self.tools_installed, self._tools_infos = digest, infos

    async def _run_boot(self, specs: list[dict[str, Any]], deadline: float) -> tuple[Outcome, OutputCollector]:
        assert self.conn is not None
        collector = self.env.collector()
        exchange = ExecuteExchange(collector, on_input=lambda msg: self.answer_input("preamble", msg, []))
        await exchange.send(self.conn, kernel_boot(specs, self.env.settings, self.info.limits), silent=True)
        try:
            outcome = await exchange.collect(deadline)
            if outcome == "timeout":
                # Unblock the kernel (waiting for a reply that was dropped) before a retry.
                with contextlib.suppress(KernelmodeError):
                    await self.interrupt()
                    await exchange.collect(asyncio.get_running_loop().time() + 2.0)
        finally:
            exchange.close()
        return outcome, collector

    async def answer_input(self, run_id: str, msg: Message, tool_calls: list[ToolCall]) -> None:
        """Answer an input_request of a run: a tool call from the preamble, else nothing."""
        broker, cap = self.env.broker, self.env.settings.tool_calls.max_recorded_calls
        prompt, dropped = str(msg.get("content", {}).get("prompt", "")), msg.get("dropped")
        del msg  # a call may wait minutes for approval: hold one copy of its request, not the message
        if prompt.startswith(MARKER) and not dropped:
            payload, prompt = prompt[len(MARKER):], ""
            reply, record = await broker.handle(self.info.session_id, run_id, self.info.tools, payload)
        elif dropped:  # too large to read: answered at once, the call fails in the kernel
            reply, record = broker.refuse_unread(self.info.session_id, run_id, dropped)
        else:
            reply, record = "", None  # only a kernel that bypassed the preamble asks for typed input
        if record is not None and len(tool_calls) < cap:
            tool_calls.append(record)
        if self.conn is not None and self.conn.is_open:
            with contextlib.suppress(KernelmodeError):
                await self.conn.send("stdin", "input_reply", {"value": reply}, expect_reply=False)

    # -- what the gateway tells us -----------------------------------------------------------------
    def on_status(self, state: str) -> None:
        """The gateway saw the kernel die (and is restarting it, or gave up)."""
        self.state = state
        self.needs_ready = True
        self.state_lost = True
        self.restore_pending = True
        self.files_pending = self.env.remote
        self.info.status = "dead" if state == KERNEL_DEAD else "restarting"
        if state == KERNEL_DEAD:  # what the gateway said, no more (it gives no cause)
            self.info.cause = DeathCause(kind="unknown", detail="the gateway reported the kernel dead "
                                         "(it could not restart it)")
        log.warning("session %s: kernel %s is %s", self.info.session_id, self.kernel_id, state)
        audit("kernel_died", session_id=self.info.session_id, tenant=self.info.tenant, kernel_id=self.kernel_id,
              then=state)

    def lose(self, cause: DeathCause) -> None:
        """The kernel stopped answering (or its gateway forgot it): a run in flight ends now as
        kernel_died with ``cause``; the next run gets a fresh kernel, without waiting on the
        gateway's DELETE of this one."""
        self.lost_cause = cause
        self.state = KERNEL_DEAD
        self.needs_ready = self.state_lost = self.restore_pending = True
        self.files_pending = self.env.remote
        self.info.status = "dead"
        self.info.cause = cause
        log.warning("session %s: kernel %s is lost: %s", self.info.session_id, self.kernel_id, cause.detail)
        audit("kernel_lost", session_id=self.info.session_id, tenant=self.info.tenant, kernel_id=self.kernel_id,
              detail=cause.detail)
        if self.conn is not None:
            self.conn.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": "lost"})

    def died_under_run(self) -> None:
        """A run saw the kernel die or its websocket close: ready it again before the next run."""
        self.state_lost = True
        self.needs_ready = True
        self.restore_pending = True
        self.files_pending = self.env.remote

    async def death_cause(self) -> DeathCause:
        """The provisioner's record of why the kernel died (it may take a moment to appear);
        the liveness probe's finding when it gave the kernel up (a remote gateway writes no record)."""
        if self.lost_cause is not None:
            return self.lost_cause
        if self.closed:
            return DeathCause(kind="unknown")
        deadline = time.monotonic() + 3 * self.env.settings.gateway.poll_interval_seconds + 1.0
        while time.monotonic() < deadline:
            cause = pop_death_record(self.env.state_dir, self.kernel_id)
            if cause is not None:
                return cause
            await asyncio.sleep(0.05)
        return DeathCause(kind="unknown")

    # -- interrupt, restart, replace ---------------------------------------------------------------
    async def interrupt(self) -> None:
        await self.env.gateway.interrupt_kernel(self.kernel_id)

    async def quiet_interrupt(self) -> None:
        """Interrupt, logging (not raising) a failure: for an interrupt nobody waits on."""
        try:
            await self.interrupt()
        except KernelmodeError as e:
            log.warning("session %s: interrupt not delivered: %s", self.info.session_id, e)

    async def restart(self, tell_next_run: bool = True) -> None:
        """Restart the kernel process in the gateway (a failure leaves it ``dead``: replaced at
        the next run). ``tell_next_run``: the next result says variables are gone (not when the
        result of the run that caused the restart says it)."""
        timeout = self.env.start_timeout
        self.needs_ready = True
        try:
            await self.env.gateway.restart_kernel(self.kernel_id, timeout)
            await self.connect(timeout)
            audit("kernel_restarted", session_id=self.info.session_id, tenant=self.info.tenant,
                  kernel_id=self.kernel_id)
        except KernelmodeError as e:
            log.error("session %s: kernel restart failed: %s", self.info.session_id, e)
            self.state = KERNEL_DEAD
        if tell_next_run:
            self.state_lost = True
        self.restore_pending = False  # a restart asked for: the session starts empty

    async def replace(self) -> None:
        """A fresh kernel under a new id on the same workspace (variables are gone); the old one
        is DELETEd in the background (a lost node's gateway may hold that DELETE for long)."""
        await self.shutdown(in_gateway=False)
        self.env.retire(self.kernel_id)
        self.lost_cause = self.info.cause = None
        self.misses, self.silent_since = 0, None
        self.state_lost = True
        attempts = self.env.settings.gateway.launch_attempts
        for attempt in range(1, attempts + 1):
            self.kernel_id = str(uuid.uuid4())
            self.info.kernel_id = self.kernel_id
            try:
                await asyncio.wait_for(self.env.launch(self), self.env.start_timeout + 5)
                break
            except (KernelmodeError, asyncio.TimeoutError) as e:
                if self.conn is not None:
                    await self.conn.close()
                self.env.retire(self.kernel_id)
                if attempt == attempts or isinstance(e, SandboxUnavailable):
                    raise KernelUnavailable(f"could not start a new kernel for the session ({attempt} "
                                            f"attempt(s)): {getattr(e, 'message', None) or 'timed out'}") from e
                log.warning("session %s: kernel start %d of %d failed; trying again", self.info.session_id,
                            attempt, attempts)
        log.warning("session %s: its kernel was replaced (now %s)", self.info.session_id, self.kernel_id)
        audit("kernel_replaced", session_id=self.info.session_id, tenant=self.info.tenant, kernel_id=self.kernel_id)

    # -- teardown (written once) -------------------------------------------------------------------
    async def shutdown(self, in_gateway: bool = True) -> None:
        """Close the websocket and stop the kernel in the gateway; the workspace stays."""
        if self.conn is not None:
            await self.conn.close()
        if in_gateway:
            with contextlib.suppress(KernelmodeError):
                await self.env.gateway.shutdown_kernel(self.kernel_id)
        pop_death_record(self.env.state_dir, self.kernel_id)

    async def discard(self, shutdown: bool = True) -> None:
        """Close, shut down and forget the kernel and its workspace."""
        self.closed = True
        lost = self.lost_cause is not None
        await self.shutdown(in_gateway=shutdown and not lost)
        if shutdown and lost:  # nobody waits on the DELETE of a kernel that does not answer
            self.env.retire(self.kernel_id)
        if not self.env.remote:
            with contextlib.suppress(KernelmodeError):
                await asyncio.to_thread(self.env.volumes.destroy, self.workspace)
        if self.layer is not None:
            await asyncio.to_thread(self.layer.destroy)
