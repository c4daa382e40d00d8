"""Tenants: who a bearer token belongs to, what it may see, and its quotas.

The admin token (``server.token``) is the ``admin`` tenant and sees every session. Each token in
``server.tenants`` is a tenant that sees only the sessions it created: another tenant's session
is answered exactly like an unknown id (404), on every front door. Quotas are per tenant, and
so are the ceilings of a session's limits (``max_limits``, lowering ``sandbox.max_limits``).
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from dataclasses import dataclass, field

from .audit import audit
from .config import ADMIN_TENANT, SandboxSettings, Settings
from .errors import LimitExceeded, QuotaExceeded
from .models import EgressNarrowing, Limits, LimitsPatch

RUN_WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class Principal:
    """The caller behind a request."""

    tenant: str
    admin: bool = False
    max_sessions: int | None = None
    runs_per_minute: int | None = None
    # The tenant's own ceilings (server.tenants[].max_limits); absent keys are the server's.
    max_limits: LimitsPatch | None = field(default=None, compare=False)
    # The tenant's narrowing of the server's egress (server.tenants[].egress); None: the server's.
    egress: EgressNarrowing | None = field(default=None, compare=False)

    def may_see(self, owner: str | None) -> bool:
        """Sessions made before tenants existed (no owner) are the admin's."""
        return self.admin or owner == self.tenant

    def limits(self, asked: LimitsPatch | None, sandbox: SandboxSettings) -> Limits:
        """A new session's limits: the defaults (lowered to this tenant's ceilings) with what it
        asked for. LimitExceeded names the first limit asked above its ceiling."""
        own = self.max_limits.model_dump(exclude_none=True) if self.max_limits else {}
        ceilings = sandbox.max_limits.model_copy(update=own)
        base = sandbox.limits.model_copy(
            update={k: min(v, getattr(ceilings, k)) for k, v in sandbox.limits})
        wanted = asked.model_dump(exclude_none=True) if asked else {}
        for name, value in wanted.items():
            ceiling = getattr(ceilings, name)
            if value > ceiling:
                whose = f"tenant {self.tenant!r}'s" if name in own else "this server's"
                raise LimitExceeded(f"{name} {value} is over {whose} ceiling of {ceiling}",
                                    details={"limit": name, "requested": value, "ceiling": ceiling})
        return base.model_copy(update=wanted)


ADMIN = Principal(ADMIN_TENANT, admin=True)


class Tenants:
    """Token lookup and per-tenant run-rate accounting for one server."""

    def __init__(self, settings: Settings, admin_token: str) -> None:
        self._by_token: list[tuple[bytes, Principal]] = [(admin_token.encode(), ADMIN)]
        self._by_name: dict[str, Principal] = {ADMIN_TENANT: ADMIN}
        for t in settings.server.tenants:
            p = Principal(t.name, max_sessions=t.max_sessions, runs_per_minute=t.runs_per_minute,
                          max_limits=t.max_limits, egress=t.egress)
            self._by_token.append((t.token.encode(), p))
            self._by_name[t.name] = p
        self._runs: dict[str, deque[float]] = {}

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def authenticate(self, token: str) -> Principal | None:
        """The token's principal, or None. Every token is compared (in constant time each), so
        the answer's timing does not tell which tenant's token a guess came close to."""
        given = token.encode()
        found = None
        for expected, principal in self._by_token:
            if hmac.compare_digest(given, expected):
                found = principal
        return found

    def from_authorization(self, header: str) -> Principal | None:
        """The principal of an ``Authorization: Bearer <token>`` header, or None. ``token`` is
        accepted as the scheme too: Jupyter Server's gateway client sends ``token <token>``."""
        scheme, _, token = header.partition(" ")
        return self.authenticate(token.strip()) if scheme.lower() in ("bearer", "token") else None

    def get(self, name: str) -> Principal | None:
        return self._by_name.get(name)

    def count_run(self, principal: Principal) -> None:
        """Count a run against the tenant's ``runs_per_minute``; QuotaExceeded when it is spent."""
        cap = principal.runs_per_minute
        if cap is None:
            return
        now = time.monotonic()
        window = self._runs.setdefault(principal.tenant, deque())
        while window and now - window[0] >= RUN_WINDOW_SECONDS:
            window.popleft()
        if len(window) >= cap:
            audit("quota_refused", tenant=principal.tenant, quota="runs_per_minute", limit=cap)
            retry = max(1, int(RUN_WINDOW_SECONDS - (now - window[0])) + 1)
            raise QuotaExceeded(
                f"tenant {principal.tenant!r} has started its {cap} runs of the last minute; "
                f"retry in {retry} s", details={"retry_after_seconds": retry})
        window.append(now)
