"""The egress proxy end to end with real clients and real upstream servers on loopback: allowed
traffic (plain HTTP, tunnelled HTTPS, intercepted HTTPS with a secret header), refusals, caps,
audit, metrics and per-run usage."""

from __future__ import annotations

import hashlib
import ssl

import httpx
import pytest

from kernelmode.egress.tls import kernel_bundle
from tests.support.server import wait_for
from tests.support.upstreams import start_hop

from .conftest import SECRET, Rig


def test_plain_http_get_and_post(rig: Rig, open_session) -> None:
    s = open_session()
    with s.client() as c:
        r = c.get(f"http://plain.test:{rig.http.port}/echo?q=1")
        assert r.status_code == 200 and r.json()["path"] == "/echo?q=1"
        body = bytes(range(256)) * 4096  # 1 MiB
        r = c.post(f"http://plain.test:{rig.http.port}/upload", content=body)
        assert r.json() == {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    assert "proxy-connection" not in rig.http.seen[-1][2]


def test_https_is_tunnelled_not_decrypted(rig: Rig, open_session) -> None:
    s = open_session()
    # The client trusts only the upstream's own CA: an intercepting proxy could not answer.
    with s.client(verify=rig.trust_upstream()) as c:
        r = c.get(f"https://secure.test:{rig.https.port}/echo", headers={"Authorization": "mine"})
        assert r.status_code == 200 and "authorization" in r.json()["header_names"]
    assert rig.https.seen[-1][2]["authorization"] == "mine"  # untouched: no secret rule for this host


def test_a_50_mb_download_is_streamed(rig: Rig, open_session) -> None:
    s = open_session()
    size = 50 * 1024 * 1024
    got = 0
    with s.client(verify=rig.trust_upstream()) as c, \
            c.stream("GET", f"https://secure.test:{rig.https.port}/bytes/{size}") as r:
        for chunk in r.iter_bytes():
            got += len(chunk)
    assert got == size


def test_secret_header_is_added_and_never_seen_by_the_client(rig: Rig, open_session) -> None:
    s = open_session()
    bundle = (s.egress_dir / "ca-bundle.pem").read_text()
    assert SECRET not in bundle and "BEGIN CERTIFICATE" in bundle
    url = f"https://secret.test:{rig.https.port}/echo"
    with s.client(verify=rig.trust_bundle(s)) as c:
        for asked in ({}, {"Authorization": "Bearer forged-by-kernel"}):
            r = c.get(url, headers=asked)
            assert r.status_code == 200
            assert rig.https.seen[-1][2]["authorization"] == SECRET  # added, or replacing the kernel's
            assert SECRET.split()[1] not in r.text + str(r.headers)
        r = c.post(url, content=b"x" * 1000)  # a keep-alive connection: the next request too
        assert r.json()["length"] == 1000 and rig.https.seen[-1][2]["authorization"] == SECRET
    # The certificate the client saw was minted by the deployment CA, not the upstream's.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        with s.client(verify=rig.trust_upstream()) as c:
            c.get(url)


def test_intercepted_upstream_is_verified(rig: Rig, open_session) -> None:
    s = open_session(upstream_ca_file=None)  # the proxy no longer trusts the test CA
    with s.client(verify=rig.trust_bundle(s)) as c:
        r = c.get(f"https://secret.test:{rig.https.port}/echo")
    assert r.status_code == 502 and "did not verify" in r.text
    assert SECRET.split()[1] not in r.text


def _refusal(raw: bytes) -> str:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), raw[:200]
    return body.decode()


def test_refusals_name_the_host_and_the_reason(rig: Rig, open_session) -> None:
    s = open_session()
    hp, sp = rig.http.port, rig.https.port
    with s.client() as c:
        r = c.get(f"http://nope.test:{hp}/")
        assert r.status_code == 403
        assert r.text == f"kernelmode: nope.test:{hp} is not in this session's egress allow-list\n"
        # The status line says it too (all that http.client shows of a refused CONNECT).
        assert r.reason_phrase == f"kernelmode: nope.test:{hp} is not in this session's egress allow-list"
        assert "denied by this session's egress policy" in c.get(f"http://denied.test:{hp}/").text
        assert "is an IP address" in c.get(f"http://127.0.0.2:{hp}/").text
        r = c.get(f"http://far.test:{hp}/")
        assert r.status_code == 403 and "far.test resolves to 127.0.0.2, a loopback address" in r.text
    # CONNECT is refused the same way, before any tunnel exists.
    for host, says in ((f"nope.test:{sp}", "is not in this session's egress allow-list"),
                       (f"169.254.169.254:{sp}", "is an IP address"),
                       (f"far.test:{hp}", "a loopback address")):
        body = _refusal(s.raw(f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()))
        assert body.startswith("kernelmode: ") and says in body, body
    with pytest.raises(httpx.ProxyError, match="403"):
        with s.client(verify=rig.trust_upstream()) as c:
            c.get(f"https://nope.test:{sp}/")
    assert not any(path.startswith("/never") for _, path, _ in rig.http.seen)


