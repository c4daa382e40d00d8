"""Approvals over MCP: while run_python or get_run follows a run, a call of that run that waits
for approval is put to the person at the MCP client as an elicitation (the tool and its
arguments, yes/no, an optional reason), and the answer decides it.

A client that does not declare the elicitation capability is not asked: the answer about the
run then has status ``awaiting_approval`` with ``pending_approvals`` (the REST route, or the
timeout — a deny — decides), so an operator can still answer for it.
"""

from __future__ import annotations

import json
from typing import Any

from mcp.server.mcpserver import Context
from mcp_types import ClientCapabilities, ElicitationCapability, FormElicitationCapability
from pydantic import BaseModel, Field

from ..models import PendingApproval
from ..tools.approvals import Asker
from .render import clip

_MAX_MESSAGE_CHARS = 4_000  # the elicitation message (arguments cut to fit)


class Consent(BaseModel):
    """The form the person fills in."""

    approve: bool = Field(description="Allow this call?")
    reason: str = Field("", max_length=2_000, description="Why (optional; a denied call's code sees it).")


def can_elicit(ctx: Context[Any]) -> bool:
    """The connected client declared the elicitation capability (form mode)."""
    try:
        return ctx.session.check_client_capability(
            ClientCapabilities(elicitation=ElicitationCapability(form=FormElicitationCapability())))
    except (AttributeError, ValueError):  # no request context (not inside a tool call)
        return False


def message(p: PendingApproval, session_id: str) -> str:
    """What the person reads: who asks, which tool, with which arguments."""
    if p.tool == "policy:run":
        head = (f"The code policy asks whether this code may run in kernelmode session {session_id} "
                f"({p.arguments.get('reason') or 'no reason given'}):\n")
        body = str(p.arguments.get("code", ""))
    else:
        head = f"Code in kernelmode session {session_id} wants to call the tool {p.tool} with:\n"
        body = json.dumps(p.arguments, indent=1, default=str)
    return head + clip(body, _MAX_MESSAGE_CHARS - len(head) - 20, "arguments") + "\n\nAllow it?"


def asker(ctx: Context[Any], session_id: str) -> Asker | None:
    """An asker for the run's gate that elicits each decision from this MCP client, or None
    when the client cannot answer elicitations."""
    if not can_elicit(ctx):
        return None

    async def ask(p: PendingApproval) -> tuple[bool, str | None]:
        result = await ctx.elicit(message(p, session_id), Consent)
        if result.action == "accept":
            return result.data.approve, result.data.reason or None
        if result.action == "decline":
            return False, "declined at the MCP client"
        return False, "cancelled at the MCP client"

    return ask
