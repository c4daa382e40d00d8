"""The code policy of the attack suite's tenant server (``policy.module``): it refuses cells that
carry a marker, and asks about others, for every tenant; every other cell is allowed."""

from __future__ import annotations

DENY_MARK, ASK_MARK = "km-policy-deny", "km-policy-ask"


def check(code: str, session_id: str, tenant: str) -> str | tuple[str, str]:
    if DENY_MARK in code:
        return "deny", f"tenant {tenant} may not run {DENY_MARK} cells"
    if ASK_MARK in code:
        return "ask", f"{ASK_MARK} cells need a person's yes"
    return "allow"
