"""Ownership's store side and decisions on both backends (``any_store``: SQLite, and a real
PostgreSQL the tests start): batch renewal, who owns what and where it is reached, a dead
manager's leases and marked kernels found once, a start that leaves other managers' sessions
alone, and a lost lease dropping the session from the live map without touching it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kernelmode.config import Settings
from kernelmode.sessions.live import LiveSessions
from kernelmode.sessions.ownership import Ownership
from kernelmode.sessions.store import SessionStore
from tests.unit.test_store_backends import _info, _save


def _expire(store: SessionStore, session_id: str) -> None:
    """The lease ran out (its manager stopped renewing), by the store's own clock."""
    past = "now() - interval '1 second'" if store.shared else "0"
    store._rows(f"UPDATE leases SET expires_at = {past} WHERE session_id = ? RETURNING session_id", (session_id,))


def test_renew_all_renews_the_leases_still_held_in_one_statement(any_store: SessionStore) -> None:
    leases = any_store.leases
    assert leases.acquire("a", "m1", 60) and leases.acquire("b", "m1", 60) and leases.acquire("c", "m1", 60)
    _expire(any_store, "b")
    assert leases.acquire("b", "m2", 60)  # taken by another since it expired
    _expire(any_store, "c")  # expired, not taken: lost all the same (the others may take it)
    assert leases.renew_all("m1", ["a", "b", "c", "never"], 60) == {"a"}
    assert leases.renew_all("m1", [], 60) == set()
    assert leases.held_elsewhere("m1") == {"b"} and leases.held_elsewhere("m2") == {"a"}


def test_owner_url_names_another_live_manager_only(any_store: SessionStore) -> None:
    m = any_store.managers
    m.beat("m1", "http://one:1", "h1", 60)
    m.beat("m2", "http://two:2", "h2", 60)
    assert m.live() == {"m1": "http://one:1", "m2": "http://two:2"}
    any_store.leases.acquire("a", "m1", 60)
    any_store.leases.acquire("b", "m2", 60)
    assert any_store.leases.owner_url("b", "m1") == "http://two:2"
    assert any_store.leases.owner_url("a", "m1") is None  # its own
    assert any_store.leases.owner_url("nobody", "m1") is None
    m.beat("m2", "http://two:2", "h2", 0)  # m2 stopped beating: no one to forward to
    assert any_store.leases.owner_url("b", "m1") is None and m.live() == {"m1": "http://one:1"}


def test_a_beat_says_whether_the_manager_was_alive_until_then(any_store: SessionStore) -> None:
    """The signal a manager frozen past its lease gets on waking: its row had expired, so
    another manager may have taken its pool kernels' marks (``orphaned_pool``) and shut them down."""
    m = any_store.managers
    assert m.beat("m1", "http://one:1", "h1", 60) is False  # the first beat: no row yet
    assert m.beat("m1", "http://one:1", "h1", 60) is True
    m.add_pool("k1", "m1")
    m.beat("m1", "http://one:1", "h1", 0)  # frozen past its expiry...
    assert m.orphaned_pool() == ["k1"]  # ...another manager takes its marks
    assert m.beat("m1", "http://one:1", "h1", 60) is False  # woken: told
    assert m.beat("m1", "http://one:1", "h1", 60) is True


def test_a_stop_or_a_restart_on_the_same_data_dir_frees_the_leases_at_once(any_store: SessionStore) -> None:
    m, leases = any_store.managers, any_store.leases
    m.beat("old", "http://x:1", "host:/data", 60)
    m.beat("other", "http://y:2", "host:/elsewhere", 60)
    leases.acquire("a", "old", 60)
    leases.acquire("b", "other", 60)
    m.beat("new", "http://x:1", "host:/data", 60)
    assert m.predecessors("new", "host:/data") == ["old"]
    assert leases.expired() == ["a"] and leases.owner("b") == "other"
    assert m.predecessors("new", "host:/data") == []
    leases.expire_all("other")
    m.leave("other")
    assert leases.expired() == ["a", "b"] and "other" not in m.live()


