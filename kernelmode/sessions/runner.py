"""A run from submit to RunResult: queueing behind the session's earlier runs, readying the
kernel, the execute exchange, timeout and runaway stop, interrupts, stdin answers (tool calls),
harvest, and the record in the session store.

A failure in user code is a RunResult; a failure of the gateway or the kernel's plumbing is a
KernelmodeError (kept in ``LiveRun.failure`` for pollers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..artifacts.channel import file_channel
from ..artifacts.harvester import Harvester
from ..audit import audit
from ..code_policy import CodePolicy
from ..config import ADMIN_TENANT, Settings
from ..errors import (
    InvalidRequest,
    KernelmodeError,
    PayloadTooLarge,
    SessionNotFound,
    SessionOwnedElsewhere,
)
from ..gateway.exchange import ExecuteExchange, Outcome
from ..gateway.execution import OutputCollector
from ..metrics import Metrics
from ..models import DeathCause, RunError, RunResult, RunStatus, ToolCall
from ..protocol import memory_hint
from ..protocol.frames import refuse_lone_surrogates
from ..tools.approvals import Approvals
from .egress_wiring import counted
from .kernels import Kernel, KernelState
from .live import LiveSession, LiveView
from .readying import Readying, RestartCut, restart_in_place
from .runs import LiveRun, RunRegistry, new_run_id
from .store import SessionStore

if TYPE_CHECKING:
    from .checkpoints import Restore

log = logging.getLogger("kernelmode.sessions")


def _ended(run: LiveRun, task: asyncio.Task[RunResult]) -> None:
    """A run's task is over: its waiters wake (``Runner.wait`` watches only run.changed), and its
    failure is read even when nobody waits for the run any more (it is kept in run.failure)."""
    run.changed.set()
    if not task.cancelled():
        task.exception()


def _expire(run: LiveRun, expired: list[bool]) -> None:
    """A waiter's ``wait_seconds`` passed: it wakes (others waking with it look and wait on)."""
    expired.append(True)
    run.changed.set()


