"""Fencing (sessions/store/postgres.py): on a shared store, a manager writes a session's record
and runs only while it holds the session's lease, checked in the writing statement itself. A
manager frozen past its lease (another manager took the session and ended its run
``interrupted``) is refused, told (``Fence.lost``) and answered ``session_owned_elsewhere``; the
new owner's records stand. SQLite (one manager, no fence) writes as it always did."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kernelmode.errors import SessionOwnedElsewhere
from kernelmode.sessions.store import SessionStore
from tests.support.postgres import store_on
from tests.unit.test_ownership import _expire
from tests.unit.test_store_backends import _info, _run, _save


@dataclass
class _Fence:
    manager_id: str
    lost_ids: list[str] = field(default_factory=list)

    def lost(self, session_id: str) -> None:
        self.lost_ids.append(session_id)


@pytest.fixture
def pg_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionStore]:
    yield from store_on("postgresql", request, tmp_path)


def test_a_manager_that_lost_the_lease_cannot_overwrite_the_new_owners_records(pg_store: SessionStore) -> None:
    old, new = _Fence("m-old"), _Fence("m-new")
    pg_store.fence = old
    assert pg_store.leases.acquire("s", "m-old", 60)
    _save(pg_store, _info("s"))
    pg_store.add_run("while True: pass", _run("s", "r1", "running"))
    _expire(pg_store, "s")  # m-old froze past its lease; m-new takes the session over
    assert pg_store.leases.acquire("s", "m-new", 60)
    pg_store.fence = new
    pg_store.end_run(_run("s", "r1", "interrupted"))
    _save(pg_store, _info("s", status="idle", kernel="k-new"))
    pg_store.fence = old  # m-old wakes: its run ends, its record is saved
    with pytest.raises(SessionOwnedElsewhere):
        pg_store.add_run("while True: pass", _run("s", "r1", "ok", stdout="late"))
    with pytest.raises(SessionOwnedElsewhere):
        _save(pg_store, _info("s", status="busy", kernel="k-old"))
    with pytest.raises(SessionOwnedElsewhere):  # a new run of its own is not written either
        pg_store.add_run("1", _run("s", "r2", "running"))
    pg_store.forget_run_if_running("r1")  # quietly refused too
    assert old.lost_ids == ["s", "s", "s"] and new.lost_ids == []
    run = pg_store.get_run("r1")
    assert run is not None and run.status == "interrupted" and run.stdout == ""
    assert pg_store.get_run("r2") is None and pg_store.run_count("s") == 1
    info = pg_store.get("s")
    assert info is not None and info.kernel_id == "k-new" and info.status == "idle"


def test_the_lease_holder_writes_and_an_expired_lease_writes_nothing(pg_store: SessionStore) -> None:
    fence = _Fence("m1")
    pg_store.fence = fence
    with pytest.raises(SessionOwnedElsewhere):  # never leased: a manager never writes it
        _save(pg_store, _info("never"))
    assert pg_store.get("never") is None
    assert pg_store.leases.acquire("s", "m1", 60)
    _save(pg_store, _info("s"))
    pg_store.add_run("1", _run("s", "r1", "running"))
    pg_store.add_run("1", _run("s", "r1", "ok"))
    run = pg_store.get_run("r1")
    assert run is not None and run.status == "ok"
    _expire(pg_store, "s")  # expired, not taken yet: no longer this manager's to write
    with pytest.raises(SessionOwnedElsewhere):
        _save(pg_store, _info("s", status="busy"))
    assert fence.lost_ids == ["never", "s"]


def test_without_a_fence_writes_are_as_before(any_store: SessionStore) -> None:
    """SQLite (one manager), and PostgreSQL before ownership attaches: no lease is asked for."""
    _save(any_store, _info("s"))
    any_store.add_run("1", _run("s", "r1", "running"))
    any_store.add_run("1", _run("s", "r1", "ok"))
    any_store.forget_run_if_running("r1")
    run = any_store.get_run("r1")
    assert run is not None and run.status == "ok" and any_store.run_count("s") == 1


def test_an_adopters_end_never_overwrites_a_result_that_landed_before_it(pg_store: SessionStore) -> None:
    """The old owner recorded its run's real end just before the adopter took the lease; the
    adopter, which read the run as in flight before that, ends it ``interrupted``: the statement
    changes a run only while it is still running, so the real result stands."""
    pg_store.fence = _Fence("m-old")
    assert pg_store.leases.acquire("s", "m-old", 60)
    _save(pg_store, _info("s"))
    pg_store.add_run("1", _run("s", "r1", "running"))
    in_flight = pg_store.runs_in_flight()  # the adopter's read
    pg_store.add_run("1", _run("s", "r1", "ok", stdout="real"))  # the old owner's end lands
    _expire(pg_store, "s")
    assert pg_store.leases.acquire("s", "m-new", 60)
    pg_store.fence = _Fence("m-new")
    assert [r.run_id for r in in_flight] == ["r1"]
    assert pg_store.end_run(_run("s", "r1", "interrupted")) is False
    run = pg_store.get_run("r1")
    assert run is not None and run.status == "ok" and run.stdout == "real"
    assert pg_store.runs_in_flight() == []


def test_end_run_ends_a_run_still_running(any_store: SessionStore) -> None:
    _save(any_store, _info("s"))
    any_store.add_run("1", _run("s", "r1", "running"))
    assert any_store.end_run(_run("s", "r1", "interrupted")) is True
    run = any_store.get_run("r1")
    assert run is not None and run.status == "interrupted" and any_store.runs_in_flight() == []
    assert any_store.end_run(_run("s", "r1", "error")) is False  # ended: left as it is
    run = any_store.get_run("r1")
    assert run is not None and run.status == "interrupted"
