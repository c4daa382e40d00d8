"""Leases (sessions/store/leases.py) on both backends: what acquire, renew, release, expired and
owner answer, and that managers racing for the same sessions (threads with a connection each;
on PostgreSQL processes too) end with exactly one owner per session.

Expiry is tested with a lease of 0 s (expired as soon as it is taken), never with a sleep."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from pathlib import Path

import pytest

from kernelmode.sessions.store import SessionStore, SqliteStore, new_manager_id

SESSIONS = 40  # ids raced for; each is one round of every contender


def test_a_lease_has_one_holder_until_it_expires(any_store: SessionStore) -> None:
    leases = any_store.leases
    assert leases.owner("s") is None and leases.expired() == []
    assert leases.acquire("s", "m1", 60)
    assert not leases.acquire("s", "m2", 60) and leases.owner("s") == "m1"
    assert leases.acquire("s", "m1", 60)  # the holder again: extended
    assert leases.renew("s", "m1", 60) and not leases.renew("s", "m2", 60)
    assert not leases.release("s", "m2") and leases.owner("s") == "m1"
    assert leases.release("s", "m1") and leases.owner("s") is None
    assert not leases.renew("s", "m1", 60)  # released: nothing to renew


def test_an_expired_lease_is_anyones(any_store: SessionStore) -> None:
    leases = any_store.leases
    assert leases.acquire("dead", "m1", 0)  # expires as it is taken: m1 stopped renewing
    assert leases.acquire("live", "m1", 60)
    assert leases.owner("dead") is None and leases.expired() == ["dead"]
    assert not leases.renew("dead", "m1", 60)  # too late: the manager must stop acting for it
    assert leases.acquire("dead", "m2", 60) and leases.owner("dead") == "m2"
    assert leases.expired() == [] and leases.owner("live") == "m1"


def test_manager_ids_differ() -> None:
    assert len({new_manager_id() for _ in range(100)}) == 100


def _open(backend: str, where: str) -> SessionStore:
    if backend == "sqlite":
        return SqliteStore(Path(where))
    from kernelmode.sessions.store.postgres import PostgresStore

    return PostgresStore(where)


def _where(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "sessions.sqlite3") if backend == "sqlite" else request.getfixturevalue("pg_url")


@pytest.mark.parametrize("any_store", ["sqlite", "postgresql"], indirect=True)
def test_managers_racing_for_sessions_get_one_owner_each(any_store: SessionStore, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    backend = request.node.callspec.params["any_store"]
    where = _where(backend, tmp_path, request)
    contenders = 6
    stores = [_open(backend, where) for _ in range(contenders)]  # a connection each, as managers have
    start = threading.Barrier(contenders)
    won: list[list[str]] = [[] for _ in range(contenders)]

    def contend(n: int) -> None:
        for i in range(SESSIONS):
            start.wait(timeout=60)  # every round starts together
            if stores[n].leases.acquire(f"s{i}", f"m{n}", 60):
                won[n].append(f"s{i}")

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for s in stores:
        s.close()
    assert Counter(sid for w in won for sid in w) == Counter({f"s{i}": 1 for i in range(SESSIONS)})
    for n, sids in enumerate(won):
        assert all(any_store.leases.owner(sid) == f"m{n}" for sid in sids)


def _contend_in_process(url: str, n: int, start: threading.Barrier, won: multiprocessing.Queue) -> None:
    from kernelmode.sessions.store.postgres import PostgresStore

    store = PostgresStore(url)  # after the fork: a connection of this process's own
    for i in range(SESSIONS):
        start.wait(timeout=60)
        if store.leases.acquire(f"s{i}", f"m{n}", 60):
            won.put(f"s{i}")
    store.close()


@pytest.mark.parametrize("any_store", ["postgresql"], indirect=True)
def test_manager_processes_racing_get_one_owner_each(any_store: SessionStore, pg_url: str) -> None:
    ctx = multiprocessing.get_context("fork")
    start, won = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_contend_in_process, args=(pg_url, n, start, won)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    got = [won.get(timeout=10) for _ in range(SESSIONS)]
    assert sorted(got) == sorted(f"s{i}" for i in range(SESSIONS)) and won.empty()