class Runner:
    """Runs code in live sessions (``live``: the manager's sessions by id, read only).

    ``before_run``: a restore after a kernel's death, before the run (checkpoints); ``after_run``:
    called with the session's lock released (an automatic checkpoint); ``revive``: the live
    session by id, a hibernated one woken (SessionNotFound when it is gone)."""

    def __init__(self, settings: Settings, store: SessionStore, harvester: Harvester | None,
                 metrics: Metrics, live: LiveView,
                 collector: Callable[[], OutputCollector], approvals: Approvals | None = None,
                 policy: CodePolicy | None = None, *,
                 before_run: Callable[[LiveSession], Awaitable[Restore | None]],
                 after_run: Callable[[LiveSession, RunResult], None],
                 revive: Callable[[str], LiveSession]) -> None:
        self.settings = settings
        self.approvals = approvals or Approvals()  # the broker's: tool calls park in a run's gate
        self.policy = policy
        self.collector = collector  # a new output collector with the server's caps
        self.store = store
        self.harvester = harvester
        self.metrics = metrics
        self.live = live
        self.runs = RunRegistry(settings.sessions.run_retention_seconds)
        self.readying = Readying()  # a run's kernel start and restore, which a restart cuts short
        self.before_run = before_run
        self.after_run = after_run
        self.revive = revive
        self.run_tag = ""  # the prefix of this manager's run ids (runs.py ``run_tag``): set by several managers

    def timeout(self, timeout_seconds: float | None) -> float:
        """The run's timeout (InvalidRequest above the server's maximum)."""
        cfg = self.settings.sessions
        timeout = timeout_seconds or cfg.default_timeout_seconds
        if timeout > cfg.max_timeout_seconds:
            raise InvalidRequest(
                f"timeout_seconds={timeout:g} is above this server's maximum of {cfg.max_timeout_seconds:g}"
            )
        return timeout

    def submit(self, s: LiveSession, code: str, timeout_seconds: float | None = None,
               approvals: bool = True) -> LiveRun:
        """Start a run in its own task and return it at once (it queues behind earlier runs).

        ``approvals``: False when nobody could answer an approval (a one-shot run): such calls
        are denied at once."""
        if len(code.encode("utf-8", errors="replace")) > self.settings.sessions.max_code_bytes:
            raise PayloadTooLarge(
                f"code is larger than this server's limit of {self.settings.sessions.max_code_bytes} bytes; "
                "upload data as a file instead of pasting it into code"
            )
        refuse_lone_surrogates(code, "code")  # every door's code: the gateway would drop it (frames.py)
        timeout = self.timeout(timeout_seconds)
        run = LiveRun(run_id=new_run_id(self.run_tag), session_id=s.info.session_id, code=code,
                      collector=self.collector())
        run.collector.on_change = run.changed.set
        run.gate = self.approvals.open(run.run_id, s.info.session_id, s.info.tenant, run.changed.set, approvals)
        run.task = asyncio.create_task(self._execute(s, run, timeout), name=f"run-{run.run_id}")
        run.task.add_done_callback(lambda t: _ended(run, t))
        self.runs.add(run)
        return run

    @staticmethod
    async def wait(run: LiveRun, wait_seconds: float | None = None) -> RunResult:
        """The run's result once it ends, or its snapshot (``running``) after ``wait_seconds``.

        The run's task is shielded: a caller that gives up (or is cancelled) does not stop it.
        """
        assert run.task is not None
        task = run.task
        # The run's end sets run.changed too (submit), and so does the deadline's timer: one
        # event is watched, with no task, future or wait set made per change.
        expired: list[bool] = []
        timer = None
        if wait_seconds is not None:
            timer = asyncio.get_running_loop().call_later(wait_seconds, _expire, run, expired)
        try:
            # Also answered early when an approval waits that nobody is asking (MCP elicitation
            # asks itself): the caller has to hear of it, or the run waits for the timeout.
            while not task.done() and not run.awaiting and not expired:
                run.changed.clear()
                await run.changed.wait()
        finally:
            if timer is not None:
                timer.cancel()
        return task.result() if task.done() else run.snapshot()

    def find(self, run_id: str) -> LiveRun | None:
        """The run in flight, or a finished one read back from the store (for this answer only)."""
        run = self.runs.get(run_id)
        if run is not None and not run.stored:
            return run
        stored = self.store.get_run(run_id)
        if stored is None:
            return None
        found = LiveRun(run_id=run_id, session_id=stored.session_id, result=stored,
                        collector=self.collector(), finished_at=time.monotonic())
        found.collector.events = self.store.run_events(run_id)
        return found

    async def _execute(self, s: LiveSession, run: LiveRun, timeout: float) -> RunResult:
        session_id = s.info.session_id
        try:
            s = await self._locked(s)
            try:
                if session_id not in self.live:  # deleted while we waited for the lock
                    raise SessionNotFound(f"no session {session_id!r}")
                refusal = await self._policy(s, run)  # may wait for a person's approval
                if refusal is not None:
                    return refusal
                started = time.monotonic()
                s.info.status = "busy"
                k = s.kernel
                k.latch.arm()
                try:
                    try:
                        restore = await self.readying.run(session_id, self._ready(s))
                    except RestartCut:  # a restart came while the kernel was readied: done here
                        result = await self._cut(s, run)
                    else:
                        # Recorded as running first: if this server dies now, its successor can
                        # say the run was interrupted.
                        self.store.add_run(run.code, run.snapshot())
                        run.recorded = True
                        with counted(k, run.run_id) as egress_used:
                            result = await self._run(k, run, timeout)
                        result.egress = egress_used()  # hosts its code reached or was refused
                        if restore is not None:
                            restore.apply(result)
                        if result.status != "kernel_died":  # what a dead kernel made died with it
                            s.changed_since_checkpoint = True
                finally:
                    k.latch.disarm()
                    s.touch()
                    if s.info.status == "busy":
                        s.info.status = "idle"
                if session_id not in self.live:  # deleted (or reaped, or taken over) while the code ran
                    raise self._gone(session_id)
                if self.harvester is not None and result.status == "ok":
                    # Never raises: a harvest problem is a note on the result, which stands.
                    channel = file_channel(s.conn, self.settings.sessions.files_timeout_seconds)
                    await self.harvester.harvest(session_id, result, channel, run.collector.file_changes)
                result.duration_ms = round((time.monotonic() - started) * 1000, 3)
                if result.execution_count is not None:
                    s.info.execution_count = result.execution_count
                self.store.add_run(run.code, result, run.collector.events)
                self.store.save(s.info, s.kernel_id, s.workspace)
            finally:
                s.lock.release()
        except Exception as e:
            run.failure = self._failure(run, e)
            self.store.forget_run_if_running(run.run_id)  # it failed as a request, not as code
            if run.failure is not e:
                raise run.failure from e
            raise
        finally:
            self.approvals.close(run.run_id)
            self.runs.finished(run)
        run.result = result
        self.after_run(s, result)
        self.metrics.observe_run(result, s.info.tenant or ADMIN_TENANT)
        audit("run", session_id=session_id, tenant=s.info.tenant, run_id=run.run_id, status=result.status,
              duration_ms=result.duration_ms, state_lost=result.state_lost,
              cause=result.cause.model_dump() if result.cause else None,
              tool_calls=len(result.tool_calls), artifacts=len(result.artifacts))
        return result

    def _gone(self, session_id: str) -> KernelmodeError:
        if self.live.taken_elsewhere(session_id):
            return SessionOwnedElsewhere(f"session {session_id!r} was taken over by another manager "
                                         "while the code ran; send the request again")
        return SessionNotFound(f"session {session_id!r} was deleted while the code ran")

    @staticmethod
    def _failure(run: LiveRun, e: Exception) -> KernelmodeError:
        """What a run that failed as a request says. One whose session was taken over by another
        manager while it ran (this one froze past its lease) was ended ``interrupted`` in the
        store by that manager: polls read that record, and the client is told not to run the
        code again (``details.run_id``)."""
        if isinstance(e, SessionOwnedElsewhere) and run.recorded:
            run.handed_over = True
            return SessionOwnedElsewhere(
                f"session {run.session_id!r} was taken over by another manager while run {run.run_id} ran "
                "(this manager stopped answering for longer than store.lease_seconds): that manager "
                f"ended the run 'interrupted' (GET /v1/runs/{run.run_id}) and serves the session now; "
                "the code was not run again", details={"run_id": run.run_id})
        return e if isinstance(e, KernelmodeError) else KernelmodeError(
            f"internal error ({type(e).__name__}); see the server log")

    async def _ready(self, s: LiveSession) -> Restore | None:
        """The kernel readied for the run: started if it is dead (woken, given up), its preamble
        installed, the latest checkpoint restored after a death or a wake."""
        k = s.kernel
        if await k.ensure_ready():
            self.store.save(s.info, s.kernel_id, s.workspace)
        await k.install_preamble(k.env.start_timeout)
        return await self.before_run(s)

    async def _cut(self, s: LiveSession, run: LiveRun) -> RunResult:
        """A restart cut the run's readying short: the kernel is restarted here, under the run's
        lock (runs queued behind get the fresh kernel), and the run ends at once, saying why."""
        sid = s.info.session_id
        try:
            await restart_in_place(s.kernel)
        finally:
            self.readying.done(sid)
        s.info.status = "dead" if s.kernel.needs_new else "idle"
        return run.collector.to_result(run.run_id, sid, "interrupted", state_lost=True, error=RunError(
            ename="KernelRestarted", evalue="a restart was requested while the session was being restored "
            "(its kernel starting, or its latest checkpoint loading): the code did not run, and the "
            "session starts empty", traceback=""))

    async def _policy(self, s: LiveSession, run: LiveRun) -> RunResult | None:
        """The code policy's verdict on the run: None (run it), or the error result that refuses
        it (recorded like a run; the kernel is not touched)."""
        if self.policy is None:
            return None
        sid, tenant = s.info.session_id, s.info.tenant or ADMIN_TENANT
        verdict = await self.policy.check(run.code, sid, tenant)
        audit("policy", session_id=sid, tenant=tenant, run_id=run.run_id, decision=verdict.decision,
              reason=verdict.reason)
        reason = verdict.reason
        if verdict.decision == "ask" and run.gate is not None:
            code = run.code if len(run.code) <= 4_000 else run.code[:4_000] + "\n# [... cut ...]"
            decision = await run.gate.request(None, "policy:run", {"code": code, "reason": reason},
                                              self.settings.tool_calls.approval_timeout_seconds)
            if decision.approved:
                return None
            reason = f"the code policy asked for approval ({reason or 'no reason given'}), and it " \
                     f"was denied ({decision.by})" + (f": {decision.reason}" if decision.reason else "")
        elif verdict.decision != "deny":
            return None
        result = run.collector.to_result(run.run_id, sid, "error", error=RunError(
            ename="PolicyDenied", evalue=reason or "the code policy refused this code", traceback=""))
        self.store.add_run(run.code, result, [])
        run.result = result
        return result

    async def _locked(self, s: LiveSession) -> LiveSession:
        """Take the session's lock (runs go in arrival order). A session that hibernated while
        the run waited is woken (``revive``) and its new lock taken: the run goes on there."""
        sid = s.info.session_id
        while True:
            await s.lock.acquire()
            if self.live.get(sid) is s:
                return s
            s.lock.release()
            s = self.revive(sid)  # SessionNotFound when it was deleted meanwhile

    async def _run(self, k: Kernel, run: LiveRun, timeout: float) -> RunResult:
        assert k.conn is not None
        collector = run.collector
        state_lost = k.take_state_lost()
        cause: DeathCause | None = None
        tool_calls: list[ToolCall] = []
        held_interrupt: list[asyncio.Task[None]] = []

        def on_start() -> None:
            if k.latch.cell_start():
                held_interrupt.append(asyncio.create_task(k.quiet_interrupt()))

        exchange = ExecuteExchange(collector, on_input=lambda msg: k.answer_input(run.run_id, msg, tool_calls),
                                   on_start=on_start)
        if k.state is KernelState.IDLE:  # (else the gateway said meanwhile what became of it)
            k.to(KernelState.BUSY)
        loop = asyncio.get_running_loop()
        try:
            await exchange.send(k.conn, run.code)
            start = loop.time()
            outcome = await exchange.collect(start + timeout)
            # Time spent waiting for a person's approval does not count against the timeout.
            while outcome == "timeout" and run.gate is not None and \
                    (deadline := start + timeout + run.gate.paused(loop.time())) > loop.time():
                # (a call still pending: look again in a second at the earliest, not in a spin)
                outcome = await exchange.collect(max(deadline, loop.time() + 1.0) if run.gate.pending else deadline)
            status: RunStatus
            if outcome == "done":
                status = "ok" if collector.reply_status == "ok" else "error"
                if status == "error" and k.latch.requested and collector.error and \
                        collector.error.ename == "KeyboardInterrupt":
                    status = "interrupted"
            elif outcome == "timeout":
                status = "timeout"
                state_lost |= await self._stop_runaway(k, exchange)
                collector.error = RunError(
                    ename="TimeoutError",
                    evalue=f"the run exceeded its timeout of {timeout:g} s and was "
                    + ("stopped by restarting the kernel: variables are gone" if state_lost
                       else "interrupted"),
                    traceback="",
                )
            elif outcome == "restarted":
                status, state_lost = "interrupted", True
                k.take_state_lost()  # this result says it
            else:  # the kernel died, or its websocket closed under us
                status, state_lost = "kernel_died", True
                cause = await k.death_cause()
                if cause.kind == "oom" and not cause.detail:  # say which limit, and how to ask for more
                    cause = cause.model_copy(update={"detail": memory_hint(k.info.limits.memory_mb)})
                k.died_under_run()
        finally:
            exchange.close()
            if k.state is KernelState.BUSY:
                k.to(KernelState.IDLE)
            if held_interrupt:  # delivered before the next run can start, so it cannot hit that one
                await asyncio.gather(*held_interrupt, return_exceptions=True)
        return collector.to_result(
            run.run_id, k.info.session_id, status, state_lost=state_lost, cause=cause, tool_calls=tool_calls,
            tool_calls_truncated=len(tool_calls) >= self.settings.tool_calls.max_recorded_calls)

    async def _stop_runaway(self, k: Kernel, exchange: ExecuteExchange) -> bool:
        """Interrupt a run past its timeout; restart the kernel if that does not stop it.

        Returns True when the kernel was restarted (the session's state is lost).
        """
        grace = self.settings.sessions.interrupt_grace_seconds
        with contextlib.suppress(KernelmodeError):
            if k.latch.stop():
                await k.interrupt()
            # else: timed out before its cell started (a busy kernel): stopped once it starts
            outcome: Outcome = await exchange.collect(asyncio.get_running_loop().time() + grace)
            if outcome == "done":
                return False
        log.warning("session %s: interrupt did not stop the run; restarting its kernel", k.info.session_id)
        await k.restart(tell_next_run=False)
        return True
