"""Egress end to end, from kernel code, on both backends: the manager's proxy (kernelmode.egress)
wired to each session's kernel (sessions/egress_wiring.py) through the in-sandbox bridge.

The upstreams are real servers this module starts on 127.0.0.1 (HTTP, HTTPS with a test CA given
as egress.upstream_ca_file, a package index); every name the policy allows is mapped to a
loopback address by egress.hosts, and the one refused address is 127.0.0.2 (127.0.0.1/32 is the
only range opened). Names that are not allowed are refused before any lookup: no test resolves a
name through DNS or sends a packet beyond this machine's loopback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelmode.sandbox.egress import egress_dir
from kernelmode.sandbox.egress_bridge import NO_EGRESS
from tests.conftest import Server, start_server, wait_for
from tests.security.conftest import PRELUDE, report
from tests.support.package_index import PackageIndex, temporary_index
from tests.support.upstreams import Upstream, WebSocketEcho, make_test_ca

SECRET = "Bearer egress-kernel-canary-5d1e08b2"


@dataclass
class Upstreams:
    http: Upstream
    https: Upstream
    index: PackageIndex
    git: Upstream | None
    wss: WebSocketEcho  # a repository over HTTPS ("dumb" protocol), when this host has git

    @property
    def git_port(self) -> int:
        return self.git.port if self.git is not None else 1

    @property
    def index_port(self) -> int:
        return int(self.index.url.split(":")[2].split("/")[0])


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Upstreams, Path]]:
    root = tmp_path_factory.mktemp("upstreams")
    ca, cert = make_test_ca(root)
    http, https = Upstream(), Upstream(cert)
    git = Upstream(cert, files=_git_repository(root)) if shutil.which("git") else None
    wss = WebSocketEcho(cert)
    try:
        with temporary_index() as index:
            yield Upstreams(http, https, index, git, wss), ca
    finally:
        for server in (http, https, git, wss):
            if server is not None:
                server.stop()


def _git_repository(root: Path) -> Path:
    """``root/served/repo.git``: a bare repository with one commit, ready for "dumb" HTTP."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    work, served = root / "work", root / "served"
    served.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    (work / "README").write_text("cloned through the egress proxy\n")
    for cmd in (["add", "README"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]):
        subprocess.run(["git", "-C", str(work), *cmd], check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(served / "repo.git")], check=True, env=env)
    subprocess.run(["git", "-C", str(served / "repo.git"), "update-server-info"], check=True, env=env)
    return served


def _config(u: Upstreams, ca: Path) -> str:
    hp, sp, ip, gp = u.http.port, u.https.port, u.index_port, u.git_port
    loopback = {n: "127.0.0.1" for n in ("plain.test", "secure.test", "secret.test", "other.test",
                                          "denied.test", "index.test")}
    egress = {
        "allow": [f"plain.test:{hp}", f"denied.test:{hp}", f"far.test:{hp}", f"secure.test:{sp}",
                  f"secret.test:{sp}", f"other.test:{sp}", f"index.test:{ip}", f"other.test:{gp}",
                  f"secure.test:{u.wss.port}", f"secret.test:{u.wss.port}"],
        "deny": ["denied.test"],
        "hosts": {**loopback, "far.test": "127.0.0.2"},
        "allow_addresses": ["127.0.0.1/32"],
        "secrets": [{"host": "secret.test", "header": "Authorization", "value": "${KM_EGRESS_TEST_SECRET}"}],
        "upstream_ca_file": str(ca),
    }
    return json.dumps({"egress": egress})  # YAML is a superset of JSON


