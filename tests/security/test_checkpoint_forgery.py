"""Attacks on checkpoints by the kernel itself: sparse files and a file agent that lies about sizes
(the store must never take more than the session's disk limit), a forged answer to the snapshot
request (a clear 502, nothing stored), and a session deleted while its checkpoint is written (no
orphaned objects).

Kernel code replaces its own file agent (the comm target ``kernelmode.files``) or the snapshot
module (``sys.modules['kernelmode_snapshot']``): both are in its reach, so the manager must
check everything they answer. One server (the tenants' one), real sandboxed kernels.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from kernelmode.protocol import SNAPSHOT_MIME as MIME
from tests.conftest import Server, wait_for

MB = 1 << 20
DISK_MB = 16
FRAMING = 64 * 1024  # the tar's own headers and padding, made by the manager


def _run(c: httpx.Client, sid: str, code: str) -> dict:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 60})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    return r.json()


def _session(c: httpx.Client) -> str:
    r = c.post("/v1/sessions", json={"limits": {"disk_mb": DISK_MB}})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def _store(server: Server) -> Path:
    return server.data_dir / "artifacts" / ".checkpoints"


def _folders(server: Server) -> set[str]:
    where = _store(server)
    return {p.name for p in where.iterdir()} if where.is_dir() else set()


def _stored_bytes(server: Server, checkpoint_id: str) -> int:
    return sum(p.stat().st_size for p in (_store(server) / checkpoint_id).iterdir())


def _replace_agent(body: str) -> str:
    """Kernel code that puts ``fake(comm, msg, data, orig)`` in front of the file agent."""
    return ("import hashlib, json, time\n"
            "cm = get_ipython().kernel.comm_manager\n"
            "orig = cm.targets['kernelmode.files']\n"
            "orig = getattr(orig, 'inner', orig)\n"
            + body +
            "def target(comm, msg):\n"
            "    data = msg['content']['data']\n"
            "    if not fake(comm, msg, data):\n"
            "        orig(comm, msg)\n"
            "target.inner = orig\n"
            "cm.register_target('kernelmode.files', target)\n")


def test_sparse_files_cannot_make_a_checkpoint_larger_than_the_disk_limit(
        tenant_server: Server, alpha: httpx.Client) -> None:
    sid = _session(alpha)
    try:
        # Eight files of 15 MB each that take no disk: 120 MB stored before the bound.
        _run(alpha, sid, "for i in range(8):\n"
                         "    with open(f'/mnt/data/sparse{i}.bin', 'wb') as f:\n"
                         f"        f.truncate(15 * {MB})\nv = 1")
        r = alpha.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 200, r.text
        ck = r.json()
        assert ck["workspace_files"] == 1 and len(ck["skipped_files"]) == 7
        assert all("disk_mb" in s["reason"] for s in ck["skipped_files"])
        tar = _store(tenant_server) / ck["checkpoint_id"] / "workspace.tar"
        assert tar.stat().st_size <= DISK_MB * MB + FRAMING
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


LYING_AGENT = """
def fake(comm, msg, data):
    if data.get('op') == 'list':  # twelve files of one byte, it says
        body = {'files': [[f'lie{i}', 1, 0, 1000 + i, 0] for i in range(12)], 'stopped': None, 'full': False}
        comm.send({'count': 12}, buffers=[json.dumps(body).encode()])
        return True
    if data.get('op') == 'read' and bytes.fromhex(data['path']).startswith(b'lie'):
        size, chunk, st = 8 << 20, b'\\0' * (2 << 20), {'sent': 0, 'h': hashlib.sha256()}
        def step(first=False):  # 8 MB each, announced when read, checksum right
            part = chunk[:min(len(chunk), size - st['sent'])]
            st['sent'] += len(part)
            st['h'].update(part)
            reply = {'eof': st['sent'] >= size}
            if first:
                reply['size'] = size
            if reply['eof']:
                reply['sha256'] = st['h'].hexdigest()
            comm.send(reply, buffers=[part])
        comm.on_msg(lambda m: step())
        step(True)
        return True
    return False