def test_an_ip_literal_opened_by_address_and_named_is_allowed(rig: Rig, open_session) -> None:
    s = open_session()
    with s.client() as c:
        assert c.get(f"http://127.0.0.1:{rig.http.port}/echo").status_code == 200


def test_connect_with_another_sni_is_refused(rig: Rig, open_session) -> None:
    s = open_session()
    before = len(rig.https.seen)
    ctx = rig.trust_upstream()
    import socket
    with socket.create_connection(("127.0.0.1", s.hop_port), timeout=30) as raw:
        raw.sendall(f"CONNECT secure.test:{rig.https.port} HTTP/1.1\r\nHost: secure.test\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with ctx.wrap_socket(raw, server_hostname="other.test") as tls:  # allowed, but not this tunnel's
                tls.sendall(b"GET /fronted HTTP/1.1\r\nHost: other.test\r\n\r\n")
                tls.recv(4096)
    assert len(rig.https.seen) == before


def test_byte_cap(rig: Rig, open_session) -> None:
    s = open_session(max_bytes_per_session=1024 * 1024)
    with s.client() as c:
        assert c.get(f"http://plain.test:{rig.http.port}/bytes/1000").status_code == 200
        with pytest.raises(httpx.HTTPError):
            c.get(f"http://plain.test:{rig.http.port}/bytes/{4 * 1024 * 1024}")  # cut at the cap
        r = c.get(f"http://plain.test:{rig.http.port}/bytes/10")
        assert r.status_code == 403 and "byte cap" in r.text and "max_bytes_per_session" in r.text


def test_connection_cap(rig: Rig, open_session) -> None:
    import socket
    s = open_session(max_connections_per_session=3)
    held = [socket.create_connection(("127.0.0.1", s.hop_port)) for _ in range(3)]
    try:
        for h in held:  # each is accepted and being read by the proxy
            h.sendall(b"GET http://plain.test/ HTTP/1.1\r\n")
        body = _refusal(s.raw(b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n\r\n"))
        assert "3 egress connections open" in body
    finally:
        for h in held:
            h.close()


def test_a_malformed_request_is_a_400(rig: Rig, open_session) -> None:
    s = open_session()
    raw = s.raw(b"CONNECT secure.test:443 HTTP/1.1\r\n\r\n")  # HTTP/1.1 without Host
    assert raw.startswith(b"HTTP/1.1 400") and b"kernelmode: a malformed proxy request" in raw


def test_200_idle_connections_do_not_hurt_another_session(rig: Rig, open_session) -> None:
    import socket
    hog = open_session(max_connections_per_session=250)
    other = open_session()
    idle = []
    try:
        for _ in range(200):  # straight to the unix socket: held open, never a byte sent
            u = socket.socket(socket.AF_UNIX)
            u.connect(str(hog.egress_dir / "proxy.sock"))
            idle.append(u)
        with other.client() as c:
            for _ in range(3):
                assert c.get(f"http://plain.test:{rig.http.port}/echo").status_code == 200
        with hog.client() as c:  # and the hog's own proxy still answers too
            assert c.get(f"http://plain.test:{rig.http.port}/echo").status_code == 200
    finally:
        for u in idle:
            u.close()


def test_an_idle_connection_is_closed(rig: Rig, open_session) -> None:
    import socket
    s = open_session(idle_timeout_seconds=0.3)
    u = socket.socket(socket.AF_UNIX)
    u.settimeout(30)
    u.connect(str(s.egress_dir / "proxy.sock"))
    u.sendall(b"GET http://plain.test/ HTTP/1.1\r\n")  # a head never finished
    assert u.recv(100) == b""  # closed by the proxy, well before the 30 s the test allows
    u.close()


def test_audit_metrics_and_run_usage(rig: Rig, open_session, caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging
    s = open_session()
    rig.egress.set_run(s.session_id, "run-1")
    caplog.set_level(logging.INFO, logger="kernelmode.audit")
    with s.client(verify=rig.trust_bundle(s)) as c:
        c.get(f"http://plain.test:{rig.http.port}/echo")
        c.get(f"http://plain.test:{rig.http.port}/echo")
        c.get(f"http://nope.test:{rig.http.port}/")
        c.get(f"https://secret.test:{rig.https.port}/echo?x=1")
    with s.client(verify=rig.trust_upstream()) as c:
        c.get(f"https://secure.test:{rig.https.port}/bytes/1000")
    rig.egress.set_run(s.session_id, None)
    usage = {(e.host, e.allowed): e.model_dump() for e in rig.egress.usage(s.session_id, "run-1")}
    assert usage[("plain.test", True)]["requests"] == 2 and usage[("plain.test", True)]["bytes"] > 0
    assert usage[("nope.test", False)]["requests"] == 1
    assert usage[("secret.test", True)]["requests"] == 1
    assert usage[("secure.test", True)]["bytes"] > 1000
    assert rig.egress.usage(s.session_id, "another-run") == []

    def audit_lines() -> list[dict]:
        return [json.loads(r.getMessage()) for r in list(caplog.records) if r.name == "kernelmode.audit"]

    def connections() -> list[dict]:
        return [x for x in audit_lines() if x["event"] == "egress" and x["session_id"] == s.session_id]

    # A connection's line is written when it closes, just after the client let it go.
    wait_for(lambda: len(connections()) >= 4, "the audit lines of the 4 connections", timeout=30, every=0.05)
    conns, lines = connections(), audit_lines()
    assert {(c["host"], c["decision"]) for c in conns} >= {("plain.test", "allowed"), ("nope.test", "refused"),
                                                          ("secret.test", "allowed")}
    refused = next(c for c in conns if c["host"] == "nope.test")
    assert refused["rule"] == "not_allowed" and refused["tenant"] == "team-a" and refused["run_id"] == "run-1"
    assert all({"bytes_up", "bytes_down", "duration_ms", "port"} <= set(c) for c in conns)
    req = next(line for line in lines if line["event"] == "egress_request" and line["host"] == "secret.test")
    assert (req["method"], req["path"], req["status"], req["mode"]) == ("GET", "/echo?x=1", 200, "intercept")
    assert SECRET.split()[1] not in caplog.text
    text = rig.metrics.render().decode()
    assert 'kernelmode_egress_connections_total{decision="refused"}' in text
    assert 'kernelmode_egress_connections_total{decision="allowed"}' in text
    assert "kernelmode_egress_bytes_total" in text


def test_open_is_idempotent_and_close_takes_the_socket_away(rig: Rig, open_session) -> None:
    s = open_session()
    rig.loop.run(rig.egress.open(s.session_id, "team-a", s.policy, s.egress_dir))
    with s.client() as c:
        assert c.get(f"http://plain.test:{rig.http.port}/echo").status_code == 200
    rig.loop.run(rig.egress.close(s.session_id))
    # The kernel's CA variables still name a bundle: the system's alone (no upstream or deployment CA).
    assert not (s.egress_dir / "proxy.sock").exists()
    assert (s.egress_dir / "ca-bundle.pem").read_bytes() == kernel_bundle(None, None)
    assert rig.egress.usage(s.session_id) == []


def test_a_moved_proxy_keeps_the_sessions_usage_and_byte_budget(rig: Rig, open_session) -> None:
    """A replaced kernel (a new egress dir) must not hand its session a fresh byte cap."""
    s = open_session(max_bytes_per_session=300_000)
    with s.client() as c:
        assert c.get(f"http://plain.test:{rig.http.port}/bytes/200000").status_code == 200
    moved = rig.root / f"{s.session_id}-moved"
    moved.mkdir()
    rig.loop.run(rig.egress.open(s.session_id, "team-a", s.policy, moved))
    assert not (s.egress_dir / "proxy.sock").exists() and (moved / "proxy.sock").exists()
    assert rig.egress.usage(s.session_id)[0].bytes >= 200_000
    hop, port = rig.loop.run(start_hop(moved / "proxy.sock"))
    try:
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as c:
            with pytest.raises(httpx.HTTPError):  # 200 kB more would pass a fresh 300 kB cap
                c.get(f"http://plain.test:{rig.http.port}/bytes/200000").read()
    finally:
        hop.close()


def test_no_egress_opens_nothing(rig: Rig, tmp_path) -> None:
    from kernelmode.config import EgressSettings
    from kernelmode.egress.policy import server_policy
    rig.loop.run(rig.egress.open("quiet", None, server_policy(EgressSettings()), tmp_path))
    assert list(tmp_path.iterdir()) == [] and not rig.egress.is_open("quiet")
