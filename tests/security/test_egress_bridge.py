"""The sandbox's path out (sandbox/egress.py, egress_bridge.py), on both backends.

A kernel still has only `lo`; the bridge on 127.0.0.1:3128 inside relays to the session's socket
in its egress dir (read-only at /run/kernelmode/egress), or answers a refusal itself. Here the
TEST stands in for the manager's egress proxy: an HTTP proxy on a unix socket at the kernel's
egress dir (tests/support/unix_proxy.py). Nothing is ever sent off this machine: the proxy answers
every request itself, and the kernels have no other way out.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from kernelmode.sandbox.egress import egress_dir
from kernelmode.sandbox.egress_bridge import NO_EGRESS, NOT_ANSWERING
from tests.conftest import wait_for
from tests.support.unix_proxy import UnixProxy

ROOT = os.getuid() == 0

# In the kernel: GET (and POST) through HTTP_PROXY with urllib, an https:// URL (a CONNECT),
# and requests when the kernel environment has it. Reports status, body or error of each.
FETCH = """
import urllib.request, urllib.error
def fetch(url, data=None):
    try:
        with urllib.request.urlopen(url, data=data, timeout=20) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
    except urllib.error.URLError as e:
        return ["error", str(e.reason)]
out = {"get": fetch("http://example.test/x"), "post": fetch("http://example.test/p", b"payload"),
       "connect": fetch("https://example.test/s")}
try:
    import requests
except ImportError:
    out["requests"] = None
else:
    r = requests.get("http://example.test/r", timeout=20)
    out["requests"] = [r.status_code, r.text]
