"""Files through the kernel's channels when `serve` drives a gateway it did not start
(gateway.url): the same code path as the embedded gateway, uploads, listings, downloads,
deletes, harvests and a transfer while a cell runs (issue 19)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, start_server
from tests.support.external_gateway import start_external_gateway
from tests.support.procfs import unmount_under


@pytest.fixture(scope="module")
def ext_server() -> Iterator[Server]:
    data_dir = Path(tempfile.mkdtemp(prefix="kmfext-", dir="/tmp"))
    data_dir.chmod(0o711)
    gw = start_external_gateway(data_dir)
    srv = start_server(gw.env(), data_dir=data_dir)
    try:
        yield srv
    finally:
        srv.stop()
        gw.stop()
        unmount_under(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
        for p in (data_dir.with_suffix(".log"), gw.log_path):
            p.unlink(missing_ok=True)


def test_files_on_an_external_gateway(ext_server: Server) -> None:
    with ext_server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["session_id"]
        try:
            data = bytes(range(256)) * 20_000  # 5 MB: several chunks each way
            assert api.put(f"/v1/sessions/{sid}/files/in/data.bin", content=data).status_code == 201
            assert api.get(f"/v1/sessions/{sid}/files/in/data.bin").content == data
            r = api.post(f"/v1/sessions/{sid}/execute", json={
                "code": "open('out.txt', 'w').write(str(len(open('in/data.bin', 'rb').read())))"}).json()
            assert r["status"] == "ok" and [a["path"] for a in r["artifacts"]] == ["/mnt/data/out.txt"]
            names = sorted(f["path"] for f in api.get(f"/v1/sessions/{sid}/files").json()["files"])
            assert names == ["/mnt/data/in/data.bin", "/mnt/data/out.txt"]
            assert api.delete(f"/v1/sessions/{sid}/files/out.txt").json()["deleted"] is True
            # A transfer while a cell runs (the file subshell, through the external gateway too).
            run = api.post(f"/v1/sessions/{sid}/execute", json={
                "code": "import time\nfor _ in range(600): time.sleep(0.1)", "wait_seconds": 0}).json()
            try:
                assert api.put(f"/v1/sessions/{sid}/files/during.txt", content=b"d").status_code == 201
                assert api.get(f"/v1/runs/{run['run_id']}").json()["status"] == "running"
            finally:
                api.post(f"/v1/sessions/{sid}/interrupt")
        finally:
            api.delete(f"/v1/sessions/{sid}")
