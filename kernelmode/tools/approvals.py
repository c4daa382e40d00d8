"""The approval gate: tool calls (and runs, for the code policy) that wait for a person's yes/no.

Each run has a ``RunGate``. A call that requires approval is parked there as a pending approval
(the kernel waits on its stdin reply, as for any tool call; nothing blocks the event loop) until
one of these decides it:
- ``Approvals.decide`` — the REST route ``POST /v1/runs/{run_id}/approvals/{call_id}``;
- the gate's *asker* — while an MCP tool call follows the run, it elicits the answer from the
  MCP client (mcp/elicit.py);
- the timeout (``tool_calls.approval_timeout_seconds``): denied;
- the run's end (interrupt, timeout, session closed): withdrawn, i.e. denied.
A call over the bounds of approval_budget.py (per session and tenant, count and bytes) is denied
at once (``by: bound``) and never parked. Every request and decision is audited (what, who decided: rest | mcp | timeout | run_ended).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..audit import audit
from ..errors import ApprovalDecided, ApprovalNotFound
from ..models import PendingApproval
from .approval_budget import ApprovalBounds, ApprovalBudget

log = logging.getLogger("kernelmode.tools")

_ID = re.compile(r"^[0-9a-f]{32}$")
_MAX_DECIDED = 10_000  # decisions remembered (for the 409 of a second answer)
MAX_SHOWN_ARGUMENT_CHARS = 4_000  # arguments as listed in pending_approvals (the call gets them all)


@dataclass(frozen=True)
class Decision:
    """The answer to one pending approval."""

    approved: bool
    reason: str | None
    by: str  # rest | mcp | timeout | run_ended | interrupt


# An asker gets a pending approval and answers (approve, reason); it may raise to give up
# (then the approval stays pending for another door to answer, or the timeout).
Asker = Callable[[PendingApproval], Awaitable[tuple[bool, str | None]]]


def shown_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments as listed to the approver: whole when small, else cut (saying so)."""
    text = json.dumps(arguments, default=str)
    if len(text) <= MAX_SHOWN_ARGUMENT_CHARS:
        return arguments
    return {"_truncated": f"{len(text):,} characters of JSON; the first ones: "
            + text[:MAX_SHOWN_ARGUMENT_CHARS]}


@dataclass
class _Pending:
    info: PendingApproval
    future: asyncio.Future[Decision]
    asking: asyncio.Task[None] | None = None
    ask_failed: bool = False  # the asker gave up: only REST or the timeout can answer now


@dataclass
class RunGate:
    """The pending approvals of one run, and who is asked about them."""

    owner: Approvals
    run_id: str
    session_id: str
    tenant: str | None
    on_change: Callable[[], None] = lambda: None
    enabled: bool = True  # False: nobody could answer (one-shot runs): such calls are denied
    asker: Asker | None = None
    pending: dict[str, _Pending] = field(default_factory=dict)
    version: int = 0  # bumped at every change of what is pending or asked (pollers compare it)
    _paused: float = 0.0  # seconds (loop clock) during which something was pending, so far
    _pending_since: float | None = None

    def paused(self, now: float) -> float:
        """Seconds up to ``now`` (loop clock) that the run spent waiting for approvals: the
        run's own timeout does not count them."""
        return self._paused + (now - self._pending_since if self._pending_since is not None else 0.0)

    def _changed(self) -> None:
        self.version += 1
        self.on_change()

    def listing(self) -> list[PendingApproval]:
        return [p.info for p in self.pending.values()]

    @property
    def unasked(self) -> bool:
        """A pending approval that no asker is working on: the caller must be told."""
        return any(p.asking is None for p in self.pending.values())

    @property
    def asking(self) -> bool:
        return any(p.asking is not None for p in self.pending.values())

    def attach(self, asker: Asker) -> None:
        """Ask ``asker`` about every pending approval, now and as they come (until ``detach``)."""
        self.asker = asker
        for p in self.pending.values():
            self._ask(p)

    def detach(self, asker: Asker) -> None:
        if self.asker is not asker:
            return
        self.asker = None
        for p in self.pending.values():
            if p.asking is not None:
                p.asking.cancel()
                p.asking = None
        self._changed()

    def _ask(self, p: _Pending) -> None:
        if self.asker is None or p.asking is not None or p.ask_failed or p.future.done():
            return
        asker = self.asker

        async def ask() -> None:
            try:
                approve, reason = await asker(p.info)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the client could not answer: leave it to REST or the timeout
                log.info("run %s: approval %s could not be asked: %s", self.run_id, p.info.call_id, e)
                p.ask_failed, p.asking = True, None
                self._changed()
                return
            if not p.future.done():
                p.future.set_result(Decision(approve, reason, "mcp"))

        p.asking = asyncio.create_task(ask(), name=f"approval-{p.info.call_id}")

    def deny_pending(self, reason: str, by: str, tool: str | None = None) -> int:
        """Deny what is pending (only calls of ``tool`` if given); returns how many."""
        n = 0
        for p in list(self.pending.values()):
            if (tool is None or p.info.tool == tool) and not p.future.done():
                p.future.set_result(Decision(False, reason, by))
                n += 1
        return n

    async def request(self, call_id: str | None, tool: str, arguments: dict[str, Any],
                      timeout: float, size: int = 0) -> Decision:
        """Park a call (``size``: its request's bytes) until it is decided (or ``timeout``
        passes: denied); a call over the approval bounds is denied at once (``by: bound``)."""
        if not self.enabled:
            decision = Decision(False, f"{tool} requires approval, which a one-shot run cannot wait "
                                "for; run the code in a session", "run_ended")
            self.owner.record(self, call_id or uuid.uuid4().hex, tool, decision)
            return decision
        refusal = self.owner.budget.take(self.session_id, self.tenant, size)
        if refusal is not None:
            decision = Decision(False, refusal, "bound")
            self.owner.record(self, uuid.uuid4().hex, tool, decision)
            return decision
        try:
            return await self._park(call_id, tool, arguments, timeout)
        finally:
            self.owner.budget.give(self.session_id, self.tenant, size)

    async def _park(self, call_id: str | None, tool: str, arguments: dict[str, Any], timeout: float) -> Decision:
        if call_id is None or not _ID.match(call_id) or self.owner.known(call_id):
            call_id = uuid.uuid4().hex  # the kernel's id is forgeable: never trust it to be unique
        p = _Pending(PendingApproval(call_id=call_id, tool=tool, arguments=shown_arguments(arguments)),
                     asyncio.get_running_loop().create_future())
        if not self.pending:
            self._pending_since = asyncio.get_running_loop().time()
        self.pending[call_id] = p
        self.owner.index(call_id, self)
        audit("approval_requested", session_id=self.session_id, tenant=self.tenant, run_id=self.run_id,
              call_id=call_id, tool=tool)
        self._ask(p)
        self._changed()
        decision = Decision(False, "the run ended before an answer (interrupted, timed out, or its "
                            "session closed)", "run_ended")
        try:
            decision = await asyncio.wait_for(asyncio.shield(p.future), timeout)
        except asyncio.TimeoutError:
            decision = Decision(False, f"no answer within {timeout:g} s", "timeout")
        finally:
            if p.future.done() and not p.future.cancelled():
                decision = p.future.result()
            elif not p.future.done():
                p.future.set_result(decision)
            if p.asking is not None:
                p.asking.cancel()
            self.pending.pop(call_id, None)
            if not self.pending and self._pending_since is not None:
                self._paused += asyncio.get_running_loop().time() - self._pending_since
                self._pending_since = None
            self.owner.record(self, call_id, tool, decision)
            self._changed()
        return decision


