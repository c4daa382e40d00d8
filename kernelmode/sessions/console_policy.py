"""The code policy (``policy.module``) on what a console or a Jupyter client sends (the console
channel and the Jupyter API's, both protocols): a tenant's own token reaches the kernel there
too, so a policy that checked only REST and MCP runs would restrict nothing.

Every ``execute_request`` is checked before the kernel sees it, on whatever channel it comes
(ipykernel runs one sent on ``control`` too), silent ones included, and each of its
``user_expressions`` (the kernel evaluates them) as code of its own. The tenant the policy is
told is the session's owner, as for REST: the admin token attached to a tenant's session is
checked as that tenant. ``ask`` is a refusal: no front door follows a console cell, so nobody
could approve it. A refused cell is answered to the client as the kernel answers a failed one
(``busy``, an ``error`` message, the ``execute_reply`` with status error, ``idle``), its error
``PolicyDenied`` naming the reason; it is audited and kept in the session's history.

The debugger's ``debug_request`` (an ``evaluate`` runs any expression) cannot be read as
code: while a policy is set it is refused with a ``debug_reply`` that says so.
"""

from __future__ import annotations

from typing import Any

from jupyter_client.session import Session as JupyterSession

from ..audit import audit
from ..code_policy import CodePolicy
from ..config import ADMIN_TENANT

POLICY_ERROR = "PolicyDenied"


async def cell_refusal(policy: CodePolicy, session_id: str, tenant: str | None,
                       msg: dict[str, Any]) -> str | None:
    """Why the policy refuses this execute_request (None: it may run). Each piece of code in it
    (the cell, then each user expression) is asked about; the first refusal stands."""
    content = msg.get("content") or {}
    code, expressions = content.get("code", ""), content.get("user_expressions") or {}
    if not isinstance(code, str) or not isinstance(expressions, dict) \
            or not all(isinstance(v, str) for v in expressions.values()):
        return "an execute_request's code and user_expressions must be strings; the cell was not run"
    who = tenant or ADMIN_TENANT
    for text in (code, *expressions.values()):
        verdict = await policy.check(text, session_id, who)
        if verdict.decision == "allow":
            continue
        audit("policy", session_id=session_id, tenant=who, msg_id=str(msg["header"].get("msg_id", ""))[:100],
              source="console", decision=verdict.decision, reason=verdict.reason)
        if verdict.decision == "ask":
            return (f"the code policy asks for approval ({verdict.reason or 'no reason given'}), which only "
                    "a run started through REST or MCP can wait for (not a console cell); the cell was not run")
        return verdict.reason or "the code policy refused this code"
    return None


def refusal_messages(session: JupyterSession, msg: dict[str, Any], reason: str,
                     execution_count: int, ename: str = POLICY_ERROR) -> list[tuple[str, dict[str, Any]]]:
    """(channel, message) the client gets for a refused execute_request, as from the kernel."""
    parent = msg["header"]
    error = {"ename": ename, "evalue": reason, "traceback": [f"{ename}: {reason}"]}
    return [
        ("iopub", session.msg("status", {"execution_state": "busy"}, parent=parent)),
        ("iopub", session.msg("error", error, parent=parent)),
        (msg["channel"], session.msg("execute_reply", {"status": "error", "execution_count": execution_count,
                                                       **error}, parent=parent)),
        ("iopub", session.msg("status", {"execution_state": "idle"}, parent=parent)),
    ]


def debug_refusal(session: JupyterSession, msg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The answer to a debug_request while a code policy is set (the debugger evaluates code
    the policy never sees)."""
    request = msg.get("content") or {}
    seq = request.get("seq", 0) if isinstance(request, dict) else 0
    reply = {"type": "response", "request_seq": seq, "seq": 0, "success": False,
             "command": request.get("command", "") if isinstance(request, dict) else "",
             "message": "the debugger is off on this server: a code policy is set, and debugger "
                        "requests evaluate code it cannot check"}
    return [(msg["channel"], session.msg("debug_reply", reply, parent=msg["header"]))]