print(_json.dumps(out))
"""

# A CONNECT tunnel by hand: 4 MiB each way at once (more than the bridge's buffers), then a
# half-close; the stand-in proxy echoes, so what comes back must be what went out.
TUNNEL = """
import hashlib, socket, threading
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall(b"CONNECT example.test:443 HTTP/1.1\\r\\nHost: example.test:443\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
payload = _os.urandom(4 << 20)
def send():
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
t = threading.Thread(target=send)
t.start()
got = bytearray()
while chunk := s.recv(1 << 16):
    got += chunk
t.join()
print(_json.dumps({"status": head.split(b"\\r\\n")[0].decode(), "same": hashlib.sha256(got).hexdigest()
                   == hashlib.sha256(payload).hexdigest(), "n": len(got)}))
"""


def _egress_dir(server, api, sid: str) -> Path:
    """Where the manager's proxy would put the session's socket (LiveSession.egress_dir)."""
    kernel_id = api.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    return egress_dir(server.data_dir / "run", kernel_id)


def _bridges_of(uid: int) -> list[int]:
    """Host pids of the egress bridges running as ``uid`` (a kernel's own host uid)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid and (d / "cmdline").read_bytes().split(b"\0")[1:4] == [
                    b"-I", b"-S", b"/run/kernelmode/egress-bridge.py"]:  # not bwrap's, which names it too
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _connect_as(uid: int, path: Path) -> str:
    """Connect to the unix socket at ``path`` from the host as ``uid`` (no groups): "connected"
    or the errno's name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only syscalls here, then _exit: safe in a forked threaded process
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            socket.socket(socket.AF_UNIX).connect(str(path))
            os.write(w, b"connected")
        except OSError as e:
            os.write(w, errno.errorcode.get(e.errno or 0, "?").encode())
        os._exit(0)
    os.close(w)
    try:
        return os.read(r, 64).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_kernel_environment_points_at_the_bridge_and_a_usable_bundle(shared_sid, probe, run):
    r = probe(shared_sid, """
        import ssl, subprocess, sys
        names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy",
                 "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO")
        out = {"env": {k: _os.environ.get(k) for k in names}, "argv_env": "KM_KERNEL_ARGV" in _os.environ}
        # What httpx does at Client(): a bundle that is not there would raise here.
        out["ca"] = ssl.create_default_context(cafile=_os.environ["SSL_CERT_FILE"]).cert_store_stats()["x509_ca"]
        out["default_ctx"] = ssl.create_default_context() is not None
        pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
        out["pip"] = [pip.returncode, pip.stderr[-300:]]
        print(_json.dumps(out))
    """)
    env = r["env"]
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[k] == "http://127.0.0.1:3128", env
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO"):
        assert env[k] == "/run/kernelmode/egress/ca-bundle.pem", env
    assert r["argv_env"] is False  # the bridge's own variable does not reach the kernel
    assert r["ca"] > 10 and r["default_ctx"] and r["pip"][0] == 0, r
    # %pip still asks the manager, not the network (the refusal names what to ask for instead).
    res = run(shared_sid, "%pip list")
    assert res["status"] == "error" and "pip install" in res["error"]["evalue"], res


def test_without_egress_a_request_gets_the_refusal_in_one_line(shared_sid, probe):
    r = probe(shared_sid, FETCH)
    assert r["get"] == [403, NO_EGRESS + "\n"], r
    assert r["post"] == [403, NO_EGRESS + "\n"], r
    assert r["connect"][0] == "error" and NO_EGRESS in r["connect"][1], r  # CONNECT: the status line
    assert r["requests"] in (None, [403, NO_EGRESS + "\n"]), r


def test_requests_go_through_the_sessions_socket(server, api, session_factory, probe):
    sid = session_factory()
    with UnixProxy(_egress_dir(server, api, sid) / "proxy.sock") as proxy:
        r = probe(sid, FETCH)
        assert r["get"] == [200, "hello from the egress proxy"], r
        assert r["post"] == [200, "hello from the egress proxy"], r
        assert r["requests"] in (None, [200, "hello from the egress proxy"]), r
        lines = [q["line"] for q in proxy.requests]
        assert "GET http://example.test/x HTTP/1.1" in lines, lines  # absolute-form: a proxy request
        assert [q["body"] for q in proxy.requests if q["line"].startswith("POST")] == [b"payload"]
        assert any(x.startswith("CONNECT example.test:443 ") for x in lines), lines
        t = probe(sid, TUNNEL)
        assert t == {"status": "HTTP/1.1 200 Connection established", "same": True, "n": 4 << 20}, t


def test_a_proxy_that_is_down_is_reported_and_comes_back(server, api, session_factory, probe):
    sid = session_factory()
    path = _egress_dir(server, api, sid) / "proxy.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # the socket file of a proxy that died: connecting is refused
    stale.close()
    try:
        r = probe(sid, FETCH)
        assert r["get"] == [503, NOT_ANSWERING + "\n"], r
        assert r["connect"][0] == "error" and NOT_ANSWERING in r["connect"][1], r
    finally:
        path.unlink()
    with UnixProxy(path):  # the proxy is back: the same kernel gets out, no restart
        assert probe(sid, FETCH)["get"] == [200, "hello from the egress proxy"]


def test_egress_dir_is_read_only_inside(server, api, session_factory, probe):
    sid = session_factory()
    d = _egress_dir(server, api, sid)
    with UnixProxy(d / "proxy.sock"):
        r = probe(sid, """
            import socket
            d = '/run/kernelmode/egress'
            out = {"list": sorted(_os.listdir(d))}
            def attempt(key, fn):
                try:
                    fn()
                    out[key] = "ok"
                except OSError as e:
                    out[key] = _err(e)
            def bind():
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.bind(d + '/planted.sock')
                finally:
                    s.close()
            def connect():  # on a read-only mount: connecting needs no write access to it
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(d + '/proxy.sock')
                finally:
                    s.close()
            attempt("bind_socket", bind)
            attempt("create_file", lambda: open(d + '/planted', 'w').close())
            attempt("append_bundle", lambda: open(d + '/ca-bundle.pem', 'a').close())
            attempt("unlink_socket", lambda: _os.unlink(d + '/proxy.sock'))
            attempt("rename_bundle", lambda: _os.rename(d + '/ca-bundle.pem', d + '/x'))
            attempt("symlink", lambda: _os.symlink('/etc/passwd', d + '/link'))
            attempt("mkdir", lambda: _os.mkdir(d + '/sub'))
            attempt("chmod_dir", lambda: _os.chmod(d, 0o777))
            attempt("write_bridge", lambda: open('/run/kernelmode/egress-bridge.py', 'a').close())
            attempt("connect", connect)
            out["after"] = sorted(_os.listdir(d))
            print(_json.dumps(out))
        """)
    assert r["connect"] == "ok", r
    attacks = {k: v for k, v in r.items() if k not in ("list", "after", "connect")}
    # Every change to the directory meets the read-only mount (whatever the host's modes say);
    # writing a file that is not the kernel's is refused already by its mode.
    files = {k: attacks.pop(k) for k in ("append_bundle", "write_bridge")}
    assert set(attacks.values()) == {"EROFS"}, attacks
    assert set(files.values()) <= {"EROFS", "EACCES"}, files
    assert r["list"] == r["after"] == ["ca-bundle.pem", "proxy.sock"], r
    if ROOT:  # on the host: the gateway's, group the kernel's own gid, no one else's
        st = d.stat()
        assert st.st_uid == 0 and st.st_gid >= 200_000 and st.st_mode & 0o777 == 0o750, oct(st.st_mode)


def test_another_sessions_egress_is_unreachable(server, api, session_factory, probe):
    a, b = session_factory(), session_factory()
    dir_a, dir_b = _egress_dir(server, api, a), _egress_dir(server, api, b)
    with UnixProxy(dir_a / "proxy.sock", b"A") as pa, UnixProxy(dir_b / "proxy.sock", b"B") as pb:
        r = probe(a, FETCH + f"""
