"""The approval gate's bookkeeping (tools/approvals.py) and the code policy's loading and
answers (code_policy.py), without a kernel: what the end-to-end tests cannot time or provoke."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernelmode.code_policy import CodePolicy, PolicyDecision
from kernelmode.errors import ApprovalDecided, ApprovalNotFound, ConfigError
from kernelmode.models import PendingApproval
from kernelmode.tools.approval_budget import ApprovalBounds
from kernelmode.tools.approvals import Approvals, shown_arguments

CALL = "a" * 32


async def _pending(gate: Any) -> PendingApproval:
    while not gate.pending:  # noqa: ASYNC110 - the gate has no event to wait on; it fills on the next turn
        await asyncio.sleep(0)
    return gate.listing()[0]


async def test_a_decision_answers_the_call_once() -> None:
    approvals = Approvals()
    changes: list[int] = []
    gate = approvals.open("r1", "s1", "t", lambda: changes.append(1))
    call = asyncio.create_task(gate.request(CALL, "weather", {"city": "Paris"}, 60))
    p = await _pending(gate)
    assert p == PendingApproval(call_id=CALL, tool="weather", arguments={"city": "Paris"}) and gate.unasked
    with pytest.raises(ApprovalNotFound):
        approvals.decide("r2", CALL, True, None, "rest")  # another run's id
    approvals.decide("r1", CALL, False, "no", "rest")
    decision = await call
    assert (decision.approved, decision.reason, decision.by) == (False, "no", "rest")
    assert not gate.pending and changes
    assert 0 < gate.paused(asyncio.get_running_loop().time()) == gate.paused(1e12)  # not pending now
    with pytest.raises(ApprovalDecided, match="denied by rest"):
        approvals.decide("r1", CALL, True, None, "rest")


async def test_no_answer_is_a_deny_after_the_timeout() -> None:
    gate = Approvals().open("r1", "s1", None)
    decision = await gate.request(CALL, "weather", {}, 0.05)
    assert (decision.approved, decision.by) == (False, "timeout")
    assert decision.reason == "no answer within 0.05 s"


async def test_a_cancelled_run_withdraws_its_call() -> None:
    approvals = Approvals()
    gate = approvals.open("r1", "s1", None)
    call = asyncio.create_task(gate.request(CALL, "weather", {}, 60))
    await _pending(gate)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    with pytest.raises(ApprovalDecided, match="run_ended"):
        approvals.decide("r1", CALL, True, None, "rest")


async def test_ids_from_the_kernel_are_replaced_when_bad_or_reused() -> None:
    approvals = Approvals()
    gate = approvals.open("r1", "s1", None)
    await gate.request(CALL, "t", {}, 0.01)  # decided (timeout): the id is now known
    for bad in (CALL, "../x", None):
        task = asyncio.create_task(gate.request(bad, "t", {}, 60))
        p = await _pending(gate)
        assert p.call_id != CALL and len(p.call_id) == 32
        approvals.decide("r1", p.call_id, True, None, "rest")
        assert (await task).approved


async def test_an_asker_decides_and_one_that_fails_leaves_it_pending() -> None:
    gate = Approvals().open("r1", "s1", None)
    asked: list[str] = []

    async def yes(p: PendingApproval) -> tuple[bool, str | None]:
        asked.append(p.tool)
        return True, "ok"

    gate.attach(yes)
    decision = await gate.request(CALL, "weather", {}, 60)
    assert (decision.approved, decision.by, asked) == (True, "mcp", ["weather"])

    async def broken(p: PendingApproval) -> tuple[bool, str | None]:
        raise RuntimeError("client went away")

    gate.attach(broken)
    task = asyncio.create_task(gate.request("b" * 32, "weather", {}, 60))
    await _pending(gate)
    while gate.asking:  # noqa: ASYNC110 - as above: the failing asker ends on the next turns
        await asyncio.sleep(0)
    assert gate.unasked  # the caller must now be told (status awaiting_approval)
    gate.owner.decide("r1", "b" * 32, False, None, "rest")
    assert (await task).by == "rest"


async def test_one_shot_gates_deny_at_once() -> None:
    gate = Approvals().open("r1", "s1", None, enabled=False)
    decision = await gate.request(CALL, "weather", {}, 60)
    assert not decision.approved and "one-shot" in (decision.reason or "")


async def test_pending_calls_are_bounded_per_session_and_tenant_by_count_and_bytes() -> None:
    """Over a bound: denied at once (``by: bound``, naming the setting), never parked; a decided
    call gives its room back; another tenant's room is its own."""
    approvals = Approvals(ApprovalBounds(per_session=2, per_tenant=3, bytes_per_session=100, bytes_per_tenant=150))
    a1, a2, b = (approvals.open(r, s, t) for r, s, t in (("r1", "s1", "a"), ("r2", "s2", "a"), ("r3", "s3", "b")))
    parked = [asyncio.create_task(a1.request(None, "t", {}, 60, 10)) for _ in range(2)]
    await asyncio.sleep(0)
    third = await a1.request(None, "t", {}, 60, 10)  # the session's count
    assert (third.approved, third.by) == (False, "bound") and "max_pending_approvals_per_session" in third.reason
    big = await a2.request(None, "t", {}, 60, 101)  # the session's bytes
    assert big.by == "bound" and "max_pending_approval_bytes_per_session" in big.reason
    parked.append(asyncio.create_task(a2.request(None, "t", {}, 60, 100)))
    await asyncio.sleep(0)
    over = await a2.request(None, "t", {}, 60, 1)  # the tenant's count (3 pending)
    assert over.by == "bound" and "max_pending_approvals_per_tenant" in over.reason
    assert approvals.budget.held("s2", "a") == {"session": 1, "session_bytes": 100, "tenant": 3, "tenant_bytes": 120}
    other = asyncio.create_task(b.request(None, "t", {}, 60, 100))  # tenant b: unaffected
    await asyncio.sleep(0)
    assert len(b.pending) == 1
    for call_id in list(a1.pending):
        approvals.decide("r1", call_id, False, None, "rest")
    await asyncio.gather(*parked[:2])
    assert approvals.budget.held("s1", "a")["session"] == 0  # room given back
    tenant_bytes = await a1.request(None, "t", {}, 60, 60)  # 100 + 60 > 150: the tenant's bytes
    assert tenant_bytes.by == "bound" and "max_pending_approval_bytes_per_tenant" in tenant_bytes.reason
    approvals.close("r2")
    approvals.close("r3")
    await asyncio.gather(parked[2], other)
    assert approvals.budget.held("s2", "a") == {"session": 0, "session_bytes": 0, "tenant": 0, "tenant_bytes": 0}
    assert not approvals.budget._count and not approvals.budget._bytes  # no key outlives its calls


