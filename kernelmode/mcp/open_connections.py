"""The MCP connections (``Mcp-Session-Id``) open at /mcp, as the front door sees them.

The SDK's session manager keeps its own table, but only privately; this one is kernelmode's,
kept from what passes through the handler (mcp 2.3's public API: ``handle_request``):

- a connection is open from the 2xx answer to the request that opened it until its owner's
  DELETE is answered, the SDK answers its owner 404 for it (it ended there), or it idled out;
- admission (caps per tenant and in all) is decided here before the SDK sees an opening
  request; openings in flight count, so concurrent ones cannot overshoot;
- the idle countdown is kept here too (the SDK's is off): every request on a connection, the
  direct route's (fastcall.py) included, holds it; ``idle`` names the ones to close, which
  McpHttp closes through the SDK as their owner's DELETE would.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

IDLE_SECONDS = 30 * 60  # the SDK's default, kept: an idle connection answers 404 after it


@dataclass
class Connection:
    tenant: str
    plain: bool  # answered as plain JSON where its SSE stream would carry only the answer (plain.py)
    in_flight: int = 0
    idle_since: float = field(default=0.0)


class OpenConnections:
    """Open MCP connections, their owners and their idle countdowns."""

    def __init__(self, max_total: int, max_per_tenant: int, idle_seconds: float = IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_total = max_total
        self.max_per_tenant = max_per_tenant
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._open: dict[str, Connection] = {}
        self._held: Counter[str] = Counter()  # tenant -> connections open or being opened

    def admit(self, tenant: str) -> bool:
        """Reserve room for a connection ``tenant`` is opening (False: at a cap). Every True is
        followed by ``opened`` or ``not_opened``."""
        if sum(self._held.values()) >= self.max_total or self._held[tenant] >= self.max_per_tenant:
            return False
        self._held[tenant] += 1
        return True

    def not_opened(self, tenant: str) -> None:
        """The reserved opening did not open a connection: its room is free again."""
        self._release(tenant)

    def opened(self, sid: str, tenant: str, plain: bool) -> None:
        """The reserved opening was answered 2xx with this connection id."""
        if sid in self._open:  # never from the SDK (fresh uuid4 ids); keep the count exact anyway
            self._release(tenant)
            return
        self._open[sid] = Connection(tenant, plain, idle_since=self._clock())

    def get(self, sid: str | None) -> Connection | None:
        return None if sid is None else self._open.get(sid)

    def gone(self, sid: str) -> None:
        """The connection ended (DELETE, or the SDK no longer knows it)."""
        conn = self._open.pop(sid, None)
        if conn is not None:
            self._release(conn.tenant)

    def open_count(self, tenant: str | None = None) -> int:
        if tenant is None:
            return len(self._open)
        return sum(1 for c in self._open.values() if c.tenant == tenant)

    @contextmanager
    def using(self, sid: str | None) -> Iterator[None]:
        """Hold the connection's idle countdown while a request on it is served."""
        conn = self.get(sid)
        if conn is None:
            yield
            return
        conn.in_flight += 1
        try:
            yield
        finally:
            conn.in_flight -= 1
            conn.idle_since = self._clock()

    def idle(self) -> list[tuple[str, str]]:
        """(id, tenant) of the connections idle for ``idle_seconds`` with no request in flight."""
        cutoff = self._clock() - self.idle_seconds
        return [(sid, c.tenant) for sid, c in self._open.items()
                if c.in_flight == 0 and c.idle_since <= cutoff]

    def _release(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]
