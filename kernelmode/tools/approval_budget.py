"""Bounds on what waits for approval: per session and per tenant, how many calls and how many
bytes of their arguments (``tool_calls.max_pending_approvals_per_*`` and
``max_pending_approval_bytes_per_*``).

A pending call holds its request in the manager's memory until someone decides it; without a
bound, kernel code could pin hundreds of MB with gated calls nobody answers. A call over a bound
is refused at once (ToolDenied in the kernel, saying which bound and what to do), and what one
tenant holds never takes room from another.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ADMIN = "admin"  # the bucket of calls without a tenant (the admin token)


@dataclass(frozen=True)
class ApprovalBounds:
    per_session: int = 8
    per_tenant: int = 32
    bytes_per_session: int = 8 * 1024 * 1024
    bytes_per_tenant: int = 32 * 1024 * 1024


@dataclass
class ApprovalBudget:
    """What is pending now, by session and by tenant; ``take`` reserves, ``give`` returns."""

    bounds: ApprovalBounds = field(default_factory=ApprovalBounds)
    _count: Counter[str] = field(default_factory=Counter)
    _bytes: Counter[str] = field(default_factory=Counter)

    @staticmethod
    def _keys(session_id: str, tenant: str | None) -> tuple[str, str]:
        return f"s:{session_id}", f"t:{tenant or ADMIN}"

    def held(self, session_id: str, tenant: str | None) -> dict[str, int]:
        s, t = self._keys(session_id, tenant)
        return {"session": self._count[s], "session_bytes": self._bytes[s],
                "tenant": self._count[t], "tenant_bytes": self._bytes[t]}

    def take(self, session_id: str, tenant: str | None, size: int) -> str | None:
        """Reserve room for one call of ``size`` bytes; None, or why it does not fit."""
        s, t = self._keys(session_id, tenant)
        b = self.bounds
        for key, whose, most, setting in ((s, "this session", b.per_session, "per_session"),
                                          (t, "this tenant", b.per_tenant, "per_tenant")):
            if self._count[key] + 1 > most:
                return (f"{self._count[key]} calls of {whose} already await approval (at most {most}: "
                        f"tool_calls.max_pending_approvals_{setting}); have them decided (POST "
                        "/v1/runs/{run_id}/approvals/{call_id}, or the MCP client's prompt), then call again")
        for key, whose, most, setting in ((s, "this session", b.bytes_per_session, "per_session"),
                                          (t, "this tenant", b.bytes_per_tenant, "per_tenant")):
            if self._bytes[key] + size > most:
                return (f"its arguments ({size:,} bytes) would put the calls of {whose} awaiting approval "
                        f"over {most:,} bytes (tool_calls.max_pending_approval_bytes_{setting}); write "
                        "large data to a file in the workspace and pass its path, or have the pending "
                        "calls decided first")
        for key in (s, t):
            self._count[key] += 1
            self._bytes[key] += size
        return None

    def give(self, session_id: str, tenant: str | None, size: int) -> None:
        for key in self._keys(session_id, tenant):
            self._count[key] -= 1
            self._bytes[key] -= size
            if self._count[key] <= 0:  # no key outlives its last call
                del self._count[key]
                self._bytes.pop(key, None)
