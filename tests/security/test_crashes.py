"""A kernel that kills itself is reported with its cause, and the session carries on (state lost)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .conftest import host_file_in_workspace, run_after_restart

CRASHES = {
    "exit3": ("import os\nos._exit(3)", {"kind": "exit", "exit_code": 3}),
    "segfault": ("import ctypes\nctypes.string_at(0)", {"kind": "signal", "signal": 11}),
    "sigkill": ("import os\nos.kill(os.getpid(), 9)", {"kind": "signal", "signal": 9}),
}


def _assert_cause(res: dict, expected: dict) -> None:
    assert res["status"] == "kernel_died", res
    assert res["state_lost"] is True, res
    cause = res["cause"] or {}
    for k, v in expected.items():
        assert cause.get(k) == v, (k, cause)


@pytest.mark.parametrize("name", list(CRASHES))
def test_crash_reported_and_session_recovers(session_factory, run, api, name):
    code, expected = CRASHES[name]
    sid = session_factory()
    assert run(sid, "x = 1")["status"] == "ok"
    res = run(sid, code, timeout_seconds=30)
    _assert_cause(res, expected)
    after, retried = run_after_restart(api, sid, "print('x' in globals())")
    assert after["status"] == "ok", after
    assert after["stdout"] == "False\n"  # variables are gone...
    assert after["state_lost"] is True   # ...and the caller is told so
    again = run(sid, "print('fine')", timeout_seconds=15)
    assert again["status"] == "ok" and (retried or again["state_lost"] is False), again


def test_second_crash_in_same_session_still_has_cause(session_factory, run):
    sid = session_factory()
    _assert_cause(run(sid, CRASHES["exit3"][0], timeout_seconds=30), CRASHES["exit3"][1])
    _assert_cause(run(sid, CRASHES["sigkill"][0], timeout_seconds=30), CRASHES["sigkill"][1])


def _host_cmdlines_with(token: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmd:
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def _wait_gone(token: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _host_cmdlines_with(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


DAEMON = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'import os, time\\nif os.fork(): os._exit(0)\\n"
    "os.setsid()\\ntime.sleep(600)  # {token}'], start_new_session=True)\n"
)


def test_runaway_ignoring_sigint_is_stopped_and_daemons_die(session_factory, run, api):
    sid = session_factory()
    token = "KMDAEMON" + os.urandom(6).hex()
    started = time.monotonic()
    res = run(sid, DAEMON.format(token=token) + "import signal, time\n"
              "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(0.5)\nwhile True:\n    pass\n",
              timeout_seconds=5)  # the daemon's start and SIG_IGN come well before the interrupt
    assert res["status"] == "timeout", res
    assert res["state_lost"] is True  # interrupt did not work: the kernel was restarted
    # Bounded by timeout + interrupt grace + a kernel (re)start; should be ~6 s, but the race of
    # test_first_run_after_kernel_death_is_not_lost can add a kernel start timeout (or two).
    assert time.monotonic() - started < 60
    # A double-forked, setsid() daemon of the old kernel does not outlive it.
    assert _wait_gone(token) == []
    after, _ = run_after_restart(api, sid, "print('back')")
    assert after["status"] == "ok" and after["stdout"] == "back\n"


def test_daemons_die_with_deleted_session(session_factory, run, api):
    sid = session_factory()
    token = "KMDAEMON" + os.urandom(6).hex()
    assert run(sid, DAEMON.format(token=token) + "import time; time.sleep(0.5)")["status"] == "ok"
    assert _host_cmdlines_with(token), "the daemon did not start"
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert _wait_gone(token) == []


def test_cpu_time_limit_kills_busy_loop(session_factory, run, api):
    sid = session_factory(limits={"cpu_seconds": 3})
    res = run(sid, "while True:\n    pass", timeout_seconds=30)
    assert res["status"] == "kernel_died", res
    assert res["cause"]["kind"] == "signal" and res["cause"]["signal"] in (9, 24), res["cause"]
    after, _ = run_after_restart(api, sid, "print('ok')")
    assert after["status"] == "ok" and after["state_lost"] is True


def test_kill_all_only_hits_own_sandbox(server, session_factory, run, api):
    a, b = session_factory(), session_factory()
    assert run(b, "survivor = 'B'")["status"] == "ok"
    res = run(a, "import subprocess, sys\n"
                 "subprocess.run([sys.executable, '-c', 'import os, signal; os.kill(-1, signal.SIGKILL)'])\n"
                 "import time; time.sleep(5)", timeout_seconds=30)
    assert res["status"] == "kernel_died", res
    assert server.proc.poll() is None
    assert api.get("/readyz").status_code == 200
    res = run(b, "print(survivor)")
    assert res["status"] == "ok" and res["stdout"] == "B\n" and res["state_lost"] is False


def test_first_run_after_kernel_death_is_not_lost(session_factory, run, api):
    for i in range(3):
        sid = session_factory()
        assert run(sid, "1")["status"] == "ok"
        assert run(sid, "import os\nos._exit(3)", timeout_seconds=30)["status"] == "kernel_died"
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print('back')", "timeout_seconds": 5})
        assert r.status_code == 200, (i, r.text)
        res = r.json()
        assert res["status"] == "ok" and res["stdout"] == "back\n", (i, res)


def _kernel_pids_in(workspace: Path) -> list[int]:
    """Host pids of the ipykernel of this workspace: the one running as the workspace's owner
    (each kernel runs as a host uid of its own, which owns its workspace)."""
    uid = workspace.stat().st_uid
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and b"ipykernel_launcher" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_session_recovers_after_a_crash_loop(server, session_factory, run, api):
    sid = session_factory()
    assert run(sid, "open('/mnt/data/here', 'w').write('x')")["status"] == "ok"
    workspace = host_file_in_workspace(server, "here").parent
    # Kill every new kernel as soon as it appears, until the gateway gives up (restart_limit).
    deadline = time.monotonic() + 60
    while api.get(f"/v1/sessions/{sid}").json()["status"] != "dead":
        assert time.monotonic() < deadline, "the gateway did not give up on the crash loop"
        for pid in _kernel_pids_in(workspace):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.05)
    # The cause is gone: the session gets a fresh kernel on the same workspace.
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(open('here').read())",
                                                      "timeout_seconds": 15})
    assert r.status_code == 200, r.text
    assert r.json()["stdout"] == "x\n" and r.json()["state_lost"] is True


def test_workspace_files_cannot_take_over_the_kernel_start(session_factory, run, api):
    sid = session_factory()
    res = run(sid, "open('/mnt/data/ipykernel_launcher.py', 'w').write('import os\\nos._exit(3)\\n')\n"
                   "import os\nos._exit(3)", timeout_seconds=30)
    assert res["status"] == "kernel_died", res
    after, _ = run_after_restart(api, sid, "print('up')")
    assert after["status"] == "ok" and after["stdout"] == "up\n", after
