"""bench/managers.py's accounting of runs, without a server: an acknowledged run missing from the
store, a run stored twice and a run stored but never acknowledged are each counted, read from a
store the real SqliteStore wrote; the failover report says when a series never answered."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from managers import Group
from managers_failover import FailoverSeries, Kill, check, failover_report

from kernelmode.models import RunResult
from kernelmode.sessions.store import SqliteStore


def test_group_store_check_counts_lost_duplicated_and_unacknowledged(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "sessions.sqlite3")
    for run_id, value in (("r1", "1"), ("r2", "2"), ("r3", "2")):  # r3: x = 2 a second time
        store.add_run("x += 1; x", RunResult(run_id=run_id, session_id="s", status="ok", result=value))
    store.close()
    ms: Any = SimpleNamespace(data_dir=lambda i: tmp_path)
    g = Group("sqlite-1", 1, ms, lb=None, store_url=None, pg=None)  # type: ignore[arg-type]
    g.acked = {"s": ["r1", "r2", "r9"]}  # r9 acknowledged, never stored
    assert g.check_store() == {"acked": 3, "lost": 1, "extra": 1, "duplicated": 1}


def test_failover_check_counts_a_request_stored_twice() -> None:
    stored = [("a", "v = 'n'", {}), ("b", "v  # ask 1 x", {}), ("c", "v  # ask 1 x", {})]
    acked = [("a", "v = 'n'"), ("b", "v  # ask 1 x"), ("d", "v  # ask 2 y")]
    assert check(lambda sid: stored, "s", acked) == {"acked": 3, "lost": 1, "extra": 1, "duplicated": 1}


def test_a_series_that_never_answered_is_not_clean_and_says_so() -> None:
    never = FailoverSeries(3.0, [Kill(0, wrong=["no lease on the session in the store after its creation"])],
                           planned=20, stopped="stopped after 1 of 20 kills")
    answered = FailoverSeries(3.0, [Kill(1, answered_s=4.2, store={"acked": 3, "lost": 0, "duplicated": 0})])
    assert not never.clean and answered.clean
    text = failover_report([never, answered])
    assert "0 of 1 | - |" in text and "stopped after 1 of 20 kills" in text
    assert "1 of 1 | 4.20 | **4.20**" in text
