"""Workspace files through the kernel's own channels (artifacts/channel.py <-> kernel/file_agent.py):
delete, a 100 MB round trip in bounded manager memory, names that are not UTF-8, and the
client's delete_file. Real server, real kernels."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from jupyter_client.session import Session
from websockets.sync.client import connect

from kernelmode.client import Client
from kernelmode.errors import KernelmodeError
from kernelmode.gateway.client import WS_PROTOCOL
from kernelmode.protocol import NOTE_KEY
from kernelmode.protocol.frames import Bounds, decode_frame, encode_frame

MB = 1_000_000


def _peak_kb(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_delete_a_file(api, session_factory, run):
    sid = session_factory()
    assert api.put(f"/v1/sessions/{sid}/files/d/a.txt", content=b"a").status_code == 201
    r = api.delete(f"/v1/sessions/{sid}/files/d/a.txt")
    assert r.status_code == 200 and r.json() == {"path": "/mnt/data/d/a.txt", "deleted": True}
    assert api.get(f"/v1/sessions/{sid}/files/d/a.txt").json()["error"]["code"] == "file_not_found"
    again = api.delete(f"/v1/sessions/{sid}/files/d/a.txt")
    assert again.status_code == 404 and again.json()["error"]["code"] == "file_not_found"
    folder = api.delete(f"/v1/sessions/{sid}/files/d")
    assert folder.status_code == 422, folder.text  # a folder is not deleted as a file
    bad = api.delete(f"/v1/sessions/{sid}/files/../etc/passwd")
    assert bad.status_code in (404, 422)
    assert run(sid, "import os; os.listdir('/mnt/data/d')")["result"] == "[]"


def test_client_delete_file_and_names_that_are_not_utf8(server, session_factory, run):
    sid = session_factory()
    assert run(sid, "open(b'/mnt/data/\\xff-bad.txt', 'wb').write(b'x')")["status"] == "ok"
    with Client(server.url, token=server.token) as c:
        s = c.session(sid)
        names = [f.path for f in s.files()]
        assert "/mnt/data/\\xff-bad.txt" in names
        s.upload("keep.txt", b"k")
        assert s.delete_file("keep.txt").deleted
        with pytest.raises(KernelmodeError) as e:
            s.delete_file("keep.txt")
        assert e.value.code == "file_not_found" and e.value.http_status == 404
        assert "/mnt/data/keep.txt" not in [f.path for f in s.files()]


def test_100_mb_round_trip_costs_bounded_manager_memory(server, api, session_factory, run):
    sid = session_factory()
    size = 100 * MB
    block = hashlib.sha256(b"seed").digest() * (MB // 32)  # 1 MB, not compressible by accident

    def body() -> Iterator[bytes]:
        for _ in range(size // MB):
            yield block

    want = hashlib.sha256()
    for chunk in body():
        want.update(chunk)
    before = _peak_kb(server.proc.pid)
    r = api.put(f"/v1/sessions/{sid}/files/big.bin", content=body(), headers={"Content-Length": str(size)})
    assert r.status_code == 201, r.text
    check = run(sid, "import hashlib; hashlib.sha256(open('big.bin','rb').read()).hexdigest()")
    assert check["result"].strip("'") == want.hexdigest()
    got = hashlib.sha256()
    received = 0
    with api.stream("GET", f"/v1/sessions/{sid}/files/big.bin") as resp:
        assert resp.status_code == 200 and int(resp.headers["content-length"]) == size
        for chunk in resp.iter_bytes():
            received += len(chunk)
            got.update(chunk)
    assert received == size and got.hexdigest() == want.hexdigest()
    grew_mb = (_peak_kb(server.proc.pid) - before) / 1000
    assert grew_mb < 40, f"the manager's peak memory grew by {grew_mb:.0f} MB for a 100 MB round trip"


def test_files_work_while_a_cell_runs(api, session_factory):
    """File requests travel on the kernel's file subshell: they do not wait for a running cell."""
    sid = session_factory()
    r = api.post(f"/v1/sessions/{sid}/execute", json={
        "code": "import time\nfor _ in range(600): time.sleep(0.1)", "wait_seconds": 0})
    assert r.status_code in (200, 202), r.text
    run_id = r.json()["run_id"]
    try:
        assert api.put(f"/v1/sessions/{sid}/files/during.txt", content=b"d").status_code == 201
        assert api.get(f"/v1/sessions/{sid}/files/during.txt").content == b"d"
        names = [f["name"] for f in api.get(f"/v1/sessions/{sid}/files").json()["files"]]
        assert "during.txt" in names
        assert api.get(f"/v1/runs/{run_id}").json()["status"] == "running"  # still going meanwhile
    finally:
        api.post(f"/v1/sessions/{sid}/interrupt")


