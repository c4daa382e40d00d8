"""Egress from kernels on Enterprise Gateway nodes (a claimed pool kernel among them): each kernel
reaches `kernelmode egress-proxy` (on the gateway's address of the rig, the one port the node's
firewall opens for it) with its own id and token, and gets its own session's policy; without the token, or with another kernel's id,
it gets a 407. The upstream is a real HTTP server on the host's 127.0.0.1, named through
`egress.hosts` (opened by `allow_addresses: 127.0.0.1/32`): no packet leaves this machine. A
secret rule works there too: the proxy's CA (egress.ca_dir, made by `--make-ca`) is in the bundle
the node kernels trust (egress.remote_ca_bundle, written by `--write-ca-bundle`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_cluster import run
from tests.conftest import Server, start_server
from tests.support.cluster import eg as eg_mod
from tests.support.cluster.rig import Rig
from tests.support.server import wait_for
from tests.support.upstreams import Upstream, make_test_ca

REPO = Path(__file__).resolve().parents[2]
NODE_SECRET = "km-node-secret-5f0c1a"  # a secret rule's value: the upstream gets it, no kernel does


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.stop()


@pytest.fixture(scope="module")
def tls_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Upstream, str]]:
    """An HTTPS upstream with a test CA of its own, and that CA's PEM (for kernel code)."""
    ca, cert = make_test_ca(tmp_path_factory.mktemp("tlsup"))
    u = Upstream(cert)
    yield u, ca.read_text()
    u.stop()


@pytest.fixture(scope="module")
def egress_served(rig: Rig, eg: eg_mod.EnterpriseGateway, upstream: Upstream,
                  tls_upstream: tuple[Upstream, str]) -> Iterator[Server]:
    """`serve` on the rig's EG, and `kernelmode egress-proxy` beside it (same file, same store)."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmclegress-", dir="/tmp"))
    cfg = data_dir.with_suffix(".yaml")
    address = f"{rig.gateway_address}:{rig.egress_port}"
    https, ca_pem = tls_upstream
    upstream_ca, ca_dir, bundle = data_dir / "upstream-ca.pem", data_dir / "shared-ca", data_dir.with_suffix(".bundle.pem")
    upstream_ca.write_text(ca_pem)
    cfg.write_text(f"""
egress:
  allow: ["plain.test:{upstream.port}", "other.test:{upstream.port}", "secure.test:{https.port}",
          "secret.test:{https.port}"]
  hosts: {{"plain.test": "127.0.0.1", "other.test": "127.0.0.1", "secure.test": "127.0.0.1",
           "secret.test": "127.0.0.1"}}
  allow_addresses: ["127.0.0.1/32"]
  secrets: [{{host: secret.test, header: X-Km-Secret, value: "{NODE_SECRET}"}}]
  upstream_ca_file: "{upstream_ca}"
  ca_dir: "{ca_dir}"
  remote_ca_bundle: "{bundle}"
  listen: "{address}"
  proxy_address: "{address}"
