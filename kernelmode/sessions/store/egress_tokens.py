"""Egress credentials of kernels on other hosts: a hash of each kernel's token, and the session a
kernel serves (docs/security-model.md "Egress on remote kernels").

A kernel on an Enterprise Gateway node or in a Kubernetes pod reaches the egress proxy over TCP,
so the proxy cannot tell who calls by the socket it was called on: the kernel presents its id
and a random token in ``Proxy-Authorization``. Only the token's SHA-256 is stored (a store dump
opens no egress); the session is found by kernel id at request time, so a pool kernel claimed
by a session needs nothing new, and a session deleted or hibernated has no kernel to be found by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ...egress.credentials import new_token, token_hash
from ...models import SessionInfo

__all__ = ["SCHEMA", "EgressTokens", "new_token", "token_hash"]

Rows = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]
Run = Callable[[str, Sequence[Any]], None]

# The same table on both backends (SQLite's schema and PostgreSQL's migration 2).
SCHEMA = """
CREATE TABLE IF NOT EXISTS egress_tokens (
    token_hash TEXT PRIMARY KEY,     -- SHA-256 of the kernel's token, hex
    kernel_id TEXT NOT NULL,
    created_us BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS egress_tokens_by_kernel ON egress_tokens (kernel_id);
"""


class EgressTokens:
    def __init__(self, rows: Rows, run: Run) -> None:
        self._rows, self._run = rows, run  # the store's primitives (``?`` placeholders)

    def add(self, kernel_id: str, token: str) -> None:
        self._run("INSERT INTO egress_tokens (token_hash, kernel_id, created_us) VALUES (?, ?, ?)",
                  (token_hash(token), kernel_id, time.time_ns() // 1000))

    def kernel_of(self, token: str) -> str | None:
        """The kernel the token was minted for, or None."""
        rows = self._rows("SELECT kernel_id FROM egress_tokens WHERE token_hash=?", (token_hash(token),))
        return str(rows[0][0]) if rows else None

    def session_of(self, kernel_id: str) -> SessionInfo | None:
        """The session whose kernel this is now (None: a pool kernel not claimed yet, or a kernel
        its session no longer has: deleted, hibernated, replaced)."""
        rows = self._rows("SELECT info FROM sessions WHERE kernel_id=?", (kernel_id,))
        return SessionInfo.model_validate_json(rows[0][0]) if rows else None

    def forget(self, kernel_id: str) -> None:
        """The kernel is gone: its token opens nothing any more."""
        self._run("DELETE FROM egress_tokens WHERE kernel_id=?", (kernel_id,))