class Approvals:
    """Every run's gate, and the decisions made (remembered a while, for a 409)."""

    def __init__(self, bounds: ApprovalBounds | None = None) -> None:
        self.budget = ApprovalBudget(bounds or ApprovalBounds())
        self._gates: dict[str, RunGate] = {}
        self._calls: dict[str, RunGate] = {}  # call id -> gate, while pending
        self._decided: OrderedDict[str, tuple[str, Decision]] = OrderedDict()  # call id -> (run, decision)

    def open(self, run_id: str, session_id: str, tenant: str | None,
             on_change: Callable[[], None] = lambda: None, enabled: bool = True) -> RunGate:
        gate = RunGate(self, run_id, session_id, tenant, on_change, enabled)
        self._gates[run_id] = gate
        return gate

    def close(self, run_id: str) -> None:
        """The run ended: its gate goes (its pending calls were cancelled with the run)."""
        gate = self._gates.pop(run_id, None)
        if gate is not None:
            for p in list(gate.pending.values()):
                if not p.future.done():
                    p.future.set_result(Decision(False, "the run ended before an answer", "run_ended"))

    def gate(self, run_id: str) -> RunGate | None:
        return self._gates.get(run_id)

    def known(self, call_id: str) -> bool:
        return call_id in self._calls or call_id in self._decided

    def index(self, call_id: str, gate: RunGate) -> None:
        self._calls[call_id] = gate

    def record(self, gate: RunGate, call_id: str, tool: str, decision: Decision) -> None:
        self._calls.pop(call_id, None)
        self._decided[call_id] = (gate.run_id, decision)
        while len(self._decided) > _MAX_DECIDED:
            self._decided.popitem(last=False)
        audit("approval_decided", session_id=gate.session_id, tenant=gate.tenant, run_id=gate.run_id,
              call_id=call_id, tool=tool, approved=decision.approved, by=decision.by, reason=decision.reason)

    def decide(self, run_id: str, call_id: str, approve: bool, reason: str | None, by: str) -> Decision:
        """Answer a pending approval of ``run_id`` (the caller checked the run is the caller's)."""
        gate = self._calls.get(call_id)
        p = gate.pending.get(call_id) if gate is not None and gate.run_id == run_id else None
        if p is None or p.future.done():
            done = self._decided.get(call_id)
            if done is not None and done[0] == run_id or p is not None:
                how = done[1] if done is not None else None
                raise ApprovalDecided(
                    f"approval {call_id} of run {run_id} was already decided"
                    + (f": {'approved' if how.approved else 'denied'} by {how.by}" if how else ""))
            raise ApprovalNotFound(f"no pending approval {call_id!r} in run {run_id!r}")
        decision = Decision(approve, reason, by)
        p.future.set_result(decision)
        return decision
