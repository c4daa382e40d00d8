"""The code policy hook (``policy.module: "pkg.mod:check"``): a host callable that sees each
run's code before it runs and answers allow, deny (with a reason) or ask (the approval gate).
It is asked on every door: REST, one-shot and MCP runs (sessions/runner.py), and each cell a
console or Jupyter client sends (sessions/console_policy.py, where ask is a refusal).

The callable is called with keywords ``code``, ``session_id`` and ``tenant`` (the tenant's
name, ``admin`` for the admin token); it may be sync (run in a worker thread, so a slow one
does not stall the service) or async. It answers ``"allow"``, ``"deny"`` or ``"ask"``, or a pair ``(decision, reason)``, or a
mapping ``{"decision": ..., "reason": ...}``. Anything else, or an exception, is a deny whose
reason says so: a broken policy fails closed, and never as a 500.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError

log = logging.getLogger("kernelmode.policy")

Verdict = Literal["allow", "deny", "ask"]


@dataclass(frozen=True)
class PolicyDecision:
    decision: Verdict
    reason: str | None = None


ALLOW = PolicyDecision("allow")


def _read(answer: Any) -> PolicyDecision:
    """The policy's answer as a PolicyDecision (ValueError when it is not one of the shapes)."""
    reason: Any = None
    if isinstance(answer, PolicyDecision):
        return answer
    if isinstance(answer, dict):
        decision, reason = answer.get("decision"), answer.get("reason")
    elif isinstance(answer, (tuple, list)) and len(answer) == 2:
        decision, reason = answer
    else:
        decision = answer
    if decision not in ("allow", "deny", "ask") or not (reason is None or isinstance(reason, str)):
        raise ValueError(f"answered {answer!r}; expected 'allow', 'deny' or 'ask', or "
                         "(decision, reason)")
    return PolicyDecision(decision, reason)


class CodePolicy:
    """The loaded hook (``check``), called before each run."""

    def __init__(self, target: str, func: Callable[..., Any], timeout: float = 10.0) -> None:
        self.target = target
        self.func = func
        self.timeout = timeout  # a hung policy must not hold the session's lock for ever

    @classmethod
    def load(cls, target: str, timeout: float = 10.0) -> CodePolicy:
        """Import ``pkg.mod:callable``; a bad path is a ConfigError naming the key."""
        module, _, attr = target.partition(":")
        try:
            func: Any = importlib.import_module(module)
            for part in attr.split("."):
                func = getattr(func, part)
        except Exception as e:  # any import-time failure of the user's module
            message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            raise ConfigError(f"policy.module: cannot load {target!r}: {message}") from e
        if not callable(func):
            raise ConfigError(f"policy.module: {target!r} is not callable")
        return cls(target, func, timeout)

    async def check(self, code: str, session_id: str, tenant: str) -> PolicyDecision:
        """The policy's decision; a policy that raises, answers nonsense or does not answer within
        its timeout denies (saying why)."""
        try:
            return await asyncio.wait_for(self._ask(code, session_id, tenant), self.timeout)
        except TimeoutError:
            log.warning("code policy %s did not answer within %g s on a run of session %s",
                        self.target, self.timeout, session_id)
            return PolicyDecision("deny", f"the code policy did not answer within {self.timeout:g} s "
                                  "(policy.timeout_seconds); the run is refused")

    async def _ask(self, code: str, session_id: str, tenant: str) -> PolicyDecision:
        try:
            if inspect.iscoroutinefunction(self.func):
                answer = await self.func(code=code, session_id=session_id, tenant=tenant)
            else:
                answer = await asyncio.to_thread(self.func, code=code, session_id=session_id, tenant=tenant)
                if inspect.isawaitable(answer):
                    answer = await answer
            return _read(answer)
        except Exception as e:
            log.warning("code policy %s failed on a run of session %s: %r", self.target, session_id, e)
            return PolicyDecision("deny", f"the code policy failed ({type(e).__name__}: {e}); the run "
                                  "is refused until it works")
