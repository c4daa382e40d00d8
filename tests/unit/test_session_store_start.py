"""What the store's open and the manager's start read: an open does no work per stored session
(the triggers keep the listing columns in step whoever writes a record, an older kernelmode
too), the start's queries and the hibernation expiry pass read only the records they return."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from kernelmode.models import Limits, RunResult, SessionInfo
from kernelmode.sessions.store import SessionStore, SqliteStore

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _info(sid: str, status: str = "idle", kernel: str | None = None, expires: datetime | None = None,
          tenant: str | None = "acme", n: int = 0) -> SessionInfo:
    t = T0 + timedelta(microseconds=n)
    return SessionInfo(session_id=sid, status=status, created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none", tenant=tenant, kernel_id=kernel, expires_at=expires)


def _save(store: SessionStore, *infos: SessionInfo) -> None:
    for i in infos:
        store.save(i, i.kernel_id or f"k-{i.session_id}", Path("/w") / i.session_id)


def _junk(path: Path, n: int, status: str, **fields: Any) -> None:
    """``n`` rows whose record is JSON (the triggers read it: status and tenant) but no session:
    whatever decodes one fails."""
    db = sqlite3.connect(path)
    db.executemany("INSERT INTO sessions (session_id, kernel_id, workspace, info) VALUES (?, ?, ?, json_object("
                   "'status', ?, 'expires_at', ?))",
                   [(f"junk{i}", f"kj{i}", f"/w/junk{i}", status, fields.get("expires_at")) for i in range(n)])
    db.commit()
    db.close()


@pytest.fixture()
def path(tmp_path: Path) -> Path:
    return tmp_path / "sessions.sqlite3"


@pytest.fixture()
def store(path: Path) -> Iterator[SessionStore]:
    s = SqliteStore(path)
    yield s
    s.close()


def _columns(store: SessionStore) -> dict[str, tuple[str | None, str | None, int | None]]:
    return {r[0]: r[1:] for r in store._db.execute("SELECT session_id, status, tenant, created_us FROM sessions")}


def test_the_start_reads_only_the_sessions_it_adopts_or_marks_lost(store: SessionStore, path: Path) -> None:
    a, b = _info("a", "idle", "ka", n=1), _info("b", "busy", "kb", T0 + timedelta(hours=1), n=2)
    c, h = _info("c", "dead", "kc", n=3), _info("h", "hibernated", "kh", n=4)
    _save(store, a, b, c, h, _info("l", "lost", "kl", n=5))
    _junk(path, 50, "lost")
    assert store.with_kernels(frozenset({"ka", "kh", "kl", "kx"})) == [a, h]  # a lost one is not adopted
    assert store.with_kernels(frozenset()) == []
    assert store.kernel_ids() >= {"ka", "kb", "kc", "kh", "kl", "kj7"}
    assert store.mark_all_lost(keep={"a"}) == ["b", "c"]
    # The records as mark_lost writes them, the columns with them.
    assert store.get("b") == b.model_copy(update={"status": "lost", "expires_at": None})
    assert store.get("c") == c.model_copy(update={"status": "lost"})
    assert store.get("a") == a and store.get("h") == h
    assert store.status_counts() == {"idle": 1, "hibernated": 1, "lost": 53}
    assert store.mark_all_lost() == ["a"] and store.mark_all_lost() == []
    assert store.hibernated_workspaces() == {Path("/w/h")}
    plan = " ".join(r[-1] for r in store._db.execute(
        "EXPLAIN QUERY PLAN UPDATE sessions SET status = 'lost' WHERE status < 'hibernated' OR "
        "(status > 'hibernated' AND status < 'lost') OR status > 'lost'"))
    assert "sessions_by_status" in plan and "SCAN sessions" not in plan, plan


def test_the_expiry_pass_reads_only_the_expired_records(store: SessionStore, path: Path) -> None:
    at = datetime(2026, 3, 1, 12, 0, 0, 999_600, tzinfo=timezone.utc)  # SQLite rounds .9996 up
    due = [_info("now", "hibernated", expires=at, n=1),
           _info("past", "hibernated", expires=at - timedelta(days=3), n=2),
           # The same instant in another zone, and one 0.1 ms before `at`.
           _info("zone", "hibernated", expires=at.astimezone(timezone(timedelta(hours=1))), n=3),
           _info("close", "hibernated", expires=at - timedelta(microseconds=100), n=4)]
    later = [_info("later", "hibernated", expires=at + timedelta(microseconds=1), n=5),
             _info("live", "idle", expires=at - timedelta(days=1), n=6),
             _info("never", "hibernated", n=7)]
    _save(store, *due, *later)
    _junk(path, 50, "hibernated", expires_at="2999-01-01T00:00:00Z")
    assert store.hibernated_expired(at) == due
    assert [i.session_id for i in store.hibernated_expired(at + timedelta(microseconds=1))] == [
        "now", "past", "zone", "close", "later"]
    assert store.hibernated_expired(at - timedelta(days=4)) == []
    # Woken: no longer hibernated, whatever its record's expiry.
    _save(store, due[1].model_copy(update={"status": "idle"}))
    assert [i.session_id for i in store.hibernated_expired(at)] == ["now", "zone", "close"]
    plan = " ".join(r[-1] for r in store._db.execute(
        "EXPLAIN QUERY PLAN SELECT info FROM sessions INDEXED BY sessions_hibernated_by_expiry "
        "WHERE status = 'hibernated' AND expires_ms <= ?", (1,)))
    assert "sessions_hibernated_by_expiry" in plan, plan


def test_an_older_kernelmodes_writes_keep_the_columns_in_step_at_once(store: SessionStore, path: Path) -> None:
    a, h = _info("a", "idle", "ka", n=1), _info("h", "idle", "kh", n=2)
    _save(store, a, h)
    at = T0 + timedelta(days=1)
    # As every kernelmode before the listing columns wrote: the record alone (an upsert, an
    # INSERT of a new session, mark_lost's UPDATE).
    old = sqlite3.connect(path)
    old.execute("INSERT INTO sessions (session_id, kernel_id, workspace, info) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(session_id) DO UPDATE SET kernel_id=excluded.kernel_id, "
                "workspace=excluded.workspace, info=excluded.info",
                ("h", "kh", "/w/h", h.model_copy(update={"status": "hibernated", "expires_at": at,
                                                         "tenant": "other"}).model_dump_json()))
    new = _info("new", "hibernated", "kn", at, tenant=None, n=3)
    old.execute("INSERT INTO sessions (session_id, kernel_id, workspace, info) VALUES ('new', 'kn', '/w/new', ?)",
                (new.model_dump_json(),))
    old.execute("UPDATE sessions SET info=? WHERE session_id='a'",
                (a.model_copy(update={"status": "lost"}).model_dump_json(),))
    old.commit()
    old.close()
    # No open in between: the database itself kept them in step.
    assert _columns(store) == {"a": ("lost", "acme", 1_767_225_600_000_001), "h": ("hibernated", "other", 1_767_225_600_000_002),
                               "new": ("hibernated", None, None)}
    assert sorted(i.session_id for i in store.hibernated_expired(at)) == ["h", "new"]
    assert store.mark_all_lost() == []
    store.close()
    again = SqliteStore(path)  # fills the created_us of the row an older kernelmode inserted
    try:
        assert _columns(again)["new"] == ("hibernated", None, 1_767_225_600_000_003)
        assert [i.session_id for i in again.page(None, None, 10)] == ["a", "h", "new"]
    finally:
        again.close()


def test_a_store_of_the_code_before_the_triggers_is_brought_in_step_once(path: Path) -> None:
    SqliteStore(path).close()
    prev = sqlite3.connect(path)  # as the code before them left it: columns, no triggers
    prev.execute("DROP TRIGGER sessions_listed_after_insert")
    prev.execute("DROP TRIGGER sessions_listed_after_update")
    prev.execute("INSERT INTO sessions (session_id, kernel_id, workspace, info, tenant, created_us, status) "
                 "VALUES ('a', 'ka', '/w/a', ?, 'acme', 1, 'idle')", (_info("a", "lost").model_dump_json(),))
    prev.commit()
    prev.close()
    store = SqliteStore(path)
    try:
        assert _columns(store) == {"a": ("lost", "acme", 1)}
        triggers = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert triggers == {"sessions_listed_after_insert", "sessions_listed_after_update"}
    finally:
        store.close()


def _open_steps(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """SQLite virtual-machine steps (in hundreds) of opening the store at ``path``."""
    steps = [0]
    connect = sqlite3.connect

    def counted(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db = connect(*args, **kwargs)
        db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1) or 0, 100)
        return db

    with monkeypatch.context() as m:
        m.setattr(sqlite3, "connect", counted)
        SqliteStore(path).close()
    return steps[0]


def test_an_open_does_no_work_per_stored_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, big = tmp_path / "small.sqlite3", tmp_path / "big.sqlite3"
    for p, n in ((small, 10), (big, 3000)):
        s = SqliteStore(p)
        s._db.execute("BEGIN")
        _save(s, *(_info(f"s{i}", ("idle", "lost", "hibernated")[i % 3], n=i) for i in range(n)))
        s._db.execute("COMMIT")
        s.close()
    # The first open of either was its making; these are the opens of every later start. (The
    # scan they replace, a json_extract of each record, took ~10 steps per session.)
    assert _open_steps(big, monkeypatch) <= _open_steps(small, monkeypatch) + 2


def _run(rid: str, status: str = "ok", sid: str = "a") -> RunResult:
    return RunResult(run_id=rid, session_id=sid, status=status)


def test_the_start_reads_only_the_runs_not_known_to_have_ended(store: SessionStore, path: Path) -> None:
    store.add_run("1", _run("r1", "running"))
    store.add_run("2", _run("r2", "running"))
    store.end_run(_run("r2", "ok"))
    store.add_run("3", _run("r3", "running"))
    # Ended runs whose record is not even JSON: whatever reads one (json_extract too) fails.
    db = sqlite3.connect(path)
    db.executemany("INSERT INTO runs (run_id, session_id, seq, code, result, running) VALUES (?, 'j', ?, '', "
                   "'not json', 0)", [(f"junk{i}", i) for i in range(50)])
    # An older kernelmode (no `running` column): a run it started, one it ended, and the end of r3.
    db.execute("INSERT INTO runs (run_id, session_id, seq, code, result) VALUES ('o1', 'b', 1, '', ?)",
               (_run("o1", "running", "b").model_dump_json(),))
    db.execute("INSERT INTO runs (run_id, session_id, seq, code, result) VALUES ('o2', 'b', 2, '', ?)",
               (_run("o2", "ok", "b").model_dump_json(),))
    db.execute("UPDATE runs SET result=? WHERE run_id='r3'", (_run("r3", "error").model_dump_json(),))
    db.commit()
    db.close()
    assert sorted(r.run_id for r in store.runs_in_flight()) == ["o1", "r1"]
    # What it learnt is kept: the next start's candidates are the running ones alone.
    assert dict(store._db.execute("SELECT run_id, running FROM runs WHERE running IS NOT 0")) == {"o1": 1, "r1": 1}
    plan = " ".join(r[-1] for r in store._db.execute("EXPLAIN QUERY PLAN SELECT result FROM runs WHERE running IS NOT 0"))
    assert "runs_not_ended" in plan, plan
    store.end_run(_run("r1", "interrupted"))
    store.forget_run_if_running("o1")
    assert store.runs_in_flight() == []


def test_a_store_made_before_the_running_column_finds_its_runs_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL, "
                "code TEXT NOT NULL, result TEXT NOT NULL, events TEXT)")
    old.executemany("INSERT INTO runs (run_id, session_id, seq, code, result) VALUES (?, 'a', ?, '', ?)",
                    [(f"r{i}", i, _run(f"r{i}", "running" if i == 3 else "ok").model_dump_json()) for i in range(6)])
    old.commit()
    old.close()
    store = SqliteStore(path)
    try:
        assert [r.run_id for r in store.runs_in_flight()] == ["r3"]
        assert store._db.execute("SELECT COUNT(*) FROM runs WHERE running IS NULL").fetchone()[0] == 0
    finally:
        store.close()
