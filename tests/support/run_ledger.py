"""What the store holds of the runs a client had acknowledged: lost (acknowledged, not stored),
extra (stored, never acknowledged) and duplicated (one run's code or value stored twice: it was
executed twice). Shared by the several-managers tests and bench/managers.py."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

Row = tuple[str, str, dict[str, Any]]  # run_id, code, result record


def stored_runs(store_url: str, sid: str) -> list[Row]:
    """(run_id, code, result record) of every run a PostgreSQL store holds for ``sid``."""
    import psycopg

    with psycopg.connect(store_url, autocommit=True) as conn:
        rows = conn.execute("SELECT run_id, code, result FROM runs WHERE session_id=%s", (sid,)).fetchall()
    return [(str(r), str(code), json.loads(res)) for r, code, res in rows]


def by_code(row: Row) -> object:
    """Duplicates by code: for clients whose every run's code is unique."""
    return row[1]


def by_value(row: Row) -> object:
    """Duplicates by an ok run's value: for counters (``x += 1; x``), each value comes once."""
    return row[2].get("result") if row[2].get("status") == "ok" else None


def tally(stored: Iterable[Row], acked: Iterable[str], key: Callable[[Row], object] = by_code) -> dict[str, int]:
    stored, acked = list(stored), list(acked)
    ids = {r for r, _, _ in stored}
    keys = Counter(k for k in map(key, stored) if k is not None)
    return {"acked": len(acked), "lost": sum(1 for r in acked if r not in ids),
            "extra": len(ids - set(acked)), "duplicated": sum(n - 1 for n in keys.values() if n > 1)}
