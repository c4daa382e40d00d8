"""Checkpoints, restore after a kernel's death, and forks: real kernels, killed for real."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kernelmode.client import Client
from tests.conftest import Server, start_server

STATE = """
import numpy as np
import pandas as pd
df = pd.DataFrame({"a": np.arange(1000), "b": np.arange(1000) * 2.0})
x = 41
def helper(n):
    return x + n
class Point:
    def __init__(self, a, b):
        self.a, self.b = a, b
p = Point(1, 2)
alias = df
"""

CHECK = "(helper(1), int(df.b.sum()), isinstance(p, Point), p.b, alias is df, np.__name__)"
CHECK_OK = "(42, 999000, True, 2, True, 'numpy')"


def _checkpoint(api: httpx.Client, sid: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/checkpoint")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kill", [
    "import os\nos._exit(3)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
], ids=["os_exit", "sigkill"])
def test_the_next_run_after_a_death_restores_the_checkpoint(session_factory, run, api, kill: str) -> None:
    sid = session_factory()
    assert run(sid, STATE)["status"] == "ok"
    ck = _checkpoint(api, sid)
    assert {"df", "x", "helper", "Point", "p", "alias", "np", "pd"} <= set(ck["saved"])
    assert ck["skipped"] == [] and ck["bytes"] > 0 and ck["duration_ms"] > 0 and ck["created_at"]
    listed = api.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == [ck["checkpoint_id"]]

    died = run(sid, kill, timeout_seconds=60)
    assert died["status"] == "kernel_died" and died["state_lost"] is True

    r = run(sid, CHECK, timeout_seconds=120)
    assert r["status"] == "ok", r
    assert r["result"] == CHECK_OK
    assert r["state_lost"] is False
    assert r["restored_from"]["checkpoint_id"] == ck["checkpoint_id"]
    assert r["restored_from"]["age_seconds"] >= 0
    assert "df" in r["restored_variables"] and r["lost_variables"] == []
    # Restored once: the run after that is an ordinary one.
    again = run(sid, "x")
    assert again["restored_from"] is None and again["state_lost"] is False and again["result"] == "41"


def test_a_memory_kill_restores_too(session_factory, run, api) -> None:
    sid = session_factory(limits={"memory_mb": 256})
    run(sid, "kept = list(range(1000))")
    _checkpoint(api, sid)
    r = run(sid, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))", timeout_seconds=60)
    if r["status"] != "kernel_died":  # rlimit fallback (no memory cgroup): a MemoryError, no death
        pytest.skip("this sandbox answers a memory overrun with MemoryError: the kernel lives on")
    assert r["cause"]["kind"] == "oom"
    after = run(sid, "sum(kept)", timeout_seconds=120)
    assert after["result"] == "499500" and after["state_lost"] is False and after["restored_from"]


def test_unpicklable_objects_are_listed_and_the_rest_comes_back(session_factory, run, api) -> None:
    sid = session_factory()
    run(sid, "import threading, socket\nfh = open('/mnt/data/log.txt', 'w')\n"
             "gen = (i for i in range(3))\nth = threading.Thread(target=print)\n"
             "sock = socket.socket(socket.AF_UNIX)\nkeep = {'a': 1}")
    ck = _checkpoint(api, sid)
    reasons = {s["name"]: s["reason"] for s in ck["skipped"]}
    assert set(reasons) == {"fh", "gen", "th", "sock"}
    assert "open file" in reasons["fh"] and "generator" in reasons["gen"]
    assert "thread" in reasons["th"] and "socket" in reasons["sock"]
    assert "keep" in ck["saved"]
    run(sid, "import os\nos._exit(1)", timeout_seconds=60)
    r = run(sid, "keep['a'], 'fh' in globals()", timeout_seconds=120)
    assert r["result"] == "(1, False)"
    assert r["state_lost"] is True  # part only
    assert set(r["lost_variables"]) == {"fh", "gen", "th", "sock"}
    assert "keep" in r["restored_variables"] and r["restored_from"]


def test_runs_after_the_checkpoint_make_the_restore_partial(session_factory, run, api) -> None:
    sid = session_factory()
    run(sid, "a = 1")
    _checkpoint(api, sid)
    run(sid, "b = 2")
    run(sid, "import os\nos._exit(1)", timeout_seconds=60)
    r = run(sid, "a, 'b' in globals()", timeout_seconds=120)
    assert r["result"] == "(1, False)"
    assert r["state_lost"] is True and r["restored_from"] is not None and r["lost_variables"] == []


def test_a_restart_asked_for_does_not_restore(session_factory, run, api) -> None:
    sid = session_factory()
    run(sid, "a = 1")
    _checkpoint(api, sid)
    assert api.post(f"/v1/sessions/{sid}/restart").status_code == 200
    r = run(sid, "'a' in globals()")
    assert r["result"] == "False" and r["restored_from"] is None


def test_without_a_checkpoint_a_death_still_says_state_lost(session_factory, run) -> None:
    sid = session_factory()
    run(sid, "a = 1")
    run(sid, "import os\nos._exit(1)", timeout_seconds=60)
    r = run(sid, "'a' in globals()", timeout_seconds=60)
    assert r["result"] == "False" and r["state_lost"] is True and r["restored_from"] is None


def test_fork_copies_state_and_files_and_the_two_diverge(session_factory, run, api) -> None:
    src = session_factory()
    run(src, "items = [1, 2]\nopen('/mnt/data/notes.txt', 'w').write('v1')")
    fork = session_factory(fork_of=src)
    assert run(fork, "items.append(3); items, open('/mnt/data/notes.txt').read()")["result"] == "([1, 2, 3], 'v1')"
    run(fork, "open('/mnt/data/notes.txt', 'w').write('fork')")
    assert run(src, "items, open('/mnt/data/notes.txt').read()")["result"] == "([1, 2], 'v1')"
    run(src, "items.append(99)")
    assert run(fork, "items")["result"] == "[1, 2, 3]"
    # The fork's listing has the copied file; the checkpoint folder is never shown.
    files = [f["path"] for f in api.get(f"/v1/sessions/{fork}/files").json()["files"]]
    assert files == ["/mnt/data/notes.txt"]


def test_fork_from_a_checkpoint_and_bad_requests(session_factory, run, api) -> None:
    src = session_factory()
    run(src, "v = 'first'")
    ck = _checkpoint(api, src)
    run(src, "v = 'second'")
    fork = session_factory(from_checkpoint=ck["checkpoint_id"])
    assert run(fork, "v")["result"] == "'first'"
    bad = api.post("/v1/sessions", json={"from_checkpoint": "0" * 32})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "checkpoint_not_found"
    both = api.post("/v1/sessions", json={"from_checkpoint": ck["checkpoint_id"], "fork_of": src})
    assert both.status_code == 422
    assert api.post("/v1/sessions", json={"from_checkpoint": "../x"}).status_code == 422
    assert api.post("/v1/sessions", json={"fork_of": "nobody-here"}).status_code == 404
    assert api.post("/v1/sessions/nobody-here/checkpoint").status_code == 404


def test_two_forks_into_one_session_id_at_once(server: Server, session_factory, run, api) -> None:
    """The fork's checkpoint is awaited: the id must be held across it, or both forks would be
    created, one kernel overwriting (and leaking) the other."""
    src = session_factory()
    run(src, "big = bytearray(30_000_000)")  # a checkpoint that takes a while
    sid = "fork-race-" + src[:8]

    def fork() -> httpx.Response:
        with server.client(timeout=300) as c:
            return c.post("/v1/sessions", json={"session_id": sid, "fork_of": src})

    try:
        with ThreadPoolExecutor(2) as pool:
            codes = sorted(r.status_code for r in pool.map(lambda _: fork(), range(2)))
        assert codes == [201, 409], codes
        assert [i["session_id"] for i in api.get("/v1/sessions").json()["sessions"]].count(sid) == 1
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_client_checkpoint_and_fork(server: Server, run: Callable[..., dict]) -> None:
    with Client(server.url, server.token) as km, km.create_session() as s:
        s.execute("n = 7")
        ck = s.checkpoint()
        assert "n" in ck.saved and s.checkpoints()[0].checkpoint_id == ck.checkpoint_id
        with km.fork(s.id) as f1, km.fork(checkpoint_id=ck.checkpoint_id) as f2:
            assert f1.execute("n + 1").result == "8"
            assert f2.execute("n * 2").result == "14"


@pytest.fixture(scope="module")
def auto_srv() -> Iterator[Server]:
    s = start_server({"KERNELMODE_SESSIONS__CHECKPOINT__AUTO": "true",
                      "KERNELMODE_SESSIONS__CHECKPOINT__MIN_INTERVAL_SECONDS": "0",
                      "KERNELMODE_SESSIONS__POOL_SIZE": "0"})
    yield s
    s.discard()


def _checkpoints_when(api: httpx.Client, sid: str, count: int) -> list[dict]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        listed = api.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"]
        if len(listed) >= count:
            return listed
        time.sleep(0.2)
    raise AssertionError(f"no automatic checkpoint: {listed}")


def test_automatic_checkpoints_run_after_the_answer_and_restore(auto_srv: Server) -> None:
    with auto_srv.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["session_id"]
        # Pickling `gate` waits for a file only the test writes once it has the run's answer:
        # if the answer waited for the checkpoint, this call would never return.
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": (
            "import os, time\nclass Gate:\n    def __reduce__(self):\n"
            "        while not os.path.exists('/mnt/data/go'):\n            time.sleep(0.05)\n"
            "        return (int, (7,))\ngate = Gate()\nvalue = 'auto'"), "timeout_seconds": 60})
        assert r.json()["status"] == "ok"
        assert api.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"] == []
        assert api.put(f"/v1/sessions/{sid}/files/go", content=b"").status_code == 201
        first = _checkpoints_when(api, sid, 1)[0]
        assert first["auto"] is True and {"gate", "value"} <= set(first["saved"])
        # A run that changes nothing (a read) makes no new checkpoint; one that does, does.
        api.post(f"/v1/sessions/{sid}/execute", json={"code": "value.upper()"})
        api.post(f"/v1/sessions/{sid}/execute", json={"code": "more = [1, 2]"})
        listed = _checkpoints_when(api, sid, 2)
        assert len(listed) == 2 and "more" in listed[0]["saved"]
        api.post(f"/v1/sessions/{sid}/execute", json={"code": "import os\nos._exit(1)", "timeout_seconds": 60})
        after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "value, more, gate"}).json()
        assert after["result"] == "('auto', [1, 2], 7)" and after["state_lost"] is False
        api.delete(f"/v1/sessions/{sid}")