import socket
for key, path in {{"b_host": {str(dir_b / 'proxy.sock')!r}, "b_dir": {str(dir_b)!r}}}.items():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        out[key] = "connected"
    except OSError as e:
        out[key] = _err(e)
    s.close()
out["run_dir"] = _os.path.exists({str(dir_b.parent)!r} + '/' + {dir_b.name!r})
print(_json.dumps(out))
""")
        assert r["get"] == [200, "A"], r  # A's own proxy, never B's
        assert r["b_host"] == "ENOENT" and r["b_dir"] == "ENOENT" and r["run_dir"] is False, r
        assert pb.requests == [] and pa.requests, (pa.requests, pb.requests)
        if ROOT:
            # On the host too, A's uid cannot use B's socket (belt and braces: it is not mounted).
            assert _connect_as(dir_a.stat().st_gid, dir_b / "proxy.sock") == "EACCES"
            assert pb.requests == []


@pytest.mark.skipif(not ROOT, reason="kernels have host uids of their own only when root")
def test_killing_the_bridge_breaks_only_its_own_egress(server, api, session_factory, probe):
    a, b = session_factory(), session_factory()
    dir_a, dir_b = _egress_dir(server, api, a), _egress_dir(server, api, b)
    uid_a = dir_a.stat().st_gid
    with UnixProxy(dir_a / "proxy.sock", b"A"), UnixProxy(dir_b / "proxy.sock", b"B"):
        assert probe(a, FETCH)["get"] == [200, "A"]
        assert len(_bridges_of(uid_a)) == 1
        r = probe(a, """
            import signal
            mine = [int(p) for p in _os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/cmdline', 'rb')
                    .read().split(b'\\0')[1:4] == [b'-I', b'-S', b'/run/kernelmode/egress-bridge.py']]
            for pid in mine:
                _os.kill(pid, signal.SIGKILL)
            print(_json.dumps({"killed": len(mine)}))
        """)
        assert r["killed"] == 1, r
        r = probe(a, FETCH)
        assert r["get"][0] == "error" and "Connection refused" in r["get"][1], r
        assert probe(b, FETCH)["get"] == [200, "B"]  # B's way out is its own
        # A restart brings A's bridge back (the egress dir and its socket stay with the kernel).
        assert api.post(f"/v1/sessions/{a}/restart").status_code == 200
        assert probe(a, FETCH)["get"] == [200, "A"]
        assert len(_bridges_of(uid_a)) == 1
        # The bridge dies with its kernel, and the egress dir goes with it.
        assert api.delete(f"/v1/sessions/{a}").status_code == 204
        wait_for(lambda: not _bridges_of(uid_a) and not dir_a.exists(), "A's bridge and egress dir to go", 30)
