"""The egress service: one proxy per session that has egress, each on a unix socket in that
session's kernel's egress directory, with the CA bundle its kernel trusts beside it.

The proxy runs in the manager's event loop (no process of its own): it shares the manager's
lifetime, and a restarted manager opens the sockets again for the sessions it adopts, so kernels
never restart for it (the in-sandbox bridge connects anew for each connection). The caller makes
the directory (and mounts it into the sandbox); this module only puts ``proxy.sock`` and
``ca-bundle.pem`` in it and takes them out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import ssl
from pathlib import Path

import psutil

from ..metrics import Metrics
from ..models import EgressUse
from .policy import EgressPolicy, IPAddress
from .proxy import SessionProxy
from .tls import Certificates, ca_directory, kernel_bundle, upstream_context, write_atomic

SOCKET_NAME = "proxy.sock"
BUNDLE_NAME = "ca-bundle.pem"


def own_addresses() -> frozenset[IPAddress]:
    """Every address of this host's interfaces (the manager's own: never an egress target)."""
    found: set[IPAddress] = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(a.address.partition("%")[0]))
    return frozenset(found)


class Egress:
    """``open`` a session's proxy when its kernel is known, ``close`` it when the session ends."""

    def __init__(self, data_dir: Path, metrics: Metrics | None = None, ca_dir: Path | None = None) -> None:
        self.certs = Certificates(ca_directory(ca_dir, data_dir))
        self.metrics = metrics
        self.own = own_addresses()
        self._proxies: dict[str, tuple[Path, SessionProxy]] = {}
        self._upstream_tls: dict[Path | None, ssl.SSLContext] = {}

    async def open(self, session_id: str, tenant: str | None, policy: EgressPolicy, egress_dir: Path) -> None:
        """Listen on ``egress_dir/proxy.sock`` with this policy and write ``ca-bundle.pem``.
        Idempotent; a new directory (the session got another kernel) moves the proxy there. A
        policy without egress opens nothing (the bridge in the sandbox then refuses)."""
        current = self._proxies.get(session_id)
        if current is not None:
            if current[0] == egress_dir and current[1].policy == policy:
                return
            await self.close(session_id)
        # A session's caps and usage outlive its kernel (a kernel that dies on purpose must not
        # get a fresh byte budget); a new policy starts afresh.
        carried = current[1] if current is not None and current[1].policy == policy else None
        if not policy.enabled:
            return
        bundle = kernel_bundle(self.certs.ca_pem() if policy.secrets else None, policy.upstream_ca_file)
        write_atomic(egress_dir / BUNDLE_NAME, bundle, 0o644)
        tls = self._upstream_tls.get(policy.upstream_ca_file)
        if tls is None:
            tls = self._upstream_tls[policy.upstream_ca_file] = upstream_context(policy.upstream_ca_file)
        proxy = SessionProxy(session_id, tenant, policy, egress_dir / SOCKET_NAME, self.certs, tls,
                             self.own, self.metrics)
        if carried is not None:
            proxy.meter, proxy.usage, proxy.run_id = carried.meter, carried.usage, carried.run_id
        await proxy.start()
        self._proxies[session_id] = (egress_dir, proxy)

    async def close(self, session_id: str) -> None:
        """Stop the session's proxy and take its socket out of the directory (no-op if none).
        The kernel's bundle goes back to the system's alone: its CA variables name that file,
        and a client given a missing one fails at construction (httpx), not only on HTTPS."""
        entry = self._proxies.pop(session_id, None)
        if entry is None:
            return
        egress_dir, proxy = entry
        await proxy.close()
        with contextlib.suppress(OSError):  # the kernel, and its dir, may be gone already
            write_atomic(egress_dir / BUNDLE_NAME, kernel_bundle(None, None), 0o644)

    def set_run(self, session_id: str, run_id: str | None) -> None:
        """Connections opened from now on count toward this run (None: between runs)."""
        entry = self._proxies.get(session_id)
        if entry is not None:
            entry[1].run_id = run_id

    def usage(self, session_id: str, run_id: str | None = None) -> list[EgressUse]:
        """``RunResult.egress`` of the run (``run_id`` None: the session's so far); [] without egress."""
        entry = self._proxies.get(session_id)
        return [EgressUse(**e) for e in entry[1].usage.entries(run_id)] if entry is not None else []

    def is_open(self, session_id: str) -> bool:
        return session_id in self._proxies

    async def stop(self) -> None:
        for session_id in list(self._proxies):
            await self.close(session_id)
