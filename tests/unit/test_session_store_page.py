"""The store answers a listing page from its indexes (SessionStore.page): the order, ties and
tenants of listing.page (the reference) on both backends (``any_store``: SQLite and PostgreSQL),
rows outside the page never read, the listing columns kept in step with the record, and a store
made by the code before them opened and listed (SQLite's own)."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from kernelmode.errors import InvalidRequest
from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.listing import page, page_from
from kernelmode.sessions.store import SessionStore, SqliteStore
from kernelmode.tenants import ADMIN, Principal
from tests.support.postgres import PgCluster

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
ACME, OTHER = Principal("acme"), Principal("other")


def _info(sid: str, tenant: str | None, micros: int, status: str = "idle") -> SessionInfo:
    t = T0 + timedelta(microseconds=micros)
    return SessionInfo(session_id=sid, status=status, created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none", tenant=tenant)


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "sessions.sqlite3")
    yield s
    s.close()


def _fill(store: SessionStore, infos: list[SessionInfo]) -> None:
    for i in infos:
        store.save(i, f"k-{i.session_id}", Path("/nowhere") / i.session_id)


def _walk(fetch_or_infos: SessionStore | list[SessionInfo], who: Principal, limit: int,
          newest_first: bool) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        if isinstance(fetch_or_infos, SessionStore):
            shown, cursor = page_from(fetch_or_infos.page, who, limit, cursor, newest_first)
        else:
            shown, cursor = page(fetch_or_infos, who, limit, cursor, newest_first)
        pages.append([i.session_id for i in shown])
        if cursor is None:
            return pages


def test_pages_are_in_creation_order_with_ties_broken_by_id_both_ways(any_store: SessionStore) -> None:
    # Pairs share a creation time (to the microsecond); neighbours are one microsecond apart.
    infos = [_info(f"s{i}", "acme", i // 2) for i in range(7)]
    _fill(any_store, infos[::-1])
    assert _walk(any_store, ACME, 3, False) == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]
    assert _walk(any_store, ACME, 3, True) == [["s6", "s5", "s4"], ["s3", "s2", "s1"], ["s0"]]
    assert _walk(any_store, ACME, 7, True) == [[f"s{i}" for i in range(6, -1, -1)]]  # one page: no cursor
    assert _walk(any_store, OTHER, 3, False) == [[]]


def test_the_store_pages_exactly_as_the_reference_for_every_tenant(any_store: SessionStore) -> None:
    rng = random.Random(8)
    tenants = ["acme", "other", None]  # None: made before tenants existed, the admin's alone
    infos = [_info(f"id{rng.randrange(10**6):06d}-{n}", rng.choice(tenants), rng.randrange(40))
             for n in range(120)]  # many ties on creation time
    _fill(any_store, infos)
    for who in (ACME, OTHER, ADMIN):
        for limit in (1, 7, 1000):
            for newest_first in (False, True):
                assert _walk(any_store, who, limit, newest_first) == _walk(infos, who, limit, newest_first)
    acme = [sid for p in _walk(any_store, ACME, 10, False) for sid in p]
    assert len(acme) == sum(i.tenant == "acme" for i in infos) and len(set(acme)) == len(acme)


def test_a_page_reads_only_its_rows(store: SqliteStore, tmp_path: Path) -> None:
    _fill(store, [_info(f"s{i}", "acme", i) for i in range(10)])
    # A record that cannot be decoded (JSON, as the store's triggers read it, but no session),
    # among acme's latest and every tenant's: a page that read it (or read every row to sort
    # them) would fail.
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    db.execute("INSERT INTO sessions (session_id, info, tenant, created_us, status) VALUES ('broken', "
               "'{\"status\": \"idle\", \"tenant\": \"acme\"}', 'acme', (SELECT MAX(created_us) + 1 FROM sessions), 'idle')")
    db.commit()
    db.close()
    assert [i.session_id for i in store.page("acme", None, 4)] == ["s0", "s1", "s2", "s3"]
    after = (_info("s5", "acme", 5).created_at, "s5")
    assert [i.session_id for i in store.page(None, after, 3)] == ["s6", "s7", "s8"]
    assert [i.session_id for i in store.page("acme", after, 3, newest_first=True)] == ["s4", "s3", "s2"]
    with pytest.raises(ValueError):  # the same query reaching the row does read it
        store.page("acme", None, 11)
    # Each listing query walks an index in its order: no scan of the table, no sort of it.
    for sql in ("SELECT info FROM sessions WHERE tenant = ? AND (created_us, session_id) > (?, ?) "
                "ORDER BY created_us ASC, session_id ASC LIMIT ?",
                "SELECT info FROM sessions WHERE (created_us, session_id) < (?, ?) "
                "ORDER BY created_us DESC, session_id DESC LIMIT ?"):
        plan = " ".join(r[-1] for r in store._db.execute(f"EXPLAIN QUERY PLAN {sql}", (1,) * sql.count("?")))
        assert "USING INDEX" in plan and "TEMP B-TREE" not in plan, plan


def test_listing_columns_follow_the_record(any_store: SessionStore) -> None:
    a, b = _info("a", "acme", 1), _info("b", "other", 2, status="hibernated")
    _fill(any_store, [a, b])
    assert any_store.status_counts() == {"idle": 1, "hibernated": 1}
    assert [i.session_id for i in any_store.hibernated()] == ["b"]
    assert any_store.hibernated("acme") == [] and [i.session_id for i in any_store.hibernated("other")] == ["b"]
    any_store.mark_lost(a)
    any_store.save(b.model_copy(update={"status": "idle"}), "k-b2", Path("/nowhere/b"))
    assert any_store.status_counts() == {"lost": 1, "idle": 1} and any_store.hibernated() == []
    any_store.delete("a")
    assert [i.session_id for i in any_store.page(None, None, 10)] == ["b"]
    assert any_store.page("acme", None, 10) == []


def test_cursors_are_bound_to_their_order(any_store: SessionStore) -> None:
    _fill(any_store, [_info(f"s{i}", "acme", i) for i in range(3)])
    _, oldest = page_from(any_store.page, ACME, 1)
    _, newest = page_from(any_store.page, ACME, 1, newest_first=True)
    assert oldest is not None and newest is not None
    with pytest.raises(InvalidRequest, match="other order"):
        page_from(any_store.page, ACME, 1, oldest, newest_first=True)
    with pytest.raises(InvalidRequest, match="other order"):
        page_from(any_store.page, ACME, 1, newest)


# The sessions table as every any_store before the listing columns made it (and its other tables).
_OLD_SCHEMA = """
CREATE TABLE sessions (session_id TEXT PRIMARY KEY, kernel_id TEXT, workspace TEXT, info TEXT NOT NULL);
CREATE TABLE runs (run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
                   code TEXT NOT NULL, result TEXT NOT NULL, events TEXT);
