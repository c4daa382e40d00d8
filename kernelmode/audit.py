"""The audit trail: one JSON line per session event, run and tool call (logger ``kernelmode.audit``).

Each line has ``ts`` (UTC, ISO 8601), ``level``, ``event`` and the ids it concerns, and begins
with ``ts`` (logs.py), so a log shipper can filter on ``"event"``. Events:
``session_created``, ``session_closed`` (with ``reason``: closed, expired, lost...),
``kernel_died`` (with ``cause``), ``kernel_restarted``, ``kernel_replaced``, ``run``,
``console_run``, ``tool_call``, ``quota_refused``, ``approval_requested``, ``approval_decided``
(with ``approved``, ``by``: rest | mcp | timeout | run_ended | interrupt | no_gate | bound, ``reason``),
``policy``; with several managers on one store ``sessions_taken_over`` (a dead manager's sessions
adopted: ``session_ids``, ``lost``), ``session_lease_lost``, ``orphan_kernels_removed``.
``console_run``, ``tool_call``, ``quota_refused``, ``package_install`` (with ``source``,
``requested``, ``ok``, and ``installed``/``already`` or the refusal's ``code`` and ``error``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

LOGGER_NAME = "kernelmode.audit"
AUDIT_FIELDS = "kernelmode_audit"  # the record attribute holding the event's fields (logs.py)
_log = logging.getLogger(LOGGER_NAME)


def audit(event: str, **fields: Any) -> None:
    """Log one audit line (values that JSON cannot hold are written as strings)."""
    if not _log.isEnabledFor(logging.INFO):
        return
    line = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "event": event, **fields}
    # The message stays the JSON line for handlers other than ours (library mode), encoded only
    # when such a handler asks for it: our formatters read the fields (one encoding a line).
    _log.info(_Line(line), extra={AUDIT_FIELDS: line})


class _Line:
    """An audit line as a log message: its JSON text, made when it is formatted."""

    __slots__ = ("line",)

    def __init__(self, line: dict[str, Any]) -> None:
        self.line = line

    def __str__(self) -> str:
        return json.dumps(self.line, default=str)
