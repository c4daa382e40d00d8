"""The readers that used to list every stored session, on a real SessionManager and store (no
kernel: live sessions are entered as the manager holds them): `/api/kernels`' sessions with a
kernel (``with_kernels``), a listing page's live info, and the MCP connections' sweep of gone
sessions, each read by its own narrow query."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernelmode.config import Settings
from kernelmode.gateway.client import GatewayClient
from kernelmode.mcp.connections import Connections
from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.kernels import Kernel
from kernelmode.sessions.live import LiveSession
from kernelmode.sessions.manager import SessionManager
from kernelmode.sessions.store import SqliteStore
from kernelmode.tenants import ADMIN, Principal
from kernelmode.tools.broker import ToolBroker
from kernelmode.tools.registry import ToolRegistry

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
ACME = Principal("acme")


@pytest.fixture()
def manager(tmp_path: Path) -> Iterator[SessionManager]:
    settings = Settings()
    store = SqliteStore(tmp_path / "sessions.sqlite3")
    # The gateway is never called: these readers touch only the live sessions and the store.
    m = SessionManager(settings, GatewayClient("http://127.0.0.1:9", "unused"), store, tmp_path,
                       tmp_path / "state", "none", ToolBroker(ToolRegistry(), settings.tool_calls))
    yield m
    store.close()


def _info(sid: str, tenant: str, seconds: int, status: str = "idle") -> SessionInfo:
    t = T0 + timedelta(seconds=seconds)
    return SessionInfo(session_id=sid, status=status, created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none", tenant=tenant)


def _stored(m: SessionManager, info: SessionInfo) -> None:
    m.store.save(info, f"k-{info.session_id}", Path("/nowhere") / info.session_id)


def _live(m: SessionManager, info: SessionInfo) -> LiveSession:
    s = LiveSession(kernel=Kernel(m.kernels, f"k-{info.session_id}", Path("/nowhere") / info.session_id, info))
    m.live.add(s)
    _stored(m, info)
    return s


def _fill(m: SessionManager) -> None:
    """acme: a lost, a live, a hibernated and a newer live session; other: a live and a hibernated."""
    _stored(m, _info("a-lost", "acme", 0, "lost"))
    _live(m, _info("a-live", "acme", 1))
    _stored(m, _info("a-asleep", "acme", 2, "hibernated"))
    _live(m, _info("a-later", "acme", 3, "busy"))
    _live(m, _info("o-live", "other", 1))
    _stored(m, _info("o-asleep", "other", 4, "hibernated"))


def test_sessions_with_a_kernel_are_the_live_and_hibernated_ones_of_the_caller(manager: SessionManager) -> None:
    _fill(manager)
    assert [i.session_id for i in manager.with_kernels(ACME)] == ["a-live", "a-asleep", "a-later"]
    assert [i.session_id for i in manager.with_kernels(ADMIN)] == \
        ["a-live", "o-live", "a-asleep", "a-later", "o-asleep"]
    assert manager.with_kernels(Principal("nobody")) == []
    # A hibernated session being woken is live: its live info is the one shown, once.
    waking = _info("a-asleep", "acme", 2, "restarting")
    manager.live.add(LiveSession(kernel=Kernel(manager.kernels, "k2", Path("/nowhere"), waking)))
    shown = {i.session_id: i.status for i in manager.with_kernels(ACME)}
    assert shown == {"a-live": "idle", "a-asleep": "restarting", "a-later": "busy"}


def test_a_page_shows_the_live_info_of_live_sessions(manager: SessionManager) -> None:
    _fill(manager)
    manager.live.get("a-live").info.execution_count = 7  # type: ignore[union-attr]  # not saved yet: the live session knows
    listed = manager.page(ACME, limit=10).sessions
    assert [(i.session_id, i.execution_count) for i in listed] == \
        [("a-lost", 0), ("a-live", 7), ("a-asleep", 0), ("a-later", 0)]
    newest = manager.page(ACME, limit=2, newest_first=True)
    assert [i.session_id for i in newest.sessions] == ["a-later", "a-asleep"] and newest.next_cursor
    assert manager.store.status_counts()["lost"] == 1 and manager._gauges()[0]["hibernated"] == 2


def test_mcp_connections_forget_only_the_entries_of_gone_sessions(manager: SessionManager) -> None:
    _fill(manager)
    connections = Connections(lambda: SimpleNamespace(sessions=manager))  # type: ignore[arg-type,return-value]
    connections.own.update({"c-live": "a-live", "c-asleep": "a-asleep", "c-lost": "a-lost",
                            "c-closed": "closed-meanwhile"})
    connections._forget_gone_connections()
    assert connections.own == {"c-live": "a-live", "c-asleep": "a-asleep"}