CREATE TABLE owners (session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL);
"""


def test_a_store_made_before_the_listing_columns_opens_and_lists(tmp_path: Path) -> None:
    path = tmp_path / "old" / "sessions.sqlite3"
    path.parent.mkdir()
    infos = [_info(f"s{i}", ["acme", "other", None][i % 3], i // 2, "hibernated" if i == 4 else "lost")
             for i in range(9)]
    old = sqlite3.connect(path)
    old.executescript(_OLD_SCHEMA)
    old.executemany("INSERT INTO sessions VALUES (?, ?, ?, ?)",
                    [(i.session_id, f"k{n}", f"/w/{n}", i.model_dump_json()) for n, i in enumerate(infos[::-1])])
    old.commit()
    old.close()
    store = SqliteStore(path)
    try:
        for who in (ACME, OTHER, ADMIN):
            for newest_first in (False, True):
                assert _walk(store, who, 2, newest_first) == _walk(infos, who, 2, newest_first)
        assert [i.session_id for i in store.hibernated()] == ["s4"]
        assert store.status_counts() == {"lost": 8, "hibernated": 1}
        assert [i.session_id for i in store.all()] == [i.session_id for i in infos]
        assert store.get("s3") == infos[3] and store.workspace("s0") == Path("/w/8")
        indexes = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {"sessions_by_created", "sessions_by_tenant", "sessions_by_status"} <= indexes
    finally:
        store.close()
    # The old code runs on it again (a downgrade): it marks the hibernated session lost in the
    # record alone, and adds one without the columns.
    old = sqlite3.connect(path)
    old.execute("UPDATE sessions SET info=? WHERE session_id='s4'",
                (infos[4].model_copy(update={"status": "lost"}).model_dump_json(),))
    late = _info("late", "acme", 100, "lost")
    old.execute("INSERT INTO sessions (session_id, kernel_id, workspace, info) VALUES ('late', 'k', '/w', ?)",
                (late.model_dump_json(),))
    old.commit()
    old.close()
    again = SqliteStore(path)
    try:
        assert again._db.execute("SELECT COUNT(*) FROM sessions WHERE created_us IS NULL").fetchone()[0] == 0
        assert _walk(again, ADMIN, 4, False) == _walk([*infos, late], ADMIN, 4, False)
        assert again.hibernated() == [] and again.status_counts() == {"lost": 10}
    finally:
        again.close()


def test_pages_keep_byte_order_on_a_database_with_a_language_collation(pg_cluster: PgCluster) -> None:
    # An ICU en-US database sorts "a" before "B" and ignores "-" and "_" at first; the store's
    # ids are in byte order still (as SQLite's and Python's), so pages match the reference.
    import psycopg

    from kernelmode.sessions.store.postgres import PostgresStore

    with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
        conn.execute('DROP DATABASE IF EXISTS "en_us"')
        conn.execute("CREATE DATABASE \"en_us\" TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' "
                     "LOCALE 'C.utf8'")
    store = PostgresStore(pg_cluster.url("en_us"))
    try:
        infos = [_info(sid, "acme", 1) for sid in ("B", "a", "a-b", "a_b", "ab", "A", "_x", "-y", "Z9")]
        _fill(store, infos)
        for newest_first in (False, True):
            assert _walk(store, ACME, 2, newest_first) == _walk(infos, ACME, 2, newest_first)
    finally:
        store.close()
