"""The session store's records of a run (kernelmode/sessions/store.py): the "running" record
first, then the end of the run and the session's state in one transaction."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from kernelmode.models import Limits, RunResult, SessionInfo
from kernelmode.sessions.store import SessionStore


def test_a_run_ends_in_one_transaction_or_not_at_all(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.db")
    now = datetime.now(timezone.utc)
    info = SessionInfo(session_id="s1", status="idle", created_at=now, last_activity=now, ttl_seconds=600,
                       limits=Limits(), sandbox="none")
    store.save(info, "k1", tmp_path)
    running = RunResult(run_id="r1", session_id="s1", status="running")
    store.add_run("1+1", running)
    assert [r.run_id for r in store.runs_in_flight()] == ["r1"]  # on disk before the code runs

    ended = running.model_copy(update={"status": "ok", "result": "2", "execution_count": 1})
    info.execution_count = 1
    with pytest.raises(RuntimeError), store.transaction():
        store.add_run("1+1", ended, [])
        store.save(info, "k1", tmp_path)
        raise RuntimeError("the server fails between the two writes")
    again = SessionStore(tmp_path / "s.db")  # what a successor reads
    assert [r.run_id for r in again.runs_in_flight()] == ["r1"]  # neither write happened
    saved = again.get("s1")
    assert saved is not None and saved.execution_count == 0

    with store.transaction():
        store.add_run("1+1", ended, [{"type": "execute_result", "data": {"text/plain": "2"}}])
        store.save(info, "k1", tmp_path)
    again = SessionStore(tmp_path / "s.db")
    assert again.runs_in_flight() == []
    got = again.get_run("r1")
    saved = again.get("s1")
    assert got is not None and got.status == "ok" and got.result == "2"
    assert saved is not None and saved.execution_count == 1
    assert again.run_count("s1") == 1
