"""The SessionManager driven directly (library mode, in this process) with a real gateway and
real kernels: its rooms composed as the front doors use them."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import pytest_asyncio

from kernelmode import KernelmodeApp, SessionCreate, ToolRegistry, load_settings
from kernelmode.errors import SessionNotFound

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def app() -> AsyncIterator[KernelmodeApp]:
    settings = load_settings()
    settings.server.port = 0
    settings.server.data_dir = Path(tempfile.mkdtemp(prefix="kmmgr-", dir="/tmp"))
    settings.sessions.pool_size = 1
    settings.sessions.pool_max = 1  # this module's pool is the floor: the adaptive growth is test_pool_sizing's
    app = KernelmodeApp(settings, ToolRegistry())
    await app.start()
    try:
        yield app
    finally:
        await app.stop()
        shutil.rmtree(settings.server.data_dir, ignore_errors=True)


async def test_runs_restart_and_state_lost_once(app: KernelmodeApp) -> None:
    sessions = app.sessions
    sid = (await sessions.create(SessionCreate())).session_id
    try:
        first = await sessions.execute(sid, "x = 41\nx + 1")
        assert (first.status, first.result, first.state_lost) == ("ok", "42", False)
        await sessions.restart(sid)
        after = await sessions.execute(sid, "x")
        assert after.status == "error" and after.error is not None and after.error.ename == "NameError"
        assert after.state_lost is True  # said once, by the next result
        assert (await sessions.execute(sid, "1")).state_lost is False
    finally:
        await sessions.delete(sid)


async def test_delete_tears_the_kernel_and_workspace_down(app: KernelmodeApp) -> None:
    sessions = app.sessions
    sid = (await sessions.create(SessionCreate())).session_id
    s = sessions.live_session(sid)
    workspace, kernel_id = s.workspace, s.kernel_id
    assert (await sessions.execute(sid, "open('/mnt/data/f.txt', 'w').write('x')")).status == "ok"
    assert workspace.is_dir()
    await sessions.delete(sid)
    assert not workspace.exists()
    assert kernel_id not in {k["id"] for k in await app.gateway.list_kernels()}
    with pytest.raises(SessionNotFound):
        sessions.live_session(sid)


async def test_an_interrupt_before_the_cell_starts_stops_the_run(app: KernelmodeApp) -> None:
    sessions = app.sessions
    sid = (await sessions.create(SessionCreate())).session_id
    try:
        run = sessions.submit(sid, "while True: pass", timeout_seconds=120)
        for _ in range(6000):  # until the run holds the kernel (its cell may not run yet)
            if sessions.get(sid).status == "busy":
                break
            await asyncio.sleep(0.01)
        await sessions.interrupt(sid)  # before its cell started: held, then delivered at its start
        result = await sessions.wait(run)
        assert result.status == "interrupted" and result.state_lost is False, result
    finally:
        await sessions.delete(sid)


async def test_reaper_deletes_an_expired_idle_session(app: KernelmodeApp) -> None:
    sessions = app.sessions
    sid = (await sessions.create(SessionCreate())).session_id
    sessions.live_session(sid).info.expires_at = datetime.now(timezone.utc) - timedelta(seconds=1)
    assert sid in await sessions.reap_expired()
    with pytest.raises(SessionNotFound):
        sessions.live_session(sid)


async def test_pool_reports_configured_size_and_refills(app: KernelmodeApp) -> None:
    sessions = app.sessions
    assert sessions.pool.size == 1
    for _ in range(600):  # the refill after earlier takes (bounded: 60 s of polls)
        if sessions.pool_size == 1:
            break
        await asyncio.sleep(0.1)
    assert sessions.pool_size == 1
    info = await sessions.create(SessionCreate())
    try:
        assert info.from_pool is True
    finally:
        await sessions.delete(info.session_id)