""")
    # As an operator does: one CA for every proxy, and the nodes' bundle written from it.
    for flag in (["--make-ca"], ["--write-ca-bundle", str(bundle)]):
        subprocess.run([sys.executable, "-m", "kernelmode.cli", "egress-proxy", "--config", str(cfg), *flag],
                       check=True, capture_output=True, cwd=REPO, timeout=60)
    # A pool of one: the first session gets a warm kernel whose token was minted before any
    # session was known (the session is found by kernel id at request time).
    srv = start_server({**eg.env(), "KERNELMODE_SESSIONS__POOL_SIZE": "1"}, data_dir=data_dir,
                       args=["--config", str(cfg)])
    log = data_dir.with_suffix(".egress.log").open("wb")
    proxy = subprocess.Popen([sys.executable, "-m", "kernelmode.cli", "egress-proxy", "--config", str(cfg),
                              "--data-dir", str(data_dir)], stdout=subprocess.PIPE, stderr=log, cwd=REPO)
    try:
        assert proxy.stdout is not None
        line = proxy.stdout.readline().decode()  # printed once it listens (or EOF if it failed)
        assert "listening" in line, data_dir.with_suffix(".egress.log").read_text()
        yield srv
    finally:
        proxy.terminate()
        proxy.wait(30)
        log.close()
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        for suffix in (".yaml", ".log", ".egress.log", ".bundle.pem"):
            data_dir.with_suffix(suffix).unlink(missing_ok=True)


GET = """
import urllib.request, urllib.error
def get(url, **kw):
    try:
        with urllib.request.urlopen(url, timeout=30, **kw) as r:
            return f"{r.status} {r.read().decode()[:200]}".strip()
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()[:200]}".strip()
"""

RAW = """
import os, socket, base64
def raw(auth):
    host, port = os.environ["HTTP_PROXY"].rpartition("@")[2].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    head = "GET http://plain.test:{port}/echo HTTP/1.1\\r\\nHost: plain.test\\r\\n"
    if auth:
        head += "Proxy-Authorization: Basic " + base64.b64encode(auth.encode()).decode() + "\\r\\n"
    s.sendall((head + "Connection: close\\r\\n\\r\\n").encode())
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out.decode(errors="replace").split("\\r\\n")[0]
"""


def test_a_node_kernel_reaches_what_its_session_allows_through_the_egress_proxy(
        egress_served: Server, upstream: Upstream, tls_upstream: tuple[Upstream, str]) -> None:
    port, (https, ca_pem) = upstream.port, tls_upstream
    with egress_served.client() as c:
        wait_for(lambda: c.get("/readyz").json()["checks"]["pool"]["ready"] >= 1, "a warm kernel on a node",
                 timeout=180)
        r = c.post("/v1/sessions", json={"session_id": "eg-egress-a", "egress": {
            "allow": [f"plain.test:{port}", f"secure.test:{https.port}"]}})
        assert r.status_code == 201 and r.json()["from_pool"], r.text
        assert run(c, "eg-egress-a", GET + RAW.replace("{port}", str(port)))["status"] == "ok"
        r = run(c, "eg-egress-a", f"get('http://plain.test:{port}/echo')")
        assert r["status"] == "ok" and r["result"].strip("'\"").startswith("200 "), r
        # HTTPS: a CONNECT with the kernel's credential, tunnelled (the kernel verifies the upstream).
        code = (f"import ssl\nctx = ssl.create_default_context(cadata={ca_pem!r})\n"
                f"get('https://secure.test:{https.port}/bytes/5000', context=ctx)")
        r = run(c, "eg-egress-a", code)
        assert r["result"].strip("'\"").startswith("200 " + "x" * 100), r
        # In the server's allow-list, not in this session's: the session's policy refuses it.
        r = run(c, "eg-egress-a", f"get('http://other.test:{port}/echo')")
        assert r["result"].strip("'\"").startswith("403 kernelmode: other.test") and "allow-list" in r["result"], r
        # No credential, or a wrong token: 407 with a one-line kernelmode text.
        r = run(c, "eg-egress-a", "raw(None)")
        assert "407 kernelmode: this proxy needs the kernel's own credential" in r["result"], r
        r = run(c, "eg-egress-a", "raw(os.environ['HTTP_PROXY'].split('//')[1].split(':')[0] + ':' + '0' * 48)")
        assert "407 kernelmode: the Proxy-Authorization credential is not a kernel's" in r["result"], r
        # The token is the kernel's, in its environment; no secret, no other credential is.
        r = run(c, "eg-egress-a", "sorted(k for k in os.environ if 'KERNEL_' in k or 'TOKEN' in k)")
        assert r["result"] == "[]", r
    assert any(path == "/echo" for _, path, _ in upstream.seen)


def test_a_session_cannot_reach_what_only_another_sessions_policy_allows(
        egress_served: Server, upstream: Upstream) -> None:
    port = upstream.port
    with egress_served.client() as c:
        for sid, host in (("eg-egress-b", "plain.test"), ("eg-egress-c", "other.test")):
            r = c.post("/v1/sessions", json={"session_id": sid, "egress": {"allow": [f"{host}:{port}"]}})
            assert r.status_code == 201, r.text
            assert run(c, sid, GET + RAW.replace("{port}", str(port)))["status"] == "ok"
        b_kernel = c.get("/v1/sessions/eg-egress-b").json()["kernel_id"]
        # C's own credential gives C's policy: plain.test (B's) is refused.
        r = run(c, "eg-egress-c", f"get('http://plain.test:{port}/echo')")
        assert r["result"].strip("'\"").startswith("403 kernelmode: plain.test"), r
        # C's token under B's kernel id (all C can know of B) opens nothing.
        r = run(c, "eg-egress-c", f"raw({b_kernel!r} + ':' + os.environ['HTTP_PROXY'].split(':')[2].split('@')[0])")
        assert "407 kernelmode:" in r["result"], r
        # Deleted, B's kernel's token opens nothing either (its kernel is shut down).
        token_b = run(c, "eg-egress-b", "os.environ['HTTP_PROXY'].split('//')[1].split('@')[0]")["result"].strip("'")
        assert c.delete("/v1/sessions/eg-egress-b").status_code in (200, 204)
        r = run(c, "eg-egress-c", f"raw({token_b!r})")
        assert "407 kernelmode:" in r["result"] or "403 kernelmode:" in r["result"], r


def test_a_secret_rule_works_for_a_node_kernel_through_the_shared_ca(
        egress_served: Server, tls_upstream: tuple[Upstream, str]) -> None:
    https = tls_upstream[0]
    with egress_served.client() as c:
        r = c.post("/v1/sessions", json={"session_id": "eg-egress-s", "egress": {"allow": [f"secret.test:{https.port}"]}})
        assert r.status_code == 201, r.text
        # The kernel's default trust (no context, no verify=False): the CA variables name the bundle.
        code = GET + f"get('https://secret.test:{https.port}/bytes/64')"
        r = run(c, "eg-egress-s", code)
        assert r["status"] == "ok" and r["result"].strip("'\"").startswith("200 " + "x" * 64), r
        assert [h.get("x-km-secret") for _, path, h in https.seen if path == "/bytes/64"][-1] == NODE_SECRET
        # The value is nowhere the kernel can read: not its environment, not what came back.
        r = run(c, "eg-egress-s", "import os\n(os.environ.get('SSL_CERT_FILE'), "
                f"any({NODE_SECRET!r} in v for v in os.environ.values()))")
        assert r["result"] == f"({str(egress_served.data_dir.with_suffix('.bundle.pem'))!r}, False)", r
        r = run(c, "eg-egress-s", f"{NODE_SECRET!r} in get('https://secret.test:{https.port}/echo')")
        assert r["result"] == "False", r
