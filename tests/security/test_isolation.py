"""Two sessions share nothing: not variables, files, /tmp, /dev/shm, processes nor kernel dirs."""

from __future__ import annotations

import json

import pytest

from .conftest import host_file_in_workspace, host_kernel_procs


@pytest.fixture()
def two_sessions(session_factory):
    return session_factory(), session_factory()


def test_sessions_are_isolated(server, two_sessions, run, probe):
    a, b = two_sessions
    # A plants state everywhere it can write, and starts a long-lived process.
    ra = probe(a, """
        import subprocess
        secret_a = 'SECRET-OF-A'
        for p in ('/mnt/data/a.txt', '/tmp/a.txt', '/dev/shm/a.txt'):
            with open(p, 'w') as f:
                f.write('A')
        sleeper = subprocess.Popen(['sleep', '60'])
        kdir = _kernel_dir()
        print(_json.dumps({"kdir": kdir, "sockets": sorted(_os.listdir(kdir)),
                           "sleeper": sleeper.pid}))
    """)
    assert ra["sockets"], ra
    a_ws = str(host_file_in_workspace(server, "a.txt").parent)
    host_a = {pid: p for pid, p in host_kernel_procs(server).items() if ra["kdir"] in p["cmdline"]}
    assert host_a, "A's kernel is not visible from the host"

    rb = probe(b, f"""
        import glob, socket
        A_KDIR = {ra['kdir']!r}
        A_WS = {a_ws!r}
        out = {{"var": 'secret_a' in globals()}}
        for p in ('/mnt/data/a.txt', '/tmp/a.txt', '/dev/shm/a.txt', A_KDIR, A_WS,
                  A_KDIR + '/kernel.json'):
            out[p] = _os.path.exists(p)
        out["run_glob"] = sorted(glob.glob(_os.path.dirname(_kernel_dir()) + '/*'))
        out["own_kdir"] = _kernel_dir()
        out["ws_glob"] = glob.glob({str(server.data_dir / 'workspaces')!r} + '/*')
        procs = []
        for d in glob.glob('/proc/[0-9]*'):
            try:
                procs.append(open(d + '/cmdline', 'rb').read().replace(b'\\0', b' ').decode())
            except OSError:
                pass
        out["procs"] = procs
        try:
            _os.kill({ra['sleeper']}, 0)
            out["kill_sleeper"] = "alive-and-signalable"
        except OSError as e:
            out["kill_sleeper"] = _err(e)
        conns = {{}}
        for name in {json.dumps(ra['sockets'])}:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(A_KDIR + '/' + name)
                conns[name] = "connected"
            except OSError as e:
                conns[name] = _err(e)
            s.close()
        out["conns"] = conns
        print(_json.dumps(out))
    """)
    assert rb["var"] is False
    for p in ("/mnt/data/a.txt", "/tmp/a.txt", "/dev/shm/a.txt", ra["kdir"], ra["kdir"] + "/kernel.json",
              a_ws):
        assert rb[p] is False, p
    assert rb["run_glob"] == [rb["own_kdir"]]
    assert rb["ws_glob"] == []
    assert not any("sleep" in cmd for cmd in rb["procs"]), rb["procs"]
    assert not any(ra["kdir"] in cmd for cmd in rb["procs"]), rb["procs"]
    # The pid may well exist in B's own namespace; it must not be A's sleeper.
    assert rb["kill_sleeper"] in ("ESRCH", "EPERM") or not any("sleep" in c for c in rb["procs"])
    assert set(rb["conns"].values()) <= {"ENOENT"}, rb["conns"]

    # The two kernels run as different host uids.
    host_b = {pid: p for pid, p in host_kernel_procs(server).items() if rb["own_kdir"] in p["cmdline"]}
    assert host_b
    uids_a = {p["uids"][0] for p in host_a.values()}
    uids_b = {p["uids"][0] for p in host_b.values()}
    assert len(uids_a) == 1 and len(uids_b) == 1 and uids_a != uids_b, (uids_a, uids_b)

    # A is intact: its variable, files and process are still there.
    res = run(a, "import os; print(secret_a, open('/tmp/a.txt').read(), sleeper.poll())")
    assert res["stdout"].split() == ["SECRET-OF-A", "A", "None"], res
    run(a, "sleeper.kill()")


def test_new_session_with_reused_id_gets_fresh_workspace(session_factory, run, api):
    sid = session_factory(session_id="km-sec-reuse")
    assert run(sid, "open('/mnt/data/left.txt', 'w').write('x')")["status"] == "ok"
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    sid2 = session_factory(session_id="km-sec-reuse")
    res = run(sid2, "import os; print(os.listdir('/mnt/data'))")
    assert res["stdout"].strip() == "[]", res
