"""Pages of a session listing (sessions/listing.py): stable order, cursors that survive deletions
and refuse anything foreign, limits checked. The REST route over a real server:
tests/integration/test_sessions.py."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone

import pytest

from kernelmode.errors import InvalidRequest
from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.listing import MAX_LIMIT, decode_cursor, encode_cursor, page, page_limit
from kernelmode.tenants import ADMIN, Principal

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
ACME, OTHER = Principal("acme"), Principal("other")


def _info(sid: str, tenant: str, seconds: float) -> SessionInfo:
    t = T0 + timedelta(seconds=seconds)
    return SessionInfo(session_id=sid, status="idle", created_at=t, last_activity=t, ttl_seconds=60,
                       limits=Limits(), sandbox="none", tenant=tenant)


def _walk(infos: list[SessionInfo], who: Principal, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        shown, cursor = page(infos, who, limit, cursor)
        pages.append([i.session_id for i in shown])
        if cursor is None:
            return pages


def test_pages_walk_to_the_end_in_creation_order_then_id() -> None:
    # Two sessions share a creation time: the id breaks the tie, the same way every time.
    infos = [_info(f"s{i}", "acme", i // 2) for i in range(7)][::-1]
    assert _walk(infos, ACME, 3) == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]
    assert _walk(infos, ACME, 7) == [[f"s{i}" for i in range(7)]]  # exactly one page: no cursor
    assert _walk([], ACME, 3) == [[]]


def test_a_deletion_between_pages_neither_skips_nor_repeats() -> None:
    infos = [_info(f"s{i}", "acme", i) for i in range(6)]
    first, cursor = page(infos, ACME, 2)
    rest = [i for i in infos if i.session_id not in ("s1", "s2")]  # the page's last and the next's first
    second, cursor = page(rest, ACME, 2, cursor)
    assert [i.session_id for i in first + second] == ["s0", "s1", "s3", "s4"]
    third, cursor = page([*rest, _info("late", "acme", 100)], ACME, 2, cursor)
    assert [i.session_id for i in third] == ["s5", "late"] and cursor is None


def test_a_tenant_sees_only_its_own_and_cannot_page_with_anothers_cursor() -> None:
    infos = [_info(f"a{i}", "acme", i) for i in range(3)] + [_info(f"o{i}", "other", i) for i in range(3)]
    assert _walk(infos, ACME, 2) == [["a0", "a1"], ["a2"]]
    assert _walk(infos, ADMIN, 4) == [["a0", "o0", "a1", "o1"], ["a2", "o2"]]
    _, acme_cursor = page(infos, ACME, 1)
    assert acme_cursor is not None
    with pytest.raises(InvalidRequest, match="another tenant"):
        page(infos, OTHER, 1, acme_cursor)


@pytest.mark.parametrize("raw", ["0", "-1", str(MAX_LIMIT + 1), "ten", "1.5", "", " ", "+5", "٣", "9" * 40])
def test_bad_limits_are_refused_by_name(raw: str) -> None:
    with pytest.raises(InvalidRequest, match=f"limit must be an integer from 1 to {MAX_LIMIT}"):
        page_limit(raw)


def test_good_limits() -> None:
    assert page_limit(None) == 100 and page_limit("1") == 1 and page_limit(str(MAX_LIMIT)) == MAX_LIMIT


def _forge(data: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


@pytest.mark.parametrize("cursor", [
    "", "!!!", "x" * 600, "bm90IGpzb24", _forge([1, 2]), _forge({"v": 2}),
    _forge({"v": 1, "tenant": "acme", "created_at": "yesterday", "session_id": "s"}),
    _forge({"v": 1, "tenant": "acme", "created_at": "2026-01-01T00:00:00", "session_id": "s"}),  # no zone
    _forge({"v": 1, "tenant": "acme", "created_at": T0.isoformat(), "session_id": 5}),
    _forge({"v": 1, "tenant": "acme", "created_at": T0.isoformat()}),
    base64.urlsafe_b64encode(b"\xff\xfe").decode(),
])
def test_cursors_this_server_did_not_hand_out_are_refused(cursor: str) -> None:
    with pytest.raises(InvalidRequest, match="cursor is not one this server handed out"):
        decode_cursor(cursor, ACME)


def test_a_cursor_round_trips() -> None:
    info = _info("s1", "acme", 1.5)
    assert decode_cursor(encode_cursor(info, ACME), ACME) == (info.created_at, "s1")
