"""The kernel state table (sessions/kernel_state.py): every allowed transition is taken, every
other one refused loudly (IllegalTransition naming both ends, and a log line), never silently;
and the Kernel's derived views (ready, needs_ready, needs_new, closed) follow its one state."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest

from kernelmode.config import Settings
from kernelmode.errors import IllegalTransition
from kernelmode.models import DeathCause, Limits, SessionInfo
from kernelmode.sessions.kernel_env import Kernels
from kernelmode.sessions.kernel_state import (
    GONE,
    NEEDS_NEW,
    TRANSITIONS,
    UNREADY,
    KernelState,
    check,
)
from kernelmode.sessions.kernels import Kernel
from kernelmode.sessions.live import now

S = KernelState
ALLOWED = {
    S.STARTING: {S.IDLE, S.RESTARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED},
    S.IDLE: {S.BUSY, S.RESTARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED},
    S.BUSY: {S.IDLE, S.RESTARTING, S.DEAD, S.LOST, S.CLOSED},
    S.RESTARTING: {S.IDLE, S.STARTING, S.DEAD, S.LOST, S.HIBERNATED, S.CLOSED},
    S.DEAD: {S.STARTING, S.LOST, S.HIBERNATED, S.CLOSED},
    S.LOST: {S.STARTING, S.HIBERNATED, S.CLOSED},
    S.HIBERNATED: {S.STARTING, S.LOST, S.CLOSED},
    S.CLOSED: set(),
}
PAIRS = list(itertools.product(KernelState, KernelState))


def test_the_table_is_the_one_written_here_and_names_the_issue_states() -> None:
    assert {s.value for s in KernelState} == {"starting", "idle", "busy", "restarting", "dead", "lost",
                                               "hibernated", "closed"}
    assert {k: set(v) for k, v in TRANSITIONS.items()} == ALLOWED


@pytest.mark.parametrize(("old", "new"), [(o, n) for o, n in PAIRS if n in ALLOWED[o] or n is o],
                         ids=lambda s: s.value)
def test_allowed_transition_is_taken(old: KernelState, new: KernelState) -> None:
    k = _kernel(old)
    k.to(new)
    assert k.state is new


@pytest.mark.parametrize(("old", "new"), [(o, n) for o, n in PAIRS if n not in ALLOWED[o] and n is not o],
                         ids=lambda s: s.value)
def test_refused_transition_raises_and_logs_naming_both_ends(old: KernelState, new: KernelState,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    k = _kernel(old)
    with caplog.at_level(logging.ERROR, logger="kernelmode.sessions"), \
            pytest.raises(IllegalTransition) as e:
        k.to(new)
    assert k.state is old  # refused: nothing changed
    assert f"{old.value} -> {new.value}" in e.value.message and e.value.details == {"from": old.value, "to": new.value}
    assert e.value.code == "illegal_transition"
    assert any(f"illegal transition {old.value} -> {new.value}" in r.getMessage() for r in caplog.records)


def test_closed_is_reachable_from_everywhere_and_leads_nowhere() -> None:
    for old in KernelState:
        check("k", old, S.CLOSED)
    for new in KernelState:
        if new is not S.CLOSED:
            with pytest.raises(IllegalTransition):
                check("k", S.CLOSED, new)


def test_derived_views_follow_the_one_state() -> None:
    assert GONE <= UNREADY and NEEDS_NEW <= UNREADY and S.CLOSED not in NEEDS_NEW
    for state in KernelState:
        k = _kernel(state)
        assert k.needs_ready is (state in UNREADY)
        assert k.needs_new is (state in NEEDS_NEW)
        assert k.closed is (state is S.CLOSED)
        assert k.ready is False  # no websocket


def test_the_gateways_word_is_not_taken_for_a_kernel_given_up() -> None:
    for state in GONE:
        k = _kernel(state)
        k.on_status("restarting")
        assert k.state is state and not k.state_lost
    k = _kernel(S.BUSY)
    k.on_status("restarting")
    assert k.state is S.RESTARTING and k.info.status == "restarting"
    assert k.state_lost and k.restore_pending  # what the session is owed, set together
    k.on_status("dead")
    assert k.state is S.DEAD and k.info.status == "dead" and k.needs_new


def test_lose_keeps_its_cause_until_the_kernel_is_replaced() -> None:
    k = _kernel(S.IDLE)
    cause = DeathCause(kind="lost", detail="no answer")
    k.lose(cause)
    assert k.state is S.LOST and k.cause == cause and k.info.status == "dead" and k.needs_new
    closed = _kernel(S.CLOSED)
    closed.lose(cause)  # torn down already: nothing to give up
    assert closed.state is S.CLOSED and closed.cause is None


def test_a_run_that_saw_the_kernel_die_leaves_it_restarting_unless_the_gateway_said_more() -> None:
    k = _kernel(S.BUSY)
    k.died_under_run()
    assert k.state is S.RESTARTING and k.state_lost and k.restore_pending
    dead = _kernel(S.DEAD)
    dead.died_under_run()
    assert dead.state is S.DEAD


def _kernel(state: KernelState) -> Kernel:
    kernels = Kernels(Settings(), None, None, Path("/nonexistent"), None)  # type: ignore[arg-type]
    t = now()
    info = SessionInfo(session_id="s", status="idle", created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none")
    return Kernel(kernels, "k", Path("/nonexistent"), info, state)
