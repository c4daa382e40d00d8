"""Pages of a session listing: a tenant with thousands of sessions gets them ``limit`` at a time.

Order is stable: creation time, then session id (REST), or the reverse, newest first (MCP
``list_sessions``: an agent looks for its latest sessions). A cursor is the position after a
page's last session (its creation time and id), so sessions deleted meanwhile never shift the next
page and sessions created meanwhile come at the end (oldest first; newest first they come on a
new first page). It is opaque to callers (base64url of JSON) and bound to the tenant that listed
and to the order: another tenant's cursor, or one of the other order, is refused, never read as a
position in this listing. The store answers a page from its indexes (``SessionStore.page``): a
page reads ``limit + 1`` rows, however many sessions are stored.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterable
from datetime import datetime

from ..errors import InvalidRequest
from ..models import SessionInfo
from ..tenants import Principal

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_MAX_CURSOR_CHARS = 512  # a cursor we made is ~150 characters: anything much longer is not one
_NEWEST = "newest"  # a newest-first cursor says so; an oldest-first one is as it always was

# (tenant or None for every tenant's, after this position, at most this many, newest first) ->
# the sessions in that order: SessionStore.page.
Fetch = Callable[[str | None, tuple[datetime, str] | None, int, bool], list[SessionInfo]]


def page_limit(raw: str | int | None) -> int:
    """A page size given as text (a query string's) or a number; InvalidRequest outside 1..MAX_LIMIT."""
    if raw is None:
        return DEFAULT_LIMIT
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_LIMIT):
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}, not {str(raw)[:40]!r}")
    return int(text)


def _key(info: SessionInfo) -> tuple[datetime, str]:
    return info.created_at, info.session_id


def encode_cursor(info: SessionInfo, principal: Principal, newest_first: bool = False) -> str:
    """The cursor of the position after ``info`` in ``principal``'s listing."""
    data = {"v": 1, "tenant": principal.tenant, "created_at": info.created_at.isoformat(),
            "session_id": info.session_id, **({"order": _NEWEST} if newest_first else {})}
    raw = json.dumps(data, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, principal: Principal, newest_first: bool = False) -> tuple[datetime, str]:
    """The position a cursor names; InvalidRequest for anything this server did not hand out to
    ``principal``'s tenant for a listing in this order."""
    bad = InvalidRequest("cursor is not one this server handed out: pass next_cursor of the previous "
                         "page unchanged, or no cursor for the first page")
    if not cursor or len(cursor) > _MAX_CURSOR_CHARS:
        raise bad
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(data, dict) or data.get("v") != 1:
            raise bad
        tenant, created, sid = data["tenant"], datetime.fromisoformat(data["created_at"]), data["session_id"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(tenant, str) or not isinstance(sid, str) or created.tzinfo is None:
        raise bad
    if tenant != principal.tenant:
        raise InvalidRequest("cursor belongs to another tenant's listing: page with your own next_cursor")
    if (data.get("order") == _NEWEST) != newest_first:  # REST's cursor given to MCP, or the reverse
        raise InvalidRequest("cursor belongs to a listing in the other order (REST lists oldest first, MCP "
                             "list_sessions newest first): page with this listing's own next_cursor")
    return created, sid


def page_from(fetch: Fetch, principal: Principal, limit: int = DEFAULT_LIMIT, cursor: str | None = None,
              newest_first: bool = False) -> tuple[list[SessionInfo], str | None]:
    """The ``limit`` sessions ``principal`` may see after ``cursor`` (in creation order, then id;
    or the reverse), and the cursor of the next page (None when none remain). ``fetch`` is asked
    for one row more than the page, which says whether another page follows; it is not asked at
    all when the cursor is refused."""
    after = decode_cursor(cursor, principal, newest_first) if cursor is not None else None
    rows = fetch(None if principal.admin else principal.tenant, after, limit + 1, newest_first)
    shown = rows[:limit]
    return shown, encode_cursor(shown[-1], principal, newest_first) if len(rows) > limit else None


def page(infos: Iterable[SessionInfo], principal: Principal, limit: int = DEFAULT_LIMIT,
         cursor: str | None = None, newest_first: bool = False) -> tuple[list[SessionInfo], str | None]:
    """``page_from`` over sessions in hand: the order and cursors a store's page must give (the
    unit tests hold SessionStore.page to it)."""
    held = list(infos)

    def fetch(tenant: str | None, after: tuple[datetime, str] | None, n: int,
              newest: bool) -> list[SessionInfo]:
        mine = sorted((i for i in held if tenant is None or i.tenant == tenant), key=_key, reverse=newest)
        if after is not None:
            mine = [i for i in mine if (_key(i) < after if newest else _key(i) > after)]
        return mine[:n]

    return page_from(fetch, principal, limit, cursor, newest_first)