def test_large_arguments_are_cut_for_the_listing() -> None:
    shown = shown_arguments({"blob": "x" * 10_000})
    assert set(shown) == {"_truncated"} and len(shown["_truncated"]) < 4_200
    assert shown_arguments({"a": 1}) == {"a": 1}


# -- the code policy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["no_such_module_xyz:check", "examples.code_policy:nope",
                                    "examples.code_policy:RESTRICTED_TENANTS"])
def test_a_bad_policy_path_is_a_config_error_naming_the_key(target: str) -> None:
    with pytest.raises(ConfigError, match=r"^policy\.module: "):
        CodePolicy.load(target)


@pytest.mark.parametrize(("answer", "expected"), [
    ("allow", PolicyDecision("allow")),
    (("deny", "no"), PolicyDecision("deny", "no")),
    ({"decision": "ask", "reason": "why"}, PolicyDecision("ask", "why")),
    ("yes", None), (("deny", 3), None), (None, None),
])
async def test_policy_answers(answer: Any, expected: PolicyDecision | None) -> None:
    verdict = await CodePolicy("t", lambda **kw: answer).check("1", "s", "admin")
    if expected is None:  # nonsense fails closed
        assert verdict.decision == "deny" and "the code policy failed (ValueError" in (verdict.reason or "")
    else:
        assert verdict == expected


async def test_a_policy_that_raises_denies_and_async_policies_work() -> None:
    def boom(**kw: Any) -> str:
        raise KeyError("tenant table")

    verdict = await CodePolicy("t", boom).check("1", "s", "admin")
    assert verdict.decision == "deny" and "KeyError" in (verdict.reason or "")

    async def seen(code: str, session_id: str, tenant: str) -> tuple[str, str]:
        return "deny", f"{code}|{session_id}|{tenant}"

    assert (await CodePolicy("t", seen).check("x", "s1", "team")).reason == "x|s1|team"


async def test_a_policy_that_does_not_answer_denies() -> None:
    never = asyncio.Event()

    async def hangs(code: str, session_id: str, tenant: str) -> str:
        await never.wait()
        return "allow"

    verdict = await CodePolicy("t", hangs, timeout=0.05).check("1", "s", "admin")
    assert verdict.decision == "deny" and "did not answer" in (verdict.reason or "")


def test_the_example_policy() -> None:
    from examples.code_policy import check

    assert check("import subprocess", "s", "interns")[0] == "deny"
    assert check("import os\nos.system('ls')", "s", "interns")[0] == "deny"
    assert check("import subprocess", "s", "admin") == "allow"
    assert check("open('/etc/x', 'w')", "s", "admin") == ("ask", "writes to /etc/x, outside /mnt/data")
    assert check("open('/mnt/data/x', 'w'); open('rel.txt', 'a'); open('/etc/passwd')", "s", "admin") == "allow"
    assert check("%pip list", "s", "interns") == "allow"  # not Python: the kernel answers for itself


async def test_a_long_poll_returns_when_an_approval_comes_but_not_for_one_already_seen() -> None:
    from kernelmode.gateway.execution import OutputCollector
    from kernelmode.sessions.runs import LiveRun

    approvals = Approvals()
    run = LiveRun(run_id="r1", session_id="s1", collector=OutputCollector(1000))
    run.gate = approvals.open("r1", "s1", None, run.changed.set)
    poll = asyncio.create_task(run.wait_changed(0, 60))
    call = asyncio.create_task(run.gate.request(CALL, "weather", {}, 60))
    await asyncio.wait_for(poll, 10)  # the approval came during the poll: news
    assert run.snapshot().status == "awaiting_approval"
    again = asyncio.create_task(run.wait_changed(0, 60))  # already seen: waits for a change
    for _ in range(20):
        await asyncio.sleep(0)
    assert not again.done()
    approvals.decide("r1", CALL, True, None, "rest")
    await asyncio.wait_for(again, 10)
    assert (await call).approved and run.snapshot().status == "running"
