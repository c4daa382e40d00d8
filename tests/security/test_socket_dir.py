"""The kernel's ipc socket directory: the kernel binds its sockets there at start, then the
directory is taken back (root's, 0755). Kernel code can no longer rename, unlink or replace a
socket, or add an entry, so the gateway can never be pointed at another socket. Both backends."""

from __future__ import annotations

import os
import time

import pytest

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="kernels have uids of their own only when root")

ATTACK = """
import socket
kdir = _kernel_dir()
names = sorted(n for n in _os.listdir(kdir) if n.startswith('k-'))
out = {"sockets": names, "owner": _os.stat(kdir).st_uid == _os.getuid()}
def attempt(key, fn):
    try:
        fn()
        out[key] = "ok"
    except OSError as e:
        out[key] = _err(e)
first, second = kdir + '/' + names[0], kdir + '/' + names[1]
attempt("rename", lambda: _os.rename(first, first + '.moved'))
attempt("rename_over", lambda: _os.rename(first, second))
attempt("unlink", lambda: _os.unlink(second))
attempt("symlink_new", lambda: _os.symlink('/tmp/elsewhere', kdir + '/k-99'))
attempt("create_file", lambda: open(kdir + '/planted', 'w').close())
attempt("mkdir", lambda: _os.mkdir(kdir + '/d'))
attempt("connection_file_unlink", lambda: _os.unlink(kdir + '/kernel.json'))
attempt("chmod_dir", lambda: _os.chmod(kdir, 0o777))
def bind_new():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(kdir + '/k-98')
    finally:
        s.close()
attempt("bind_new_socket", bind_new)
out["after"] = sorted(_os.listdir(kdir))
print(_json.dumps(out))
"""

REFUSED = ("EACCES", "EPERM", "EROFS")


def _assert_sealed(r: dict) -> None:
    assert len(r["sockets"]) == 5 and r["owner"] is False, r
    attacks = {k: v for k, v in r.items() if k not in ("sockets", "owner", "after")}
    assert all(v in REFUSED for v in attacks.values()), attacks
    assert r["after"] == sorted([*r["sockets"], "kernel.json"]), r  # nothing moved or added


def test_kernel_cannot_touch_its_socket_directory(session_factory, probe):
    _assert_sealed(probe(session_factory(), ATTACK))


def test_still_sealed_and_working_after_restart_and_interrupt(session_factory, probe, run, api):
    sid = session_factory()
    assert run(sid, "x = 41")["status"] == "ok"
    # An interrupt (message mode: over the control socket) reaches the kernel as before.
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import time\nwhile True: time.sleep(0.1)",
                                                      "wait_seconds": 0, "timeout_seconds": 120})
    assert r.status_code == 202, r.text
    run_id = r.json()["run_id"]
    deadline = time.monotonic() + 60
    while api.get(f"/v1/runs/{run_id}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert api.post(f"/v1/sessions/{sid}/interrupt").status_code == 200
    deadline = time.monotonic() + 60
    while not (final := api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 10}).json())["done"]:
        assert time.monotonic() < deadline, final
    assert final["result"]["status"] == "interrupted", final
    assert run(sid, "x + 1")["result"] == "42"
    # A restart: the new kernel binds in the directory again, and it is sealed again.
    assert api.post(f"/v1/sessions/{sid}/restart").status_code == 200
    assert run(sid, "1 + 1", timeout_seconds=60)["result"] == "2"
    _assert_sealed(probe(sid, ATTACK))