"""


def test_a_lying_file_agent_cannot_make_a_checkpoint_larger_than_the_disk_limit(
        tenant_server: Server, alpha: httpx.Client) -> None:
    sid = _session(alpha)
    try:
        _run(alpha, sid, _replace_agent(LYING_AGENT))  # 96 MB stored before the bound
        r = alpha.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 200, r.text
        ck = r.json()
        assert ck["workspace_files"] == 2 and len(ck["skipped_files"]) == 10, ck
        namespace = (_store(tenant_server) / ck["checkpoint_id"] / "namespace.kmck").stat().st_size
        assert _stored_bytes(tenant_server, ck["checkpoint_id"]) <= DISK_MB * MB + FRAMING + namespace
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


FORGERIES = [
    {"saved": ["v"], "skipped": [1, 2], "seconds": 0.1},
    {"saved": ["v"], "skipped": [{"name": "v"}], "seconds": 0.1},
    {"saved": ["v"], "skipped": [{"name": "v", "reason": "x", "extra": [1]}], "seconds": 0.1},
    {"saved": ["v"], "skipped": [], "seconds": "soon"},
    {"saved": "v", "skipped": [], "seconds": 0.1},
    {"saved": [["v"]], "seconds": 0.1},
    {"error": {"code": 1}},
    {"unchanged": "yes"},
]

FORGE = """
import json, os, sys, types
from IPython.display import publish_display_data
def main(ip, request_json):
    req = json.loads(request_json)
    os.makedirs(os.path.dirname(req['path']), exist_ok=True)
    with open(req['path'], 'wb') as f:
        f.write(b'not a snapshot')
    publish_display_data({MIME: json.loads(FORGED)})
mod = types.ModuleType('kernelmode_snapshot')
mod.main = main
sys.modules['kernelmode_snapshot'] = mod
"""


def test_a_forged_snapshot_answer_is_refused_and_nothing_is_stored(
        tenant_server: Server, alpha: httpx.Client) -> None:
    sid = _session(alpha)
    try:
        _run(alpha, sid, "open('/mnt/data/kept.txt', 'w').write('files too')\nv = 1")
        before = _folders(tenant_server)
        for forged in FORGERIES:
            _run(alpha, sid, f"MIME, FORGED = {MIME!r}, {json.dumps(forged)!r}\n{FORGE}")
            r = alpha.post(f"/v1/sessions/{sid}/checkpoint")
            assert r.status_code == 502, (forged, r.text)
            error = r.json()["error"]
            assert error["code"] == "checkpoint_answer_refused" and "malformed" in error["message"], error
        assert alpha.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"] == []
        assert _folders(tenant_server) == before
        assert _run(alpha, sid, "v")["result"] == "1"  # the session goes on
        _run(alpha, sid, "import sys\nsys.modules.pop('kernelmode_snapshot', None)")  # as the error says
        assert alpha.post(f"/v1/sessions/{sid}/checkpoint").status_code == 200
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


SILENT_AGENT = """
def fake(comm, msg, data):  # never answers the read of slow.bin: the checkpoint waits on it
    return data.get('op') == 'read' and bytes.fromhex(data['path']) == b'slow.bin'
"""


def test_deleting_a_session_while_its_checkpoint_is_written_leaves_nothing_stored(
        tenant_server: Server, alpha: httpx.Client) -> None:
    sid = _session(alpha)
    deleted = False
    try:
        # The file first (its run's harvest reads it), then the agent that never answers for it
        _run(alpha, sid, "open('/mnt/data/slow.bin', 'wb').write(b'x' * 1000)\nv = list(range(1000))")
        _run(alpha, sid, _replace_agent(SILENT_AGENT))
        before = _folders(tenant_server)
        answer: dict[str, httpx.Response] = {}
        taker = threading.Thread(target=lambda: answer.update(r=alpha.post(f"/v1/sessions/{sid}/checkpoint")))
        taker.start()

        def namespace_stored() -> bool:  # the checkpoint is half written: now it waits on slow.bin
            return any((_store(tenant_server) / f / "namespace.kmck").exists() for f in _folders(tenant_server) - before)

        wait_for(namespace_stored, "the checkpoint's namespace object in the store", timeout=60)
        assert alpha.delete(f"/v1/sessions/{sid}").status_code == 204
        deleted = True
        taker.join(120)
        assert not taker.is_alive()
        assert answer["r"].status_code in (409, 503), answer["r"].text
        assert _folders(tenant_server) == before, "an orphaned checkpoint folder in the store"
    finally:
        if not deleted:
            alpha.delete(f"/v1/sessions/{sid}")

