"""Rebalancing's decision (``plan``: how many idle sessions to hand to whom) and its store side
on a real PostgreSQL (a targeted handover: the lease given to the receiver in one statement,
found by it alone, cleared when it adopts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmode.sessions.rebalance import plan
from kernelmode.sessions.store import SessionStore
from tests.support.postgres import store_on
from tests.unit.test_ownership import _expire


def _converge(counts: dict[str, int], per_round: int = 2) -> tuple[dict[str, int], int]:
    """Rounds of every manager until nobody hands anything: the counts, and the rounds it took."""
    for rounds in range(1000):
        moved = False
        for me in sorted(counts):
            decided = plan(counts, me, per_round)
            if decided is not None:
                receiver, n = decided
                assert 0 < n <= per_round
                counts[me] -= n
                counts[receiver] += n
                moved = True
        if not moved:
            return counts, rounds
    raise AssertionError("no convergence")


def test_a_manager_that_joins_gets_its_fair_share_gently() -> None:
    assert plan({"a": 6, "b": 0}, "a", 2) == ("b", 2)  # at most per_round a round
    assert plan({"a": 6, "b": 0}, "b", 2) is None  # the underloaded one hands nothing
    assert plan({"a": 4, "b": 2}, "a", 2) == ("b", 1)  # never below the fair share (3)
    assert _converge({"a": 6, "b": 0})[0] == {"a": 3, "b": 3}
    assert _converge({"a": 7, "b": 0})[0] == {"a": 4, "b": 3}
    assert sorted(_converge({"a": 10, "b": 0, "c": 2})[0].values()) == [4, 4, 4]


def test_nothing_moves_within_the_slack_or_alone() -> None:
    assert plan({"a": 5}, "a", 2) is None  # nobody to hand to
    assert plan({"a": 3, "b": 3}, "a", 2) is None
    assert plan({"a": 4, "b": 3}, "a", 2) is None  # the share rounded up
    assert plan({"a": 105, "b": 95}, "a", 2) is None  # within a tenth of the share
    assert plan({"a": 112, "b": 88}, "a", 2) == ("b", 2)
    assert plan({"a": 5}, "gone", 2) is None  # this manager's row is not live


def test_counts_converge_and_never_oscillate() -> None:
    counts, rounds = _converge({"a": 100, "b": 0, "c": 0, "d": 3}, per_round=3)
    assert max(counts.values()) - min(counts.values()) <= max(1, 26 // 10 + 1) and rounds < 100
    for me in counts:
        assert plan(counts, me, 3) is None


@pytest.fixture
def pg_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionStore]:
    yield from store_on("postgresql", request, tmp_path)


def test_a_handed_lease_is_the_receivers_alone_until_it_adopts(pg_store: SessionStore) -> None:
    leases, managers = pg_store.leases, pg_store.managers
    for m in ("a", "b", "c"):
        managers.beat(m, f"http://{m}:1", m, 60)
    for sid in ("s1", "s2", "s3"):
        assert leases.acquire(sid, "a", 60)
    assert leases.acquire(":reaper", "a", 60)  # a singleton is no session: not counted
    assert leases.counts() == {"a": 3, "b": 0, "c": 0}
    assert leases.hand_over("s1", "a", "b", 60)
    assert not leases.hand_over("s1", "a", "c", 60)  # not a's any more
    assert not leases.hand_over("s9", "a", "b", 60)  # never a's
    assert leases.counts() == {"a": 2, "b": 1, "c": 0}
    assert leases.owner("s1") == "b" and leases.handed("b") == ["s1"] and leases.handed("c") == []
    assert not leases.acquire("s1", "c", 60)  # nobody else takes it
    assert leases.acquire("s1", "b", 60)  # the receiver's adoption: handed no more
    assert leases.handed("b") == [] and leases.owner("s1") == "b"
    _expire(pg_store, "s2")
    assert not leases.hand_over("s2", "a", "b", 60)  # an expired lease is anybody's: not handed
    managers.beat("c", "http://c:1", "c", 0)  # c died: not counted
    assert set(leases.counts()) == {"a", "b"}


def test_a_draining_manager_is_never_chosen_to_receive(pg_store: SessionStore) -> None:
    """A manager that began its drain (a stop's first step) would adopt nothing: it is left out
    of the counts the choice is made from, and a handover decided before its mark is refused in
    the statement itself (the lease stays the giver's, and expires at once for a scan to adopt)."""
    leases, managers = pg_store.leases, pg_store.managers
    for m in ("a", "b", "c"):
        managers.beat(m, f"http://{m}:1", m, 60)
    for sid in ("s1", "s2", "s3", "s4", "s5", "s6"):
        assert leases.acquire(sid, "a", 60)
    assert leases.acquire("s7", "c", 60)
    assert plan(leases.counts(), "a", 2) == ("b", 2)  # b, with none, is the receiver
    managers.drain("b")
    assert leases.counts() == {"a": 6, "c": 1}
    assert plan(leases.counts(), "a", 2) == ("c", 2)  # b is passed by
    managers.beat("b", "http://b:1", "b", 60)  # a beat while draining keeps the mark
    assert "b" not in leases.counts()
    assert not leases.hand_over("s1", "a", "b", 60)  # decided from counts read before the mark
    assert leases.owner("s1") == "a" and leases.handed("b") == []
    assert leases.expire("s1", "a") and leases.owner("s1") is None and "s1" in leases.expired()
    assert not leases.expire("s2", "c")  # only the holder's own
    managers.drain("c")
    assert plan(leases.counts(), "a", 2) is None  # nobody left to receive


def test_an_even_load_is_read_every_few_rounds_not_every_beat(pg_store: SessionStore) -> None:
    """The counts statement runs on every manager: a round that hands nothing (even load, or no
    idle session to hand) lets the next QUIET_ROUNDS - 1 pass without asking the store."""
    import asyncio
    from types import SimpleNamespace

    from kernelmode.sessions.rebalance import QUIET_ROUNDS, Rebalance

    leases, managers = pg_store.leases, pg_store.managers
    for m in ("a", "b"):
        managers.beat(m, f"http://{m}:1", m, 60)
    assert leases.acquire("s1", "a", 60) and leases.acquire("s2", "b", 60)
    asked: list[dict[str, int]] = []

    async def off_loop(work, *args):  # type: ignore[no-untyped-def]
        return work(*args)

    def counts() -> dict[str, int]:
        asked.append(leases.counts())
        return asked[-1]

    own = SimpleNamespace(active=True, manager_id="a", off_loop=off_loop, side=SimpleNamespace(
        leases=SimpleNamespace(counts=counts)))
    settings = SimpleNamespace(store=SimpleNamespace(rebalance=True, rebalance_per_round=2),
                               gateway=SimpleNamespace(url="http://gw"))
    m = SimpleNamespace(ownership=own, settings=settings, drain=SimpleNamespace(draining=False))
    r = Rebalance(m, [])  # type: ignore[arg-type]

    async def rounds(n: int) -> None:
        for _ in range(n):
            assert await r.round() == []

    asyncio.run(rounds(2 * QUIET_ROUNDS))
    assert len(asked) == r.asked == 2  # even: once each QUIET_ROUNDS rounds
    for sid in ("s3", "s4", "s5", "s6"):  # above the share, but nothing of a's is idle here
        assert leases.acquire(sid, "a", 60)
    asyncio.run(rounds(QUIET_ROUNDS))
    assert len(asked) == 3 and asked[-1] == {"a": 5, "b": 1}
