"""Direct tests of the sessions rooms that need no kernel: the interrupt latch (where an
interrupt goes, before and after a run's cell starts), the reaper's choice, and the live-session
map (one owner: only the manager changes which sessions are live)."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import kernelmode.sessions
from kernelmode.config import Settings
from kernelmode.errors import SessionExists
from kernelmode.models import Limits, SessionInfo
from kernelmode.sandbox.egress import egress_dir
from kernelmode.sessions.egress_wiring import EgressWiring
from kernelmode.sessions.kernel_env import Kernels
from kernelmode.sessions.kernels import InterruptLatch, Kernel
from kernelmode.sessions.live import LiveSession, LiveSessions, LiveView
from kernelmode.sessions.reaper import expired


def test_latch_sends_at_once_without_a_run() -> None:
    latch = InterruptLatch()
    assert latch.request(console_busy=False) is True


def test_latch_holds_for_a_cell_not_started_and_delivers_at_its_start() -> None:
    latch = InterruptLatch()
    latch.arm()
    assert latch.requested is False
    assert latch.request(console_busy=False) is False  # held
    assert latch.requested and latch.held
    assert latch.cell_start() is True  # the run delivers it now
    assert latch.cell_start() is False  # once
    latch.disarm()
    assert not latch.held and latch.cell_started


def test_latch_goes_to_a_console_cell_at_once() -> None:
    latch = InterruptLatch()
    latch.arm()
    assert latch.request(console_busy=True) is True  # the person's cell is what runs


def test_latch_timeout_before_the_cell_started_is_held() -> None:
    latch = InterruptLatch()
    latch.arm()
    assert latch.stop() is False and latch.held
    assert latch.cell_start() is True
    assert latch.stop() is True  # the cell runs: interrupt it now


def _live(kernels: Kernels, sid: str, expires: datetime) -> LiveSession:
    info = SessionInfo(session_id=sid, status="idle", created_at=expires, last_activity=expires,
                       expires_at=expires, ttl_seconds=60, limits=Limits(), sandbox="none")
    return LiveSession(kernel=Kernel(kernels, f"k-{sid}", Path("/nonexistent"), info))


async def test_reaper_picks_expired_idle_sessions_only() -> None:
    kernels = Kernels(Settings(), None, None, Path("/nonexistent"), None)  # type: ignore[arg-type]
    now = datetime.now(timezone.utc)
    live = {"old": _live(kernels, "old", now - timedelta(seconds=1)),
            "new": _live(kernels, "new", now + timedelta(seconds=60)),
            "busy": _live(kernels, "busy", now - timedelta(seconds=1))}
    async with live["busy"].lock:
        assert expired(live.values(), now) == ["old"]
    await asyncio.sleep(0)
    assert sorted(expired(live.values(), now)) == ["busy", "old"]


def test_live_sessions_add_remove_clear() -> None:
    kernels = Kernels(Settings(), None, None, Path("/nonexistent"), None)  # type: ignore[arg-type]
    live, s = LiveSessions(), _live(kernels, "a", datetime.now(timezone.utc))
    live.add(s)
    assert "a" in live and live.get("a") is s and list(live) == [s] and live.ids() == ["a"]
    with pytest.raises(SessionExists):  # never two live sessions under one id
        live.add(_live(kernels, "a", datetime.now(timezone.utc)))
    assert live.remove("a") is s and live.remove("a") is None and len(live) == 0
    live.add(s)
    assert live.clear() == [s] and len(live) == 0
    assert not any(hasattr(LiveView(), name) for name in ("add", "remove", "clear"))  # what rooms get


# Writes to the live-session map: its own methods, or a dict's (subscript, del, pop, clear).
_WRITE = re.compile(r"\blive\.(add|remove|drop|clear|pop)\(|\blive\[[^\]]+\]\s*=|\bdel\s+[\w.]*live\[")


def test_only_the_manager_changes_which_sessions_are_live() -> None:
    """And the create (creation.py, the manager's own step, moved out of manager.py for size),
    and, with several managers on one store, ownership (a lost lease drops a session) and
    takeover (a dead manager's sessions are added), and rebalance (an idle session handed over)."""
    root = Path(kernelmode.sessions.__file__).parent
    writers = sorted(f.name for f in root.glob("*.py") if _WRITE.search(f.read_text()))
    assert writers == ["creation.py", "manager.py", "ownership.py", "rebalance.py", "takeover.py"]


def _wiring(data_dir: Path) -> EgressWiring:
    return EgressWiring(Settings(), data_dir, None, data_dir / "run")


def test_a_sessions_egress_dir_is_its_kernels_where_the_bridge_connects(tmp_path: Path) -> None:
    """LiveSession.egress_dir (the manager's proxy puts proxy.sock there) is the directory the
    sandbox backends bind at /run/kernelmode/egress for that kernel (sandbox/egress.py)."""
    t = datetime.now(timezone.utc)
    local = Kernels(Settings(), None, None, tmp_path, None, egress=_wiring(tmp_path))  # type: ignore[arg-type]
    assert _live(local, "s1", t).egress_dir == egress_dir(tmp_path / "run", "k-s1") == tmp_path / "run" / "k-s1.egress"
    unsandboxed = Kernels(Settings(), None, None, tmp_path, None)  # type: ignore[arg-type]
    assert _live(unsandboxed, "s1", t).egress_dir is None
    remote = Kernels(Settings.model_validate({"gateway": {"url": "http://gw.test:8888"}}), None, None, tmp_path, None,  # type: ignore[arg-type]
                     egress=_wiring(tmp_path))
    assert _live(remote, "s1", t).egress_dir is None
