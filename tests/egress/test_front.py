"""The TCP front of the egress proxy (`kernelmode egress-proxy`, for kernels on other hosts): a
kernel's id and token open its own session's policy and nothing else. A real front on
127.0.0.1, a real SQLite store (sessions as a manager saves them, tokens as it mints them), the
real upstreams of conftest; clients are httpx and raw sockets, as kernel code would be."""

from __future__ import annotations

import base64
import json
import logging
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from kernelmode.egress.credentials import new_token
from kernelmode.egress.front import EgressFront
from kernelmode.models import EgressInfo, Limits, SessionInfo
from kernelmode.sessions.store import SqliteStore
from tests.support.server import wait_for

from .conftest import Rig


@dataclass
class Front:
    rig: Rig
    front: EgressFront
    store: SqliteStore
    port: int

    def kernel(self, session_id: str | None, allow: list[str], status: str = "idle",
               tenant: str = "team-a") -> tuple[str, str]:
        """A kernel with a token (as remote_launch mints it) and, with ``session_id``, the session
        it serves as the store holds it; (kernel id, token)."""
        kernel_id, token = str(uuid.uuid4()), new_token()
        self.store.egress_tokens.add(kernel_id, token)
        if session_id is not None:
            now = datetime.now(timezone.utc)
            info = SessionInfo(session_id=session_id, status=status, created_at=now, last_activity=now,  # type: ignore[arg-type]
                               ttl_seconds=600, limits=Limits(), sandbox="bwrap", kernel_id=kernel_id,
                               tenant=tenant, egress=EgressInfo(allow=allow, max_bytes_per_session=10**9,
                                                                max_connections_per_session=32))
            self.store.save(info, kernel_id, Path("/nonexistent"))
        return kernel_id, token

    def client(self, kernel_id: str | None = None, token: str | None = None) -> httpx.Client:
        auth = f"{kernel_id}:{token}@" if kernel_id else ""
        return httpx.Client(proxy=f"http://{auth}127.0.0.1:{self.port}", timeout=30, trust_env=False,
                            verify=self.rig.trust_upstream())

    def raw(self, request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(request)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out


@pytest.fixture(scope="module")
def front(rig: Rig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    data = tmp_path_factory.mktemp("front")
    store = SqliteStore(data / "sessions.sqlite3")
    # No cache: each request reads the store, so a deleted session is refused at once.
    f = EgressFront(rig.settings, store.egress_tokens, data, rig.metrics, cache_seconds=0)
    _, port = rig.loop.run(f.start("127.0.0.1", 0))
    yield Front(rig, f, store, port)
    rig.loop.run(f.close())
    store.close()


def _basic(kernel_id: str, token: str) -> bytes:
    return b"Proxy-Authorization: Basic " + base64.b64encode(f"{kernel_id}:{token}".encode()) + b"\r\n"


def test_a_kernels_token_opens_its_sessions_policy_and_the_audit_names_the_session(
        front: Front, caplog: pytest.LogCaptureFixture) -> None:
    rig = front.rig
    hp, sp = rig.http.port, rig.https.port
    kernel_id, token = front.kernel("sess-front-a", [f"plain.test:{hp}", f"secure.test:{sp}"])
    caplog.set_level(logging.INFO, logger="kernelmode.audit")
    with front.client(kernel_id, token) as c:
        assert c.get(f"http://plain.test:{hp}/echo").status_code == 200  # plain, absolute-form
        assert c.get(f"https://secure.test:{sp}/bytes/1000").content == b"x" * 1000  # CONNECT tunnel
        # other.test is in the server's allow-list, not in this session's: refused by its policy.
        refused = c.get(f"http://other.test:{sp}/")
    assert refused.status_code == 403
    assert refused.text.startswith("kernelmode: other.test") and "allow-list" in refused.text
    # The credential goes no further than the front.
    assert not any("proxy-authorization" in headers for _, _, headers in rig.http.seen)

    def lines() -> list[dict]:
        return [json.loads(r.getMessage()) for r in list(caplog.records) if r.name == "kernelmode.audit"]

    def mine() -> list[dict]:
        return [x for x in lines() if x["event"] == "egress" and x.get("session_id") == "sess-front-a"]
    wait_for(lambda: len(mine()) >= 3, "the audit lines of the 3 connections", timeout=30, every=0.05)
    decisions = {(x["host"], x["decision"]) for x in mine()}
    assert {("plain.test", "allowed"), ("secure.test", "allowed"), ("other.test", "refused")} <= decisions
    assert all(x["tenant"] == "team-a" for x in mine())
    assert token not in caplog.text


def test_a_missing_or_wrong_credential_is_407_for_requests_and_connect(front: Front) -> None:
    hp, sp = front.rig.http.port, front.rig.https.port
    kernel_id, token = front.kernel("sess-front-b", [f"plain.test:{hp}", f"secure.test:{sp}"])
    other_id, _ = front.kernel(None, [])
    with front.client() as c:
        r = c.get(f"http://plain.test:{hp}/refused-407")
    assert r.status_code == 407 and r.text.startswith("kernelmode: this proxy needs the kernel's own credential")
    assert r.headers["proxy-authenticate"].startswith("Basic")
    for kid, tok in ((kernel_id, new_token()), (other_id, token), (kernel_id, token[:-1])):
        with front.client(kid, tok) as c:
            r = c.get(f"http://plain.test:{hp}/refused-407")
        assert r.status_code == 407 and "not a kernel's" in r.text, (kid, r.text)
    # CONNECT: without a credential, and with a token under another kernel's id.
    for auth in (b"", _basic(other_id, token)):
        out = front.raw(b"CONNECT secure.test:%d HTTP/1.1\r\nHost: secure.test\r\n%s\r\n" % (sp, auth))
        assert out.startswith(b"HTTP/1.1 407 kernelmode: "), out[:200]
    # Not Basic, or not base64: 407 too, never a 500.
    for header in (b"Proxy-Authorization: Bearer x\r\n", b"Proxy-Authorization: Basic !!!\r\n"):
        out = front.raw(b"GET http://plain.test:%d/refused-407 HTTP/1.1\r\nHost: plain.test\r\n%s\r\n" % (hp, header))
        assert out.startswith(b"HTTP/1.1 407 "), out[:200]
    assert not any(path == "/refused-407" for _, path, _ in front.rig.http.seen)


def test_a_token_opens_its_own_session_only(front: Front) -> None:
    """Session B cannot reach a host only session A's policy allows, whatever it sends but A's
    own token: its token gives B's policy, and B's token under A's kernel id is refused."""
    hp = front.rig.http.port
    a_kernel, _a_token = front.kernel("sess-front-c", [f"plain.test:{hp}"])
    b_kernel, b_token = front.kernel("sess-front-d", [f"far.test:{hp}"])
    with front.client(b_kernel, b_token) as c:
        r = c.get(f"http://plain.test:{hp}/echo")
    assert r.status_code == 403 and "allow-list" in r.text
    with front.client(a_kernel, b_token) as c:
        assert c.get(f"http://plain.test:{hp}/echo").status_code == 407


def test_a_deleted_hibernated_or_unclaimed_sessions_token_opens_nothing(front: Front) -> None:
    hp = front.rig.http.port
    kernel_id, token = front.kernel("sess-front-e", [f"plain.test:{hp}"])
    with front.client(kernel_id, token) as c:
        assert c.get(f"http://plain.test:{hp}/echo").status_code == 200  # kept alive
        front.store.delete("sess-front-e")
        # The front's periodic check closes the kept-alive connection of a session gone.
        front.rig.loop.run(front.front.revalidate())
        r = c.get(f"http://plain.test:{hp}/echo")
    assert r.status_code == 403 and "serves no session" in r.text
    sleeping = front.kernel("sess-front-f", [f"plain.test:{hp}"], status="hibernated")
    pool = front.kernel(None, [])  # a warm kernel no session has claimed yet
    for (kid, tok), why in ((sleeping, "is hibernated"), (pool, "serves no session")):
        with front.client(kid, tok) as c:
            r = c.get(f"http://plain.test:{hp}/echo")
        assert r.status_code == 403 and why in r.text, r.text
    # A kernel gone (forgotten at its shutdown) has no credential any more.
    front.store.egress_tokens.forget(kernel_id)
    with front.client(kernel_id, token) as c:
        assert c.get(f"http://plain.test:{hp}/echo").status_code == 407


def test_a_store_that_cannot_answer_is_a_503_that_says_so(rig: Rig, tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "sessions.sqlite3")
    kernel_id, token = str(uuid.uuid4()), new_token()
    store.egress_tokens.add(kernel_id, token)
    f = EgressFront(rig.settings, store.egress_tokens, tmp_path, cache_seconds=0)
    _, port = rig.loop.run(f.start("127.0.0.1", 0))
    store.close()  # every read fails from now on
    try:
        with httpx.Client(proxy=f"http://{kernel_id}:{token}@127.0.0.1:{port}", trust_env=False, timeout=30) as c:
            r = c.get(f"http://plain.test:{rig.http.port}/")
        assert r.status_code == 503 and "cannot read the session store" in r.text
    finally:
        rig.loop.run(f.close())


def test_the_command_refuses_to_start_without_egress_listen(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kernelmode.cli", "egress-proxy", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "egress.listen" in r.stderr, r.stderr


def test_the_command_serves_kernels_and_its_metrics(tmp_path: Path) -> None:
    """`kernelmode egress-proxy` as a process: listens where egress.listen says (printing where),
    answers a request without a credential with the 407 text, and counts it on /metrics."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    cfg = tmp_path / "kernelmode.yaml"
    cfg.write_text(f"egress:\n  allow: [plain.test]\n  listen: 127.0.0.1:0\n  metrics_listen: 127.0.0.1:{metrics_port}\n")
    proc = subprocess.Popen([sys.executable, "-m", "kernelmode.cli", "egress-proxy", "--config", str(cfg),
                             "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("kernelmode egress-proxy listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as c:
            r = c.get("http://plain.test/")
        assert r.status_code == 407 and r.text.startswith("kernelmode: ")
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        assert 'kernelmode_egress_connections_total{decision="refused"} 1.0' in text
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
