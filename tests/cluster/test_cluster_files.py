"""Files, harvesting, checkpoints and forks on kernels that Enterprise Gateway runs on the rig's
nodes: everything goes through the kernel's own channels (the file agent), so none of it needs
the manager's disk (issue 19)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

from tests.cluster.conftest import SERVE_CONFIG
from tests.cluster.test_cluster import run
from tests.conftest import start_server


def test_files_and_harvest_on_a_node(served):
    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "cf"}).status_code == 201
        try:
            data = bytes(range(256)) * 20_000  # 5 MB: several chunks each way, through EG's websocket
            assert c.put("/v1/sessions/cf/files/in/data.bin", content=data, timeout=180).status_code == 201
            got = c.get("/v1/sessions/cf/files/in/data.bin", timeout=180).content
            assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()
            r = run(c, "cf", "open('out.txt', 'w').write(str(len(open('in/data.bin', 'rb').read())))")
            assert r["status"] == "ok" and [a["path"] for a in r["artifacts"]] == ["/mnt/data/out.txt"], r
            assert c.get("/v1/sessions/cf/files/out.txt").content == str(len(data)).encode()
            names = sorted(f["path"] for f in c.get("/v1/sessions/cf/files").json()["files"])
            assert names == ["/mnt/data/in/data.bin", "/mnt/data/out.txt"], names
            assert c.delete("/v1/sessions/cf/files/out.txt").json()["deleted"] is True
            assert run(c, "cf", "import os\nos.path.exists('out.txt')")["result"] == "False"
        finally:
            c.delete("/v1/sessions/cf")


def test_checkpoint_restore_after_death_and_fork_on_nodes(served):
    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "cp"}).status_code == 201
        try:
            run(c, "cp", "kept = 41\nopen('note.txt', 'w').write('saved')")
            r = c.post("/v1/sessions/cp/checkpoint", json={}, timeout=300)
            assert r.status_code in (200, 201), r.text
            fork = c.post("/v1/sessions", json={"session_id": "cp-fork", "fork_of": "cp"}, timeout=300)
            assert fork.status_code == 201, fork.text
            r = run(c, "cp-fork", "kept + 1, open('note.txt').read()")
            assert r["status"] == "ok" and r["result"] == "(42, 'saved')", r
            # The file goes with the kernel, as it does when a kernel comes back on another node
            # (an empty workspace there): the checkpoint's files come back with its variables.
            r = run(c, "cp", "import os\nos.remove('note.txt')\nos._exit(3)", timeout_seconds=60)
            assert r["status"] == "kernel_died", r
            r = run(c, "cp", "kept, open('note.txt').read()")
            assert r["status"] == "ok" and r["result"] == "(41, 'saved')", r
        finally:
            c.delete("/v1/sessions/cp-fork")
            c.delete("/v1/sessions/cp")


def test_100_mb_round_trip_to_a_node_costs_bounded_manager_memory(served):
    from tests.integration.test_files_channel import MB, _peak_kb

    size = 100 * MB
    block = hashlib.sha256(b"node").digest() * (MB // 32)  # 1 MB, not compressible by accident
    want = hashlib.sha256(block * (size // MB)).hexdigest()
    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "big"}).status_code == 201
        try:
            before = _peak_kb(served.proc.pid)
            r = c.put("/v1/sessions/big/files/big.bin", content=(block for _ in range(size // MB)),
                      headers={"Content-Length": str(size)}, timeout=600)
            assert r.status_code == 201, r.text
            check = run(c, "big", "import hashlib; hashlib.sha256(open('big.bin','rb').read()).hexdigest()")
            assert check["result"].strip("'") == want, check
            got, received = hashlib.sha256(), 0
            with c.stream("GET", "/v1/sessions/big/files/big.bin", timeout=600) as resp:
                assert resp.status_code == 200 and int(resp.headers["content-length"]) == size
                for chunk in resp.iter_bytes():
                    received += len(chunk)
                    got.update(chunk)
            assert received == size and got.hexdigest() == want
            grew_mb = (_peak_kb(served.proc.pid) - before) / 1000
            assert grew_mb < 40, f"the manager's peak memory grew by {grew_mb:.0f} MB for 100 MB through EG"
        finally:
            c.delete("/v1/sessions/big")


def test_a_remote_session_hibernates_and_wakes_with_its_variables_and_files(eg):
    """Hibernation with the workspace on a node: the checkpoint carries the files, and the
    woken session's new kernel (on either node) gets both back, before a run as before a listing."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmcluster-hib-", dir="/tmp"))
    cfg = data_dir.with_suffix(".yaml")
    cfg.write_text(SERVE_CONFIG)
    srv = start_server({**eg.env(), "KERNELMODE_SESSIONS__POOL_SIZE": "0",
                        "KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "2"},
                       data_dir=data_dir, args=["--config", str(cfg)])
    try:
        with srv.client() as c:
            assert c.post("/v1/sessions", json={"session_id": "hib"}, timeout=180).status_code == 201
            assert run(c, "hib", "v = 7\nopen('h.txt', 'w').write('zz')")["status"] == "ok"
            deadline = time.monotonic() + 120
            while c.get("/v1/sessions/hib").json()["status"] != "hibernated":
                assert time.monotonic() < deadline, c.get("/v1/sessions/hib").text
                time.sleep(0.5)
            files = c.get("/v1/sessions/hib/files", timeout=180).json()["files"]  # wakes it
            assert [f["path"] for f in files] == ["/mnt/data/h.txt"], files
            r = run(c, "hib", "v, open('h.txt').read()")
            assert r["status"] == "ok" and r["result"] == "(7, 'zz')", r
            assert c.delete("/v1/sessions/hib").status_code in (200, 204)
    finally:
        srv.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        cfg.unlink(missing_ok=True)
        data_dir.with_suffix(".log").unlink(missing_ok=True)
