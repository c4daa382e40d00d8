"""Pages of a session listing: a tenant with thousands of sessions gets them ``limit`` at a time.

Order is stable: creation time, then session id. A cursor is the position after a page's last
session (its creation time and id), so sessions deleted meanwhile never shift the next page and
sessions created meanwhile come at the end. It is opaque to callers (base64url of JSON) and bound
to the tenant that listed: another tenant's cursor is refused, never read as a position in its own
listing.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from datetime import datetime

from ..errors import InvalidRequest
from ..models import SessionInfo
from ..tenants import Principal

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_MAX_CURSOR_CHARS = 512  # a cursor we made is ~150 characters: anything much longer is not one


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


def encode_cursor(info: SessionInfo, principal: Principal) -> str:
    """The cursor of the position after ``info`` in ``principal``'s listing."""
    raw = json.dumps({"v": 1, "tenant": principal.tenant, "created_at": info.created_at.isoformat(),
                      "session_id": info.session_id}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, principal: Principal) -> tuple[datetime, str]:
    """The position a cursor names; InvalidRequest for anything this server did not hand out to
    ``principal``'s tenant."""
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
    return created, sid


def page(infos: Iterable[SessionInfo], principal: Principal, limit: int = DEFAULT_LIMIT,
         cursor: str | None = None) -> tuple[list[SessionInfo], str | None]:
    """The ``limit`` sessions ``principal`` may see after ``cursor`` (in creation order, then id),
    and the cursor of the next page (None when none remain)."""
    after = decode_cursor(cursor, principal) if cursor is not None else None
    mine = sorted((i for i in infos if principal.may_see(i.tenant)), key=_key)
    if after is not None:
        mine = [i for i in mine if _key(i) > after]
    shown = mine[:limit]
    return shown, encode_cursor(shown[-1], principal) if len(mine) > limit else None
