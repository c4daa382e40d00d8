"""The session store's behaviour, the same on both backends (``any_store``: SQLite in a temp dir,
and PostgreSQL in a real server the tests start, tests/support/postgres.py): sessions at a
restart, runs, session files, checkpoints, and what a backend must keep of odd text."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from kernelmode.models import Artifact, CheckpointInfo, Limits, RunResult, SessionInfo
from kernelmode.sessions.store import SessionStore

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _info(sid: str, status: str = "idle", kernel: str | None = None, tenant: str | None = "acme",
          expires: datetime | None = None, n: int = 0) -> SessionInfo:
    t = T0 + timedelta(microseconds=n)
    return SessionInfo(session_id=sid, status=status, created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none", tenant=tenant, kernel_id=kernel or f"k-{sid}",
                       expires_at=expires)


def _save(store: SessionStore, *infos: SessionInfo) -> None:
    for i in infos:
        store.save(i, i.kernel_id or "", Path("/w") / i.session_id)


def _artifact(name: str, size: int = 1) -> Artifact:
    return Artifact(path=name, name=name, size_bytes=size, mime_type="x/y", sha256="0" * 64, download_url="http://x/")


def _run(sid: str, rid: str, status: str = "ok", stdout: str = "") -> RunResult:
    return RunResult(run_id=rid, session_id=sid, status=status, stdout=stdout)


def test_a_restart_marks_lost_all_but_the_adopted_and_the_hibernated(any_store: SessionStore) -> None:
    later = T0 + timedelta(days=1)
    _save(any_store, _info("a", n=1), _info("b", "busy", n=2), _info("c", "hibernated", expires=later, n=3),
          _info("d", "lost", n=4), _info("e", n=5))
    assert any_store.with_kernels({"k-a", "k-c", "k-d", "k-nobody"}) == [any_store.get("a"), any_store.get("c")]
    assert any_store.with_kernels(set()) == []
    assert any_store.mark_all_lost(keep={"e"}) == ["a", "b"]
    for sid in ("a", "b"):
        info = any_store.get(sid)
        assert info is not None and info.status == "lost" and info.expires_at is None
    assert any_store.status_counts() == {"lost": 3, "hibernated": 1, "idle": 1}
    assert any_store.kernel_ids() == {f"k-{s}" for s in "abcde"}
    assert any_store.workspaces() == {Path("/w") / s for s in "abcde"}
    assert any_store.hibernated_workspaces() == {Path("/w/c")}
    assert any_store.workspace("c") == Path("/w/c") and any_store.workspace("zz") is None
    assert [i.session_id for i in any_store.all()] == list("abcde")


def test_hibernated_sessions_expire_to_the_microsecond(any_store: SessionStore) -> None:
    due = T0 + timedelta(hours=1)
    _save(any_store, _info("a", "hibernated", expires=due, n=1),
          _info("b", "hibernated", expires=due + timedelta(microseconds=1), n=2),
          _info("c", "idle", expires=due - timedelta(hours=1), n=3))
    assert any_store.hibernated_expired(due - timedelta(microseconds=1)) == []
    assert [i.session_id for i in any_store.hibernated_expired(due)] == ["a"]
    assert [i.session_id for i in any_store.hibernated_expired(due + timedelta(seconds=1))] == ["a", "b"]
    hibernated = any_store.get("a")
    assert hibernated is not None
    any_store.mark_lost(hibernated)  # no longer hibernated: no longer due
    assert [i.session_id for i in any_store.hibernated_expired(due + timedelta(seconds=1))] == ["b"]


def test_runs_are_kept_in_order_and_the_unfinished_found_at_the_start(any_store: SessionStore) -> None:
    _save(any_store, _info("a"))
    any_store.add_run("x = 1", _run("a", "r1", "running"))
    any_store.add_run("print(x)", _run("a", "r2", "running"))
    any_store.add_run("x = 1", _run("a", "r1", "ok"), [{"type": "stream", "text": "hi"}])  # ends in place
    assert [r.run_id for r in any_store.runs_in_flight()] == ["r2"]
    any_store.end_run(_run("a", "r2", "error"))
    assert any_store.runs_in_flight() == []
    any_store.add_run("y", _run("a", "r3", "running"))
    any_store.forget_run_if_running("r3")
    any_store.forget_run_if_running("r1")  # ended: kept
    assert [(code, r.run_id, r.status) for code, r in any_store.runs("a")] == [
        ("x = 1", "r1", "ok"), ("print(x)", "r2", "error")]
    assert [(c, r.run_id, ev) for c, r, ev in any_store.history("a")] == [
        ("x = 1", "r1", [{"type": "stream", "text": "hi"}]), ("print(x)", "r2", None)]
    assert [(c, r.run_id, ev) for c, r, ev in any_store.history_iter("a")] == [
        ("x = 1", "r1", [{"type": "stream", "text": "hi"}]), ("print(x)", "r2", None)]
    assert any_store.run_events("r1") == [{"type": "stream", "text": "hi"}] and any_store.run_events("r2") == []
    got = any_store.get_run("r2")
    assert got is not None and got.status == "error" and any_store.get_run("nope") is None
    assert any_store.has_runs("a") and not any_store.has_runs("b")
    assert any_store.run_count("a") == 2 and any_store.run_count("b") == 0


def test_a_new_session_taking_an_id_owns_none_of_the_old_records(any_store: SessionStore) -> None:
    _save(any_store, _info("a"))
    any_store.take_id("a", "acme")
    any_store.add_run("x", _run("a", "r1"))
    any_store.add_session_file("a", _artifact("notebook.ipynb"))
    assert any_store.owner("a") == "acme" and any_store.owner("b") is None
    any_store.delete("a")
    assert any_store.get("a") is None and any_store.run_count("a") == 1  # runs outlive the session
    any_store.take_id("a", "other")
    assert any_store.owner("a") == "other" and any_store.run_count("a") == 0 and any_store.session_files("a") == []


def test_session_files_are_in_the_order_they_were_last_written(any_store: SessionStore) -> None:
    for name, size in (("a.ipynb", 1), ("b.ipynb", 2), ("a.ipynb", 3)):
        any_store.add_session_file("s", _artifact(name, size))
    assert [(a.path, a.size_bytes) for a in any_store.session_files("s")] == [("b.ipynb", 2), ("a.ipynb", 3)]


def test_checkpoints_newest_first_with_their_tenant(any_store: SessionStore) -> None:
    for n in range(3):
        any_store.add_checkpoint(CheckpointInfo(checkpoint_id=f"c{n}", session_id="s", saved=[], bytes=0,
                                                created_at=T0 + timedelta(seconds=n)), "acme")
    assert [c.checkpoint_id for c in any_store.checkpoints("s")] == ["c2", "c1", "c0"]
    found = any_store.checkpoint("c1")
    assert found is not None and found[0].checkpoint_id == "c1" and found[1] == "acme"
    any_store.delete_checkpoint("c1")
    assert any_store.checkpoint("c1") is None and len(any_store.checkpoints("s")) == 2


def test_code_any_python_runs_is_stored(any_store: SessionStore) -> None:
    # A lone surrogate (JSON "\udcff") and a NUL character run in Python; neither backend may
    # fail the write (PostgreSQL's text holds no NUL: kept escaped there). Output is JSON.
    code = "s = '\udcff'; t = '\x00'"
    any_store.add_run(code, _run("a", "r1", stdout="\x00"))
    [(stored, result)] = any_store.runs("a")
    assert stored.startswith("s = '\\udcff'; t = '") and result.stdout == "\x00"


def test_each_mcp_connection_names_its_manager_until_it_ends(any_store: SessionStore) -> None:
    """Where an MCP connection lives, for the other managers to forward to (api/forwarding.py)."""
    assert any_store.mcp_session_manager("c1") is None
    any_store.record_mcp_session("c1", "m-a")
    any_store.record_mcp_session("c2", "m-b")
    assert (any_store.mcp_session_manager("c1"), any_store.mcp_session_manager("c2")) == ("m-a", "m-b")
    any_store.forget_mcp_session("c1")
    assert any_store.mcp_session_manager("c1") is None and any_store.mcp_session_manager("c2") == "m-b"
