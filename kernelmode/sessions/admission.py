"""Admission: whether a new (or woken) session may take a kernel: its id is free (also of a
closed session of another tenant, whose records stay that tenant's), the server holds fewer than
``sessions.max_sessions`` and the tenant fewer than its ``max_sessions``. Sessions whose kernel is
still starting count as held (``creating``)."""

from __future__ import annotations

from collections.abc import Mapping

from ..audit import audit
from ..config import Settings
from ..errors import QuotaExceeded, SessionExists, TooManySessions
from ..tenants import Principal
from .live import LiveView
from .store import SessionStore


class Admission:
    """``live``: the manager's live sessions; ``creating``: session id -> tenant while its kernel
    starts (both read here, kept by the manager)."""

    def __init__(self, settings: Settings, store: SessionStore, live: LiveView,
                 creating: Mapping[str, str]) -> None:
        self.settings = settings
        self.store = store
        self.live = live
        self.creating = creating

    @property
    def count(self) -> int:
        """Sessions that hold (or are taking) a kernel."""
        return len(self.live) + len(self.creating)

    def check_room(self, sid: str, principal: Principal) -> None:
        """Room for a new session ``sid`` of ``principal`` (SessionExists, TooManySessions, QuotaExceeded)."""
        tenant = principal.tenant
        owner = self.store.owner(sid)
        if (sid in self.live or sid in self.creating or self.store.get(sid) is not None
                or owner not in (None, tenant)):  # a closed session's records stay its tenant's
            raise SessionExists(f"session {sid!r} already exists")
        self.check_capacity(tenant, principal.max_sessions)

    def check_wake(self, session_id: str, tenant: str | None) -> None:
        """Room to wake a hibernated session of ``tenant``: a wake is an admission (the same
        caps and errors as a create); refused, the session stays hibernated, untouched."""
        cap = next((t.max_sessions for t in self.settings.server.tenants if t.name == tenant), None)
        self.check_capacity(tenant, cap, f"session {session_id!r} stays hibernated: close a session "
                            "or wait for one to hibernate, then use it again")

    def check_capacity(self, tenant: str | None, cap: int | None = None,
                       advice: str = "delete one or wait for idle sessions to expire") -> None:
        """Room for one more live session (the server's cap, and the tenant's ``cap``)."""
        if self.count >= self.settings.sessions.max_sessions:
            raise TooManySessions(
                f"the server holds its maximum of {self.settings.sessions.max_sessions} sessions; {advice}"
            )
        if cap is not None:
            held = (sum(1 for s in self.live if s.info.tenant == tenant)
                    + sum(1 for t in self.creating.values() if t == tenant))
            if held >= cap:
                audit("quota_refused", tenant=tenant, quota="max_sessions", limit=cap)
                raise QuotaExceeded(f"tenant {tenant!r} holds its maximum of {cap} sessions; {advice}")
