"""What a session's kernel reached through the egress proxy, per run: the RunResult's ``egress``
field (``[{host, port, allowed, requests, bytes}]``). Bounded: the last ``RUNS`` runs, ``HOSTS``
entries each (a run that tries more hosts keeps counting in the entries it has)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

RUNS = 64
HOSTS = 100
MAX_HOST = 253  # a DNS name's longest: a refused request may name anything up to h11's line cap


class Usage:
    def __init__(self) -> None:
        self._runs: OrderedDict[str | None, dict[tuple[str, int, bool], list[int]]] = OrderedDict()
        self._total: dict[tuple[str, int, bool], list[int]] = {}

    def add(self, run_id: str | None, host: str, port: int, allowed: bool, requests: int, nbytes: int) -> None:
        for entry in self._entries(run_id, host, port, allowed):
            entry[0] += requests
            entry[1] += nbytes

    def track(self, run_id: str | None, host: str, port: int) -> Callable[[int], None]:
        """Count one allowed connection now, and return what adds its bytes as they move (a
        kept-alive tunnel shows in the run's result before it closes)."""
        entries = self._entries(run_id, host, port, True)
        for entry in entries:
            entry[0] += 1

        def add_bytes(n: int) -> None:
            for entry in entries:
                entry[1] += n
        return add_bytes

    def _entries(self, run_id: str | None, host: str, port: int, allowed: bool) -> list[list[int]]:
        runs = [self._total]
        if run_id is not None:
            if run_id not in self._runs:
                self._runs[run_id] = {}
                while len(self._runs) > RUNS:
                    self._runs.popitem(last=False)
            runs.append(self._runs[run_id])
        key = (host[:MAX_HOST], port, allowed)
        # Beyond HOSTS entries a run's new hosts are not listed (the audit log has them all).
        return [tally.setdefault(key, [0, 0]) for tally in runs if key in tally or len(tally) < HOSTS]

    def entries(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """One run's entries (None: the session's whole life), refused ones first."""
        tally = self._total if run_id is None else self._runs.get(run_id, {})
        return [{"host": h, "port": p, "allowed": a, "requests": r, "bytes": b}
                for (h, p, a), (r, b) in sorted(tally.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))]
