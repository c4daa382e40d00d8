"""The runner and ``SessionManager.execute`` in this process, against a fake Kernel Gateway
(tests/support/fake_gateway.py: the ``GatewayClient``/``KernelConnection`` interface, scripted
kernels): an ok run, an error run, a kernel killed mid-run (kernel_died with the provisioner's
cause, the session dead or restarting, the next run on a fresh kernel saying variables are
gone), an interrupt, a timeout, and a second run queued behind the first. No server starts; the
same behaviour against real kernels is in tests/integration/test_sessions.py and
tests/security/test_crashes.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernelmode.config import Settings
from kernelmode.errors import SessionNotFound
from kernelmode.metrics import Metrics
from kernelmode.models import SessionCreate
from kernelmode.sessions.kernel_state import KernelState
from kernelmode.sessions.live import LiveSession, LiveSessions
from kernelmode.sessions.manager import SessionManager
from kernelmode.sessions.runner import Runner
from kernelmode.sessions.store.sqlite import SqliteStore
from kernelmode.tools.broker import ToolBroker
from kernelmode.tools.registry import ToolRegistry
from tests.support.fake_gateway import FakeGateway


async def _until(check: object, what: str) -> None:
    """Let the loop run until ``check()`` holds (a bounded number of turns, no clock)."""
    for _ in range(10_000):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


@pytest.fixture()
async def manager(tmp_path: Path) -> AsyncIterator[tuple[SessionManager, FakeGateway]]:
    settings = Settings()
    settings.sessions.pool_size = 0
    settings.sessions.interrupt_grace_seconds = 5.0
    state = tmp_path / "state"
    gateway = FakeGateway(state)
    store = SqliteStore(tmp_path / "sessions.sqlite3")
    m = SessionManager(settings, gateway, store, tmp_path, state, "none",  # type: ignore[arg-type]
                       ToolBroker(ToolRegistry(), settings.tool_calls))
    m.workspaces.mkdir(parents=True)
    yield m, gateway
    for sid in m.live.ids():
        await m.delete(sid, keep_notebook=False)
    store.close()


async def test_manager_ok_run(manager: tuple[SessionManager, FakeGateway]) -> None:
    m, gw = manager
    sid = (await m.create(SessionCreate())).session_id
    result = await m.execute(sid, "print:hello")
    assert result.status == "ok" and result.result == "'hello'" and result.stdout == "hello\n"
    assert result.execution_count == 1 and not result.state_lost
    s = m.live.get(sid)
    assert s is not None and s.kernel.state is KernelState.IDLE and m.get(sid).status == "idle"
    assert m.store.get_run(result.run_id) is not None and gw.cells == ["print:hello"]


async def test_manager_error_run(manager: tuple[SessionManager, FakeGateway]) -> None:
    m, _ = manager
    sid = (await m.create(SessionCreate())).session_id
    result = await m.execute(sid, "raise")
    assert result.status == "error" and result.error is not None
    assert (result.error.ename, result.error.evalue) == ("ValueError", "boom")
    assert m.get(sid).status == "idle"


@pytest.mark.parametrize("then", ["dead", "restarting"])
async def test_manager_kernel_killed_mid_run_reports_the_death_and_its_cause(
        manager: tuple[SessionManager, FakeGateway], then: str) -> None:
    m, gw = manager
    sid = (await m.create(SessionCreate())).session_id
    first = m.get(sid).kernel_id
    result = await m.execute(sid, f"die:{then}")
    assert result.status == "kernel_died" and result.state_lost
    assert result.cause is not None and (result.cause.kind, result.cause.signal) == ("signal", 9)
    s = m.live.get(sid)
    assert s is not None and m.get(sid).status == then
    assert s.kernel.state is (KernelState.DEAD if then == "dead" else KernelState.RESTARTING)
    after = await m.execute(sid, "print:again")
    assert after.status == "ok" and after.state_lost  # the next result says variables are gone
    assert (m.get(sid).kernel_id != first) is (then == "dead")  # given up: a fresh kernel
    assert s.kernel.state is KernelState.IDLE and not (await m.execute(sid, "print:3")).state_lost


async def test_manager_interrupt(manager: tuple[SessionManager, FakeGateway]) -> None:
    m, gw = manager
    sid = (await m.create(SessionCreate())).session_id
    run = m.submit(sid, "hang")
    await _until(lambda: gw.cells == ["hang"] and m.live.get(sid).kernel.state is KernelState.BUSY,  # type: ignore[union-attr]
                 "the cell runs")
    assert m.get(sid).status == "busy"
    await m.interrupt(sid)
    result = await m.wait(run)
    assert result.status == "interrupted" and result.error is not None and result.error.ename == "KeyboardInterrupt"
    assert gw.interrupts == 1 and not result.state_lost and m.get(sid).status == "idle"


async def test_manager_timeout_interrupts_the_run(manager: tuple[SessionManager, FakeGateway]) -> None:
    m, gw = manager
    sid = (await m.create(SessionCreate())).session_id
    result = await m.execute(sid, "hang", timeout_seconds=0.05)
    assert result.status == "timeout" and not result.state_lost and gw.interrupts == 1
    assert result.error is not None and "timeout of 0.05 s" in result.error.evalue
    assert (await m.execute(sid, "print:next")).status == "ok"


async def test_manager_second_run_queues_behind_the_first(manager: tuple[SessionManager, FakeGateway]) -> None:
    m, gw = manager
    sid = (await m.create(SessionCreate())).session_id
    first = m.submit(sid, "wait")
    second = m.submit(sid, "print:second")
    await _until(lambda: gw.cells == ["wait"], "the first cell runs")
    for _ in range(100):  # however long the first runs, the second is not sent
        await asyncio.sleep(0)
    assert gw.cells == ["wait"] and not second.task.done()  # type: ignore[union-attr]
    gw.release()
    one, two = await m.wait(first), await m.wait(second)
    assert (one.status, two.status) == ("ok", "ok") and gw.cells == ["wait", "print:second"]
    assert (one.execution_count, two.execution_count) == (1, 2)


# -- the runner alone: a real Kernel (started through the fake gateway) and a LiveSessions map --

@pytest.fixture()
async def runner(manager: tuple[SessionManager, FakeGateway]) -> tuple[Runner, LiveSession, list[str]]:
    m, _ = manager
    sid = (await m.create(SessionCreate())).session_id
    s = m.live.get(sid)
    assert s is not None
    live = LiveSessions()
    live.add(s)
    calls: list[str] = []

    async def before(s: LiveSession) -> None:
        calls.append("before")

    def revive(session_id: str) -> LiveSession:  # as the manager's live_session: gone is gone
        found = live.get(session_id)
        if found is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return found

    runner = Runner(m.settings, m.store, None, Metrics(), live, m.kernels.collector,
                    before_run=before, after_run=lambda s, r: calls.append(f"after:{r.status}"),
                    revive=revive)
    return runner, s, calls


async def test_runner_ok_and_error_runs_call_its_collaborators(runner: tuple[Runner, LiveSession, list[str]]) -> None:
    r, s, calls = runner
    ok = await Runner.wait(r.submit(s, "print:x"))
    bad = await Runner.wait(r.submit(s, "raise"))
    assert (ok.status, bad.status) == ("ok", "error") and ok.stdout == "x\n"
    assert calls == ["before", "after:ok", "before", "after:error"]
    assert s.kernel.state is KernelState.IDLE and s.info.status == "idle" and not s.lock.locked()


async def test_runner_queues_a_second_run_behind_the_first(runner: tuple[Runner, LiveSession, list[str]],
                                                           manager: tuple[SessionManager, FakeGateway]) -> None:
    r, s, calls = runner
    _, gw = manager
    first, second = r.submit(s, "wait"), r.submit(s, "print:2")
    await _until(lambda: gw.cells == ["wait"], "the first cell runs")
    assert s.kernel.state is KernelState.BUSY and calls == ["before"]  # the second waits for the lock
    gw.release()
    assert (await Runner.wait(second)).status == "ok" and first.task.done()  # type: ignore[union-attr]
    assert calls == ["before", "after:ok", "before", "after:ok"]


async def test_runner_refuses_a_run_of_a_session_deleted_while_it_waited(
        runner: tuple[Runner, LiveSession, list[str]], manager: tuple[SessionManager, FakeGateway]) -> None:
    r, s, _ = runner
    _, gw = manager
    first, second = r.submit(s, "wait"), r.submit(s, "print:2")
    await _until(lambda: gw.cells == ["wait"], "the first cell runs")
    r.live.remove(s.info.session_id)  # type: ignore[attr-defined]
    gw.release()
    with pytest.raises(SessionNotFound, match="deleted while the code ran"):
        await Runner.wait(first)
    with pytest.raises(SessionNotFound, match="no session"):
        await Runner.wait(second)
    assert gw.cells == ["wait"]
