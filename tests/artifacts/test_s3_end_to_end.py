"""kernelmode serve with the S3 store (moto's S3 server on loopback, reached by the minio client)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest

from kernelmode.artifacts.base import CHECKPOINT_PREFIX
from kernelmode.artifacts.s3 import S3Store
from tests.conftest import Server, start_server, wait_for
from tests.security.test_checkpoint_forgery import SILENT_AGENT, _replace_agent

from .conftest import S3Server, _settings, free_port


def _s3_env(endpoint: str, bucket: str) -> dict[str, str]:
    return {
        "KERNELMODE_ARTIFACTS__STORE": "s3",
        "KERNELMODE_ARTIFACTS__ENDPOINT": endpoint,
        "KERNELMODE_ARTIFACTS__ACCESS_KEY": "testing",
        "KERNELMODE_ARTIFACTS__SECRET_KEY": "testing",
        "KERNELMODE_ARTIFACTS__BUCKET": bucket,
        "KERNELMODE_SESSIONS__POOL_SIZE": "0",
    }


@pytest.fixture(scope="module")
def s3_srv(s3_server: S3Server) -> Iterator[tuple[Server, str]]:
    """One `serve` on a bucket of its own for the tests of a working store (each test uses
    sessions of its own: sharing it proves as much and costs one start less)."""
    bucket = f"km-{uuid.uuid4().hex[:12]}"
    srv = start_server(_s3_env(s3_server.endpoint, bucket))
    yield srv, bucket
    srv.discard()


def test_runs_harvest_into_s3_with_presigned_links(s3_server: S3Server, s3_srv: tuple[Server, str]):
    srv, bucket = s3_srv
    with srv.client() as c:
        assert c.get("/readyz").json()["checks"]["artifacts"] == {"ok": True, "store": "s3", "error": None}
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": (
            "import matplotlib.pyplot as plt\nopen('report.txt', 'w').write('hello s3')\n"
            "plt.plot([1, 3, 2])\nplt.show()")}).json()
        assert r["status"] == "ok" and r["artifact_error"] is None, r
        arts = {a["path"]: a for a in r["artifacts"]}
        assert set(arts) == {"/mnt/data/report.txt", "outputs/output-1.png"}
        url = arts["/mnt/data/report.txt"]["download_url"]
        assert url.startswith(f"http://{s3_server.endpoint}/{bucket}/{sid}/") and "X-Amz-Signature" in url
        got = httpx.get(url, trust_env=False)
        assert got.status_code == 200 and got.text == "hello s3"
        png = httpx.get(arts["outputs/output-1.png"]["download_url"], trust_env=False)
        assert png.content[:4] == b"\x89PNG" and png.headers["content-type"] == "image/png"
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
        listed = c.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]
        # The runs' artifacts, and the session's notebook kept when it was closed.
        assert {a["path"] for a in listed} == {*arts, "notebook.ipynb"}
        for a in listed:
            assert httpx.get(a["download_url"], trust_env=False).status_code == 200


def test_store_down_gives_an_artifact_error_never_a_lost_run():
    srv = start_server(_s3_env(f"127.0.0.1:{free_port()}", "nobody-listens"))
    try:
        with srv.client() as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["checks"]["artifacts"]["ok"] is False
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/execute",
                       json={"code": "open('a.txt', 'w').write('a')\nx = 41\nx + 1"}).json()
            assert r["status"] == "ok" and r["result"] == "42"
            assert r["artifacts"] == [] and "artifact store failed" in r["artifact_error"]
            # The session goes on.
            assert c.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}).json()["result"] == "41"
    finally:
        srv.discard()


def test_checkpoints_restore_and_fork_through_s3(s3_srv: tuple[Server, str]):
    srv, _ = s3_srv
    with srv.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        c.post(f"/v1/sessions/{sid}/execute", json={"code": "import numpy as np\nv = np.arange(1000)\n"
                                                    "open('/mnt/data/f.txt', 'w').write('s3 file')"})
        ck = c.post(f"/v1/sessions/{sid}/checkpoint").json()
        assert "v" in ck["saved"] and ck["workspace_files"] == 1
        c.post(f"/v1/sessions/{sid}/execute", json={"code": "import os\nos._exit(1)", "timeout_seconds": 60})
        r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "int(v.sum())"}).json()
        assert r["result"] == "499500" and r["state_lost"] is False
        fork = c.post("/v1/sessions", json={"from_checkpoint": ck["checkpoint_id"]}).json()["session_id"]
        f = c.post(f"/v1/sessions/{fork}/execute", json={"code": "open('/mnt/data/f.txt').read(), len(v)"}).json()
        assert f["result"] == "('s3 file', 1000)"
        c.delete(f"/v1/sessions/{fork}")
        c.delete(f"/v1/sessions/{sid}")


def test_a_checkpoint_cut_short_by_a_delete_leaves_no_object_in_s3(s3_server: S3Server):
    bucket = f"km-{uuid.uuid4().hex[:12]}"
    srv = start_server(_s3_env(s3_server.endpoint, bucket))
    store = S3Store(_settings(s3_server, bucket=bucket))
    try:
        with srv.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            # The file first (its run's harvest reads it), then the agent that never answers for it
            c.post(f"/v1/sessions/{sid}/execute", json={"code": "open('/mnt/data/slow.bin', 'wb').write(b'x')\nv = 1"})
            c.post(f"/v1/sessions/{sid}/execute", json={"code": _replace_agent(SILENT_AGENT)})
            answer: dict[str, httpx.Response] = {}
            taker = threading.Thread(target=lambda: answer.update(r=c.post(f"/v1/sessions/{sid}/checkpoint")))
            taker.start()

            def checkpoint_objects() -> list[tuple[str, int]]:
                return asyncio.run(store.list(CHECKPOINT_PREFIX))

            wait_for(checkpoint_objects, "the checkpoint's namespace object in S3", timeout=60)
            assert c.delete(f"/v1/sessions/{sid}").status_code == 204
            taker.join(120)
            assert answer["r"].status_code in (409, 503), answer["r"].text
            assert checkpoint_objects() == []
    finally:
        srv.discard()
