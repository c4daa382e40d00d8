"""run_ledger.tally: how the several-managers tests count lost and duplicated runs."""

from tests.support.run_ledger import by_code, by_value, tally


def _row(run_id: str, code: str, result: str | None, status: str = "ok") -> tuple[str, str, dict]:
    return run_id, code, {"status": status, "result": result}


def test_a_run_stored_twice_under_another_id_is_a_duplicate_and_a_missing_one_is_lost() -> None:
    stored = [_row("r1", "n += 1; seen.append('a'); n", "1"), _row("r2", "n += 1; seen.append('b'); n", "2")]
    assert tally(stored, ["r1", "r2"]) == {"acked": 2, "lost": 0, "extra": 0, "duplicated": 0}
    replayed = [*stored, _row("r3", "n += 1; seen.append('b'); n", "3")]  # 'b' run again on takeover
    assert tally(replayed, ["r1", "r2"], by_code) == {"acked": 2, "lost": 0, "extra": 1, "duplicated": 1}
    assert tally(stored[:1], ["r1", "r2"])["lost"] == 1


def test_by_value_counts_a_counter_value_twice_and_ignores_failed_runs() -> None:
    stored = [_row("r1", "x += 1; x", "1"), _row("r2", "x += 1; x", "1"), _row("r3", "x += 1; x", None, "interrupted")]
    assert tally(stored, ["r1", "r2", "r3"], by_value)["duplicated"] == 1