def test_a_dead_managers_marked_kernels_are_handed_out_once(any_store: SessionStore) -> None:
    m = any_store.managers
    m.beat("alive", "http://a:1", "ha", 60)
    m.beat("dead", "http://d:1", "hd", 0)
    m.add_pool("k-alive", "alive")
    m.add_pool("k-dead", "dead")
    m.add_pool("k-gone", "never-seen")
    assert m.pool_kernels() == {"k-alive", "k-dead", "k-gone"}
    assert m.orphaned_pool() == ["k-dead", "k-gone"]
    assert m.orphaned_pool() == []  # exactly one caller gets each
    m.drop_pool("k-alive")
    assert m.pool_kernels() == set()


def test_a_start_marks_lost_only_what_no_other_manager_leases(any_store: SessionStore) -> None:
    _save(any_store, _info("theirs", n=1), _info("unleased", n=2), _info("expired", n=3), _info("mine", n=4))
    any_store.leases.acquire("theirs", "m2", 60)
    any_store.leases.acquire("expired", "m2", 60)
    _expire(any_store, "expired")
    any_store.leases.acquire("mine", "m1", 60)
    assert any_store.mark_all_lost(keep=set(), manager_id="m1") == ["expired", "mine", "unleased"]
    assert any_store.get("theirs").status == "idle"  # type: ignore[union-attr]


@dataclass
class _Held:
    """What the live map and the heartbeat read of a live session: its info and connection."""

    info: Any
    conn: Any = None


def test_a_lost_lease_drops_the_session_from_the_live_map_and_touches_nothing(any_store: SessionStore) -> None:
    own = Ownership(any_store, Settings(), "m1", "http://one:1")
    own.active = True  # the SQLite store too: the same statements, one backend's clock
    live = LiveSessions()
    live.leases = own
    _save(any_store, _info("a"), _info("b"))
    live.add(_Held(_info("a")))  # type: ignore[arg-type]
    live.add(_Held(_info("b")))  # type: ignore[arg-type]
    own.live = live
    assert any_store.leases.owner("a") == "m1" and any_store.leases.owner("b") == "m1"
    _expire(any_store, "b")
    assert any_store.leases.acquire("b", "m2", 60)  # another manager adopted it
    assert asyncio.run(own.beat()) == ["b"]
    assert live.ids() == ["a"] and any_store.leases.owner("b") == "m2"
    assert any_store.get("b").status == "idle"  # type: ignore[union-attr]
    assert asyncio.run(own.beat()) == [] and any_store.leases.owner("a") == "m1"
    live.remove("a")  # a delete (or a hibernation) gives the lease up
    assert any_store.leases.owner("a") is None
    assert own.owner_url("b") is None  # m2 has no row: not alive as far as the store knows
    any_store.managers.beat("m2", "http://two:2", "h2", 60)
    assert own.owner_url("b") == "http://two:2"
    refusal = own.refusal(_info("b"))
    assert refusal is not None and "http://two:2" in refusal.message


def test_the_heartbeat_keeps_the_leases_of_sessions_being_adopted(any_store: SessionStore) -> None:
    own = Ownership(any_store, Settings(), "m1", "http://one:1")
    own.active = True
    own.live = LiveSessions()
    assert own.take("adopting") and own.take("forgotten")
    own.adopting.add("adopting")  # its kernel is being reached: not live yet, still this manager's
    assert asyncio.run(own.beat()) == []
    assert any_store.leases.renew_all("m1", ["adopting", "forgotten"], 60) == {"adopting", "forgotten"}
    _expire(any_store, "forgotten")
    _expire(any_store, "adopting")
    assert any_store.leases.acquire("adopting", "m2", 60)
    assert asyncio.run(own.beat()) == ["adopting"]  # taken meanwhile: reported lost (the takeover gives it up)
    assert any_store.leases.expired() == ["forgotten"]  # a lease neither live nor adopting is not renewed