@pytest.fixture(scope="module")
def server(upstreams: tuple[Upstreams, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's own server (overrides the shared one for api, run, probe, session_factory)."""
    u, ca = upstreams
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(_config(u, ca))
    env = {"KM_EGRESS_TEST_SECRET": SECRET, "KERNELMODE_SESSIONS__POOL_SIZE": "1"}
    srv = start_server(env, args=["--config", str(cfg)])
    srv.restart_args = (env, ["--config", str(cfg)])  # type: ignore[attr-defined]
    yield srv
    srv.discard()


# Kernel side: each fetch reports [status, body] or ["error", text]; urllib honours HTTP(S)_PROXY.
FETCH = """
import urllib.request, urllib.error
def fetch(url, data=None, headers=None, limit=None):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return [r.status, r.read(limit).decode(errors="replace")]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode(errors="replace")]
    except (urllib.error.URLError, OSError) as e:
        return ["error", str(getattr(e, "reason", e))]
"""


def _egress(result: dict) -> dict[tuple[str, bool], dict]:
    return {(e["host"], e["allowed"]): e for e in result.get("egress", [])}


def test_allowed_hosts_from_kernel_code(upstreams, session_factory, run):
    u, _ = upstreams
    hp, sp, ip = u.http.port, u.https.port, u.index_port
    sid = session_factory()
    code = FETCH + f"""
import hashlib, os, subprocess, sys
out = {{"get": fetch("http://plain.test:{hp}/echo")}}
body = os.urandom(300_000)
out["post"] = fetch("https://secure.test:{sp}/post", data=body)
out["post_sha"] = hashlib.sha256(body).hexdigest()
# A streamed download of 40 MB through a tunnel (CONNECT; the kernel verifies the upstream itself).
n = 0
with urllib.request.urlopen("https://secure.test:{sp}/bytes/{40 << 20}", timeout=120) as r:
    while chunk := r.read(1 << 20):
        n += len(chunk)
out["streamed"] = n
import pandas
out["csv"] = pandas.read_csv("http://plain.test:{hp}/rain.csv").to_dict("list")
try:
    import requests
except ImportError:
    out["requests"] = None
else:
    out["requests"] = requests.post("https://secure.test:{sp}/post", data=b"x" * 1000, timeout=60).json()
p = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-cache-dir",
                    "--disable-pip-version-check", "--no-deps", "--index-url", "http://index.test:{ip}/simple/",
                    "--trusted-host", "index.test",
                    "-d", "/tmp/dl", "kmtest-lib"], capture_output=True, text=True, timeout=120)
out["pip"] = [p.returncode, sorted(os.listdir("/tmp/dl")) if p.returncode == 0 else p.stderr[-2000:]]
import shutil
if shutil.which("git"):  # HTTPS_PROXY and GIT_SSL_CAINFO from the kernel's environment
    p = subprocess.run(["git", "clone", "-q", "https://other.test:{u.git_port}/repo.git", "/tmp/clone"],
                       capture_output=True, text=True, timeout=120)
    out["git"] = open("/tmp/clone/README").read() if p.returncode == 0 else p.stderr[-2000:]
else:
    out["git"] = None
print(_json.dumps(out))
"""
    r = run(sid, PRELUDE + code, timeout_seconds=300)
    out = report(r)
    assert out["get"][0] == 200 and json.loads(out["get"][1])["path"] == "/echo", out
    posted = json.loads(out["post"][1])
    assert out["post"][0] == 200 and posted == {"length": 300_000, "sha256": out["post_sha"]}, out
    assert out["streamed"] == 40 << 20
    assert out["csv"] == {"city": ["Oslo", "Bergen", "Tromso"], "rain_mm": [763, 2250, 1030]}
    assert out["requests"] in (None, {"length": 1000, "sha256": hashlib.sha256(b"x" * 1000).hexdigest()})
    assert out["pip"][0] == 0 and out["pip"][1] == ["kmtest_lib-1.0-py3-none-any.whl"], out["pip"]
    # git is in a bwrap kernel when the host has it (the sandbox mounts the host's /usr), and in
    # kernelmode's Docker image (kernel-image/Dockerfile).
    if u.git is not None:
        assert out["git"] == "cloned through the egress proxy\n", out["git"]
    # The run's result lists what it reached.
    used = _egress(r)
    assert used[("plain.test", True)]["requests"] >= 2 and used[("index.test", True)]["requests"] >= 1, r["egress"]
    assert used[("secure.test", True)]["bytes"] >= (40 << 20) + 300_000, r["egress"]
    assert not any(not e["allowed"] for e in r["egress"]), r["egress"]
    if out["git"] is not None:
        assert any(e["host"] == "other.test" and e["port"] == u.git_port for e in r["egress"]), r["egress"]


# Kernel side: a WebSocket handshake and one echoed message with the stdlib alone (the kernel's
# environment has no WebSocket client): http.client through HTTPS_PROXY, the bundle of SSL_CERT_FILE.
WS_ECHO = """
import base64, http.client, os, ssl, urllib.parse
def ws_echo(host, port, message):
    proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
    c = http.client.HTTPSConnection(proxy.hostname, proxy.port, context=ssl.create_default_context(), timeout=60)
    c.set_tunnel(host, port)
    key = base64.b64encode(os.urandom(16)).decode()
    c.request("GET", "/chat", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                       "Sec-WebSocket-Key": key, "Sec-WebSocket-Version": "13"})
    r = c.getresponse()
    if r.status != 101:
        return [r.status, r.read().decode(errors="replace")]
    data, mask = message.encode(), os.urandom(4)
    c.sock.sendall(bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
    got = b""
    while len(got) < 2 + len(data):
        got += c.sock.recv(4096)
    c.close()
    return [101, got[2:].decode()]
"""


def test_websockets_from_kernel_code(upstreams, session_factory, probe):
    """wss:// tunnelled end to end, and to an intercepted host (the secret on the upgrade request)."""
    u, _ = upstreams
    wp = u.wss.port
    sid = session_factory()
    out = probe(sid, WS_ECHO + f"""
print(_json.dumps({{"tunnel": ws_echo("secure.test", {wp}, "tunnelled"),
                    "intercept": ws_echo("secret.test", {wp}, "intercepted")}}))
""")
    assert out == {"tunnel": [101, "tunnelled"], "intercept": [101, "intercepted"]}, out
    assert u.wss.seen[-1]["authorization"] == SECRET
    assert "authorization" not in u.wss.seen[-2]


def test_secret_reaches_the_upstream_never_the_kernel(upstreams, session_factory, probe, server):
    u, _ = upstreams
    sp = u.https.port
    sid = session_factory()
    before = len(u.https.seen)
    r = probe(sid, FETCH + f"""
import glob
out = {{"own": fetch("https://secret.test:{sp}/api", headers={{"Authorization": "Bearer kernel-own"}})}}
out["refused_page"] = fetch("http://secret.test:1/")  # a refusal names the host: never the value
out["tunnel_page"] = fetch("https://nothere.test/")
seen = [repr(dict(_os.environ))]
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        seen.append(open(path, "rb").read().decode(errors="replace"))
    except OSError:
        pass
files = []
for name in _os.listdir("/run/kernelmode/egress"):
    path = "/run/kernelmode/egress/" + name
    if _os.path.isfile(path):
        files.append(name)
        seen.append(open(path, "rb").read().decode(errors="replace"))
out["files"] = sorted(files)
out["leaked"] = [s for s in seen + [repr(out)] if {SECRET.split()[1]!r} in s][:3]
print(_json.dumps(out))
""")
    assert r["own"][0] == 200, r
    # The upstream got the secret (the kernel's own value replaced); the kernel saw only the name.
    got = [h for m, p, h in u.https.seen[before:] if p == "/api"]
    assert got and got[-1]["authorization"] == SECRET, got
    assert "authorization" in json.loads(r["own"][1])["header_names"]
    assert r["refused_page"][0] == 403 and "secret.test:1" in r["refused_page"][1], r
    assert r["tunnel_page"][0] == "error" and "403" in r["tunnel_page"][1], r
    assert r["files"] == ["ca-bundle.pem"] and r["leaked"] == [], r
    # Nor does the manager's log or a session's info show it.
    assert SECRET.split()[1] not in server.log()


def test_refusals_from_kernel_code(upstreams, server, api, session_factory, run):
    u, _ = upstreams
    hp, sp = u.http.port, u.https.port
    sid, other = session_factory(), session_factory()
    other_kernel = api.get(f"/v1/sessions/{other}").json()["kernel_id"]
    other_sock = egress_dir(server.data_dir / "run", other_kernel) / "proxy.sock"
    assert other_sock.exists()  # the other session's proxy listens (egress by default here)
    code = FETCH + f"""
import socket, ssl
# (127.0.0.1 is in NO_PROXY: a client connects there itself, inside the sandbox, and meets nothing.)
out = {{"not_allowed": fetch("http://nothere.test/x"), "denied": fetch("http://denied.test:{hp}/x"),
       "ip_literal": fetch("http://127.0.0.2:{hp}/x"), "refused_address": fetch("http://far.test:{hp}/x"),
       "wrong_port": fetch("http://plain.test:{hp + 1 if hp + 1 != sp else hp + 2}/x")}}
# CONNECT to an allowed name, then a ClientHello naming another (allowed) one: domain fronting.
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(b"CONNECT secure.test:{sp} HTTP/1.1\\r\\nHost: secure.test:{sp}\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
ctx = ssl.create_default_context()
try:
    ctx.wrap_socket(s, server_hostname="other.test").close()
    out["fronting"] = "handshake completed"
except (ssl.SSLError, OSError) as e:
    out["fronting"] = type(e).__name__
out["fronting_status"] = head.split(b"\\r\\n")[0].decode()
try:
    socket.getaddrinfo("plain.test", 80)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
try:  # a refused CONNECT: http.client shows only the status line, which says why
    urllib.request.urlopen("https://nothere.test/", timeout=30)
except urllib.error.URLError as e:
    out["tunnel"] = str(e.reason)
u = socket.socket(socket.AF_UNIX)
try:
    u.connect({str(other_sock)!r})
    out["other_session"] = "connected"
except OSError as e:
    out["other_session"] = _err(e)
print(_json.dumps(out))
"""
    r = run(sid, PRELUDE + code, timeout_seconds=120)
    out = report(r)
    assert out["not_allowed"] == [403, "kernelmode: nothere.test is not in this session's egress allow-list\n"], out
    assert out["denied"][0] == 403 and "denied.test is denied" in out["denied"][1], out
    assert out["ip_literal"][0] == 403 and "is an IP address" in out["ip_literal"][1], out
    assert out["refused_address"][0] == 403 and "resolves to 127.0.0.2, a loopback address" in out["refused_address"][1]
    assert out["wrong_port"][0] == 403 and "not in this session's egress allow-list" in out["wrong_port"][1], out
    assert out["fronting_status"].startswith("HTTP/1.1 200") and out["fronting"] != "handshake completed", out
    assert out["dns"] == "gaierror" and out["other_session"] == "ENOENT", out
    assert "403 kernelmode: nothere.test is not in this session's egress allow-list" in out["tunnel"], out
    refused = {e["host"] for e in r["egress"] if not e["allowed"]}
    # Uncaught, a refusal says it is the policy (a hint, as for a missing network), and code that
    # skips the proxy is told where the way out is.
    r2 = run(sid, FETCH + "urllib.request.urlopen('http://nothere.test/y', timeout=30)")
    assert r2["error"]["ename"] == "HTTPError" and "nothere.test is not in this session's egress allow-list. " \
        "kernelmode: this is the session's egress policy, so retrying will not help" in r2["error"]["evalue"], r2
    r2 = run(sid, "import socket\nsocket.create_connection(('plain.test', 80), timeout=5)")
    assert "HTTP and HTTPS go through the session's egress proxy" in r2["error"]["evalue"], r2["error"]
    assert {"nothere.test", "denied.test", "127.0.0.2", "far.test", "secure.test"} <= refused, r["egress"]
    assert not u.http.seen or all(p != "/x" for _, p, _ in u.http.seen), u.http.seen  # nothing got through
    # Each connection is an audit line naming the session and the run, and a metrics sample.
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]
    mine = [e for e in lines if e["event"] == "egress" and e["session_id"] == sid and e["run_id"] == r["run_id"]]
    assert {(e["host"], e["decision"], e["rule"]) for e in mine} >= {
        ("nothere.test", "refused", "not_allowed"), ("denied.test", "refused", "denied.test"),
        ("far.test", "refused", "address"), ("secure.test", "refused", "sni")}, mine
    metrics = api.get("/metrics").text
    assert 'kernelmode_egress_connections_total{decision="refused"}' in metrics


def test_a_session_without_egress_is_offline_with_a_clear_refusal(session_factory, run, api):
    sid = session_factory(egress={"allow": []})
    assert api.get(f"/v1/sessions/{sid}").json().get("egress") is None
    r = run(sid, PRELUDE + FETCH + """
out = {"http": fetch("http://plain.test/x"), "https": fetch("https://secure.test/x"),
       "sock": _os.path.exists("/run/kernelmode/egress/proxy.sock")}
print(_json.dumps(out))
""")
    out = report(r)
    assert out["http"] == [403, NO_EGRESS + "\n"] and NO_EGRESS in out["https"][1] and not out["sock"], out
    assert "egress" not in r  # nothing reached, nothing listed
    # Code that skips the proxy meets no network at all, and the error says it is by design.
    r = run(sid, "import socket\nsocket.create_connection(('plain.test', 80), timeout=5)")
    assert r["status"] == "error" and "no network by design" in r["error"]["evalue"], r["error"]
    r = run(sid, "import urllib.request\nurllib.request.urlopen('http://plain.test/', timeout=5)")
    assert "no network by design" in r["error"]["evalue"] and "tools.help()" in r["error"]["evalue"], r["error"]


def test_proxy_comes_back_after_a_manager_restart_and_follows_a_woken_session(upstreams, server):
    """kill -9 of `serve`: the proxy dies with it (kernels meet the bridge's "not answering"); the
    next `serve` adopts the kernels and opens their sessions' sockets again. That one hibernates
    idle sessions: a woken session's new kernel gets the proxy too. Last in the module: it
    replaces the module's server."""
    u, _ = upstreams
    hp = u.http.port
    with server.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        fetch = FETCH + f"\nx = 7\nprint(fetch('http://plain.test:{hp}/echo')[0])"
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": fetch}).json()
        assert r["stdout"].strip() == "200", r
        kernel = c.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    env, args = server.restart_args  # type: ignore[attr-defined]
    srv2 = start_server({**env, "KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "2"},
                        data_dir=server.data_dir, args=args)
    again = {"code": FETCH + f"\nprint(x, fetch('http://plain.test:{hp}/echo')[0])"}
    try:
        with srv2.client() as c:
            r = c.post(f"/v1/sessions/{sid}/execute", json=again).json()
            assert r["status"] == "ok" and r["stdout"].strip() == "7 200", r  # variables kept: same kernel
            assert c.get(f"/v1/sessions/{sid}").json()["kernel_id"] == kernel
            assert {(e["host"], e["allowed"]) for e in r["egress"]} == {("plain.test", True)}, r
            wait_for(lambda: c.get(f"/v1/sessions/{sid}").json()["status"] == "hibernated", "hibernation", 60)
            r = c.post(f"/v1/sessions/{sid}/execute", json=again).json()
            assert r["status"] == "ok" and r["stdout"].strip() == "7 200", r  # woken: a new kernel, restored
            assert c.get(f"/v1/sessions/{sid}").json()["kernel_id"] != kernel
    finally:
        srv2.stop()
