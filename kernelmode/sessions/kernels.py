"""One kernel's lifecycle, one object per kernel (cf. jupyter_client's multikernelmanager and
restarter): start, connect, preamble, restart, replace, death cause, teardown, and its interrupt
latch. ``Kernels`` (kernel_env.py) holds what every kernel shares and starts new ones.

A kernel's state is one ``KernelState``, changed only through ``Kernel.to`` and the table of
kernel_state.py. Beside it, what the session is owed once the kernel's process went (set
together by ``process_gone``, each paid by whoever makes it good): the next result says
variables were lost (``state_lost``), the latest checkpoint is restored first
(``restore_pending``), a remote workspace gets its files back (``files_pending``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..audit import audit
from ..errors import KernelmodeError, KernelUnavailable, SandboxUnavailable
from ..gateway.client import KERNEL_DEAD, KernelConnection
from ..gateway.exchange import KERNEL_STATUS_EVENT, ExecuteExchange, Message, Outcome
from ..gateway.execution import OutputCollector
from ..gateway.launch import SAFE_VALUE, launch_env
from ..models import DeathCause, SessionInfo, ToolCall
from ..packages.layer import PackageLayer
from ..protocol import MARKER
from ..sandbox.spec import ENV_SESSION, KernelParams, pop_death_record
from ..tools.base import ToolInfo
from .boot import kernel_boot
from .interrupts import InterruptLatch
from .kernel_state import GONE, NEEDS_NEW, UNREADY, KernelState, check

__all__ = ["InterruptLatch", "Kernel", "KernelState"]

if TYPE_CHECKING:  # kernel_env.py makes kernels: importing it here would be a cycle
    from .kernel_env import Kernels

log = logging.getLogger("kernelmode.sessions")
REMOTE_ATTEMPT_SECONDS = 5.0  # a remote kernel's websocket that does not answer is replaced


class Kernel:
    """One kernel in the gateway, its websocket and its workspace, serving ``info`` (the
    session's, or a placeholder while the kernel waits in the warm pool)."""

    def __init__(self, env: Kernels, kernel_id: str, workspace: Path, info: SessionInfo,
                 state: KernelState = KernelState.STARTING) -> None:
        self.env = env
        self.kernel_id = kernel_id
        self.workspace = workspace
        self.info = info
        self.conn: KernelConnection | None = None
        self.state = state  # written by ``to`` only
        self.cause: DeathCause | None = None  # why it is LOST (the liveness probe, a gateway gone)
        self.state_lost = False  # the next result must say that variables are gone
        self.restore_pending = False  # the next run first restores the latest checkpoint
        # A remote kernel's workspace lives and dies with it on its node: after a death or a wake
        # the latest checkpoint's files go back first (Checkpoints.reseed).
        self.files_pending = False
        self.tools_installed: str | None = None  # the tool specs (JSON) the preamble holds
        self._tools_infos: list[ToolInfo] = []  # the tool list tools_installed was made from
        self.latch = InterruptLatch()

    def to(self, new: KernelState) -> None:
        """Move to ``new``; IllegalTransition (logged) if the table does not allow it."""
        check(self.kernel_id, self.state, new)
        self.state = new

    @property
    def ready(self) -> bool:
        """Idle or busy, connected and preamble-ready (what a pool kernel must be to be handed out)."""
        return self.state not in UNREADY and self.conn is not None and self.conn.is_open

    @property
    def needs_ready(self) -> bool:
        """Restarted, died or not started yet: reconnected (or replaced) before it runs code."""
        return self.state in UNREADY

    @property
    def needs_new(self) -> bool:
        """No process to reconnect to (given up, woken, or its start cut short): a fresh kernel
        replaces it at its next use."""
        return self.state in NEEDS_NEW

    @property
    def closed(self) -> bool:
        """Torn down: a run in progress must not wait for it."""
        return self.state is KernelState.CLOSED

    def process_gone(self) -> None:
        """The kernel's process (and its variables) went: the next result says so, the latest
        checkpoint is restored first, and a remote workspace gets its files back."""
        self.state_lost = self.restore_pending = True
        self.files_pending = self.env.remote

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
        if self.env.egress is not None:  # its token for `kernelmode egress-proxy`
            extra.update(self.env.egress.remote_launch(self.kernel_id))
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
        self.tools_installed = None  # a new or restarted kernel has no preamble yet
        if self.env.remote:
            self.conn = None
            self.conn = await self._answering_connection(timeout)
            await self.install_preamble(timeout)
        else:
            self.conn = await self.env.gateway.connect(self.kernel_id, self.on_status)
            await self._info_and_boot(timeout)
        if self.state in GONE:  # given up (or torn down) while it connected: it stays so
            raise KernelUnavailable(f"kernel {self.kernel_id} was {self.state.value} while it was connected")
        self.to(KernelState.IDLE)
        self.info.cause = None  # it answers: whatever befell its predecessor is over

    async def _info_and_boot(self, timeout: float) -> None:
        """kernel_info (answered on shell and seen on IOPub: the slow-joiner proof) and the boot
        code, sent back to back instead of one round trip after the other: the kernel takes them
        in order, and no run of the session starts before both are done. The boot's messages are
        silent ones; our gateway reads no frame of a new websocket before its nudge has seen the
        kernel's IOPub on it (jupyter_server), so a late subscription never drops them."""
        assert self.conn is not None
        info = asyncio.ensure_future(self.conn.kernel_info(timeout))
        boot = asyncio.ensure_future(self.install_preamble(timeout))
        try:
            await asyncio.wait((info, boot), return_when=asyncio.FIRST_EXCEPTION)
            for task in (info, boot):  # kernel_info's error first: it says why the boot failed
                if task.done():
                    task.result()
        finally:
            for task in (info, boot):
                task.cancel()
            await asyncio.gather(info, boot, return_exceptions=True)

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
            except BaseException:  # cancelled (an adoption's deadline): not left open
                await conn.close()
                raise

    async def ensure_ready(self) -> bool:
        """Before a run: a fresh kernel if the gateway gave this one up (True: its id changed),
        else reconnect if needed."""
        if self.needs_new:
            # The gateway gave up restarting it (a crash loop) and forgot it, the manager gave
            # it up, or it was hibernated: a fresh kernel for the session, on the same workspace.
            await self.replace()
            return True
        if self.conn is None or not self.conn.is_open or self.needs_ready:
            # After a restart, a fresh websocket: the gateway then opens its ZMQ channels to the
            # new kernel's sockets instead of reusing ones bound to the old process.
            try:
                await self.connect(self.env.start_timeout)
            except KernelmodeError:
                if not self.needs_new:
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
        if self.state in GONE:  # given up or torn down: the gateway's word does not bring it back
            log.info("kernel %s: the gateway says %s; it stays %s", self.kernel_id, state, self.state.value)
            return
        self.to(KernelState.DEAD if state == KERNEL_DEAD else KernelState.RESTARTING)
        self.process_gone()
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
        if self.closed:
            return  # torn down already: nothing to give up
        self.to(KernelState.LOST)
        self.cause = cause
        self.process_gone()
        self.info.status = "dead"
        self.info.cause = cause
        log.warning("session %s: kernel %s is lost: %s", self.info.session_id, self.kernel_id, cause.detail)
        audit("kernel_lost", session_id=self.info.session_id, tenant=self.info.tenant, kernel_id=self.kernel_id,
              detail=cause.detail)
        if self.conn is not None:
            self.conn.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": "lost"})

    def died_under_run(self) -> None:
        """A run saw the kernel die or its websocket close: ready it again before the next run
        (unless the gateway or the manager already said what became of it)."""
        if self.state in (KernelState.IDLE, KernelState.BUSY):
            self.to(KernelState.RESTARTING)
        self.process_gone()

    async def death_cause(self) -> DeathCause:
        """The provisioner's record of why the kernel died (it may take a moment to appear);
        the liveness probe's finding when it gave the kernel up (a remote gateway writes no record)."""
        if self.state is KernelState.LOST and self.cause is not None:
            return self.cause
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
        if self.needs_new or self.closed:  # no process to restart: a fresh one at the next use
            log.info("session %s: kernel %s is %s, not restarted", self.info.session_id, self.kernel_id,
                     self.state.value)
        else:
            self.to(KernelState.RESTARTING)
            try:
                await self.env.gateway.restart_kernel(self.kernel_id, timeout)
                await self.connect(timeout)
                audit("kernel_restarted", session_id=self.info.session_id, tenant=self.info.tenant,
                      kernel_id=self.kernel_id)
            except KernelmodeError as e:
                log.error("session %s: kernel restart failed: %s", self.info.session_id, e)
                if self.state not in GONE:
                    self.to(KernelState.DEAD)
        if tell_next_run:
            self.state_lost = True
        self.restore_pending = False  # a restart asked for: the session starts empty

    async def replace(self) -> None:
        """A fresh kernel under a new id on the same workspace (variables are gone); the old one
        is DELETEd in the background (a lost node's gateway may hold that DELETE for long)."""
        await self.shutdown(in_gateway=False)
        self.env.retire(self.kernel_id)
        self.cause = self.info.cause = None
        self.state_lost = True
        attempts = self.env.settings.gateway.launch_attempts
        for attempt in range(1, attempts + 1):
            if self.closed:  # its session was deleted meanwhile: no kernel for nobody
                raise KernelUnavailable("the session was deleted while its kernel was replaced")
            self.to(KernelState.STARTING)  # (a failed attempt may have left it restarting or dead)
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
                    if self.state not in GONE:
                        self.to(KernelState.DEAD)  # replaced again at the next use
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
            if self.env.egress is not None:
                self.env.egress.forget(self.kernel_id)
            with contextlib.suppress(KernelmodeError):
                await self.env.gateway.shutdown_kernel(self.kernel_id)
            if self.env.marks is not None:
                self.env.marks.unmark(self.kernel_id)
        pop_death_record(self.env.state_dir, self.kernel_id)

    async def discard(self, shutdown: bool = True) -> None:
        """Close, shut down and forget the kernel and its workspace. A remote kernel's (or a lost
        one's) DELETE goes to the background: Enterprise Gateway holds the DELETE of a kernel on
        a failed node ~30 s, and no local workspace waits for the kernel to be gone."""
        background = self.state is KernelState.LOST or self.env.remote
        self.to(KernelState.CLOSED)
        await self.shutdown(in_gateway=shutdown and not background)
        if shutdown and background:
            self.env.retire(self.kernel_id)
        if not self.env.remote:
            with contextlib.suppress(KernelmodeError):
                await asyncio.to_thread(self.env.volumes.destroy, self.workspace)
        if self.layer is not None:
            await asyncio.to_thread(self.layer.destroy)
