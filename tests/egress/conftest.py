"""The egress rig: real upstream servers on 127.0.0.1 (HTTP, and HTTPS with a test CA), the real
Egress service in an event loop of its own, and per-session loopback hops (what the in-sandbox
bridge does). Every name the policies allow is mapped by egress.hosts to a loopback address: no
test resolves a name through DNS or sends a packet beyond this machine's loopback."""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernelmode.config import EgressNarrowing, EgressSettings
from kernelmode.egress.policy import EgressPolicy, narrow, server_policy
from kernelmode.egress.service import Egress
from kernelmode.metrics import Metrics
from tests.support.upstreams import Loop, Upstream, make_test_ca, start_hop

SECRET = "Bearer egress-canary-7f3a9c1d"


@dataclass
class Session:
    session_id: str
    egress_dir: Path
    hop_port: int
    policy: EgressPolicy

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.hop_port}"

    def client(self, verify: ssl.SSLContext | bool = False, **kw: Any) -> httpx.Client:
        return httpx.Client(proxy=self.proxy, verify=verify, timeout=30, trust_env=False, **kw)

    def raw(self, request: bytes) -> bytes:
        """Send bytes through the hop and read until the proxy closes."""
        with socket.create_connection(("127.0.0.1", self.hop_port), timeout=30) as s:
            s.sendall(request)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out


@dataclass
class Rig:
    loop: Loop
    egress: Egress
    metrics: Metrics
    http: Upstream
    https: Upstream
    upstream_ca: Path
    root: Path
    settings: EgressSettings

    def trust_upstream(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.upstream_ca))

    def trust_bundle(self, session: Session) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(session.egress_dir / "ca-bundle.pem"))


_ids = itertools.count()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("eg")
    ca, cert = make_test_ca(root)
    http, https = Upstream(), Upstream(cert)
    hp, sp = http.port, https.port
    settings = EgressSettings(
        allow=[f"plain.test:{hp}", f"denied.test:{hp}", f"far.test:{hp}", f"secure.test:{sp}",
               f"secret.test:{sp}", f"other.test:{sp}", f"127.0.0.1:{hp}"],
        deny=["denied.test"],
        hosts={"plain.test": "127.0.0.1", "secure.test": "127.0.0.1", "secret.test": "127.0.0.1",
               "other.test": "127.0.0.1", "denied.test": "127.0.0.1", "far.test": "127.0.0.2"},
        allow_addresses=["127.0.0.1/32"],
        secrets=[{"host": "secret.test", "header": "Authorization", "value": SECRET}],
        upstream_ca_file=ca)
    loop = Loop()
    metrics = Metrics()
    egress = Egress(root / "data", metrics)
    yield Rig(loop, egress, metrics, http, https, ca, root, settings)
    loop.run(egress.stop())
    loop.stop()
    http.stop()
    https.stop()


@pytest.fixture()
def open_session(rig: Rig) -> Iterator[Any]:
    """open_session(**narrowing or settings overrides) -> Session; closed after the test."""
    opened: list[tuple[str, Any]] = []

    def make(*, narrowing: EgressNarrowing | None = None, **overrides: Any) -> Session:
        settings = rig.settings.model_copy(update=overrides) if overrides else rig.settings
        policy = narrow(server_policy(settings), narrowing)
        sid = f"s{next(_ids)}"
        egress_dir = rig.root / sid
        egress_dir.mkdir()
        rig.loop.run(rig.egress.open(sid, "team-a", policy, egress_dir))
        hop, port = rig.loop.run(start_hop(egress_dir / "proxy.sock"))
        opened.append((sid, hop))
        return Session(sid, egress_dir, port, policy)

    yield make
    for sid, hop in opened:
        rig.loop.run(_close(hop))
        rig.loop.run(rig.egress.close(sid))


async def _close(server: asyncio.AbstractServer) -> None:
    server.close()