SPY = """
import sys
_agent = sys.modules['kernelmode_files']
_ops = []
def _spy(comm, msg):
    _ops.append(msg['content']['data'].get('op'))
    _agent.on_open(comm, msg)
get_ipython().kernel.comm_manager.register_target('kernelmode.files', _spy)
"""


def test_a_harvest_asks_the_kernel_nothing_when_nothing_changed(session_factory, run):
    """The post-run note names the changed files: the manager reads just those, and sends no
    request at all after a run that changed nothing."""
    sid = session_factory()
    assert run(sid, SPY)["status"] == "ok"
    r = run(sid, "open('made.txt', 'w').write('m')")
    assert [a["path"] for a in r["artifacts"]] == ["/mnt/data/made.txt"]
    assert run(sid, "1 + 1")["artifacts"] == []
    assert run(sid, "_ops")["result"] == "['read']"  # one read for made.txt; no listing, no 'changes'


def _cell_messages(server, sid: str, code: str) -> list[dict]:  # noqa: ANN001
    """Every message that answers one execute_request sent over the session's channels (what
    the gateway forwards for it, through the manager), up to its reply and its idle status."""
    with connect(f"ws{server.url[4:]}/v1/sessions/{sid}/channels", subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                 additional_headers={"Authorization": f"Bearer {server.token}"}, open_timeout=120) as ws:
        msg = Session(key=b"", username="person").msg("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False})
        ws.send(encode_frame(msg, "shell"))
        got: list[dict] = []
        deadline = time.monotonic() + 120
        while not ({"execute_reply", "status:idle"} <= {_kind(m) for m in got}):
            m = decode_frame(ws.recv(timeout=max(deadline - time.monotonic(), 0.1)), Bounds(64 << 20))
            if m["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                got.append(m)
        return got


def _kind(m: dict) -> str:
    return f"status:{m['content'].get('execution_state')}" if m["msg_type"] == "status" else str(m["msg_type"])


def test_a_run_brings_no_message_more_than_a_bare_kernels(session_factory, run, server):
    """The post-run change note rides in the execute_reply: a `1+1` cell is answered by the five
    messages of a bare ipykernel (busy, execute_input, execute_result, idle, reply), and an
    attached frontend sees no unknown comm after each cell."""
    sid = session_factory()
    assert run(sid, "x = 1")["status"] == "ok"  # the preamble and the file agent are in
    msgs = _cell_messages(server, sid, "1+1")
    assert Counter(_kind(m) for m in msgs) == Counter(
        ["status:busy", "execute_input", "execute_result", "status:idle", "execute_reply"]), msgs
    reply = next(m for m in msgs if m["msg_type"] == "execute_reply")
    assert json.loads(reply["metadata"][NOTE_KEY]) == {"files": [], "truncated": False, "stopped": None}
    # A console's cell takes the note of what it wrote (as before: the agent's harvest is of its runs).
    made = _cell_messages(server, sid, "open('by_console.txt', 'w').write('c')")
    assert [m for m in made if m["msg_type"] == "comm_msg"] == []
    note = json.loads(next(m for m in made if m["msg_type"] == "execute_reply")["metadata"][NOTE_KEY])
    assert [f[0] for f in note["files"]] == ["by_console.txt"]
    r = run(sid, "open('by_agent.txt', 'w').write('a')")
    assert [a["path"] for a in r["artifacts"]] == ["/mnt/data/by_agent.txt"]
    # No pause before the reply (the preamble turns ipykernel's off), and no output is lost: a
    # run ends on its idle status, after every output.
    r = run(sid, "for i in range(200): print(i)\nget_ipython().kernel._execute_sleep")
    assert r["result"] == "0.0" and r["stdout"] == "".join(f"{i}\n" for i in range(200))


def test_files_after_the_kernel_died(api, session_factory, run):
    """A kernel that died is readied again (file agent included) by the next file request."""
    sid = session_factory()
    assert api.put(f"/v1/sessions/{sid}/files/kept.txt", content=b"k").status_code == 201
    died = run(sid, "import os; os._exit(1)")
    assert died["status"] == "kernel_died", died
    assert api.get(f"/v1/sessions/{sid}/files/kept.txt").content == b"k"
    assert api.put(f"/v1/sessions/{sid}/files/new.txt", content=b"n").status_code == 201
    r = run(sid, "open('made.txt', 'w').write('m')")
    assert [a["path"] for a in r["artifacts"]] == ["/mnt/data/made.txt"]  # uploads are not artifacts
