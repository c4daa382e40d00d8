"""Attacks on checkpoints: another tenant's ids, download links to checkpoint objects, damaged and
truncated blobs, a pickle that would run code wherever it is loaded, links planted by the kernel.

One server with two tenants; every checkpoint is real (taken in a real sandboxed kernel) and
every kernel death is real.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernelmode.artifacts.local import LocalStore
from kernelmode.errors import StoreError
from tests.conftest import Server


def _run(c: httpx.Client, sid: str, code: str, timeout: float = 60) -> dict:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": timeout})
    assert r.status_code == 200, r.text
    return r.json()


def _session(c: httpx.Client, **body: object) -> str:
    r = c.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def _checkpoint(c: httpx.Client, sid: str) -> dict:
    r = c.post(f"/v1/sessions/{sid}/checkpoint")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def alpha_ck(alpha: httpx.Client) -> Iterator[tuple[str, dict]]:
    sid = _session(alpha)
    _run(alpha, sid, "secret = 'alpha-only'")
    yield sid, _checkpoint(alpha, sid)
    alpha.delete(f"/v1/sessions/{sid}")


def _blob(tenant_server: Server, checkpoint_id: str) -> Path:
    return tenant_server.data_dir / "artifacts" / ".checkpoints" / checkpoint_id / "namespace.kmck"


def test_another_tenants_checkpoint_is_an_unknown_id(alpha_ck: tuple[str, dict], beta: httpx.Client) -> None:
    sid, ck = alpha_ck
    theirs = beta.post("/v1/sessions", json={"from_checkpoint": ck["checkpoint_id"]})
    nobody = beta.post("/v1/sessions", json={"from_checkpoint": "0" * 32})
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["error"]["code"] == nobody.json()["error"]["code"] == "checkpoint_not_found"
    assert theirs.json()["error"]["message"].replace(ck["checkpoint_id"], "0" * 32) == \
        nobody.json()["error"]["message"]
    # Nor can beta fork, checkpoint or list alpha's session.
    for method, path, body in (("POST", "/v1/sessions", {"fork_of": sid}),
                               ("POST", f"/v1/sessions/{sid}/checkpoint", None),
                               ("GET", f"/v1/sessions/{sid}/checkpoints", None)):
        r = beta.request(method, path, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (path, r.text)
    assert [s for s in beta.get("/v1/sessions").json()["sessions"] if s["session_id"] == sid] == []


def test_checkpoint_objects_are_never_served_by_a_link(tenant_server: Server, alpha: httpx.Client,
                                                       alpha_ck: tuple[str, dict]) -> None:
    sid, ck = alpha_ck
    assert _blob(tenant_server, ck["checkpoint_id"]).is_file()
    key = f".checkpoints/{ck['checkpoint_id']}/namespace.kmck"
    # A link signed with the server's own key (read from its data dir, as an insider could) is
    # still refused: the prefix is never served.
    store = LocalStore(tenant_server.data_dir / "artifacts", 60)
    asyncio.run(store.start())
    expires = str(int(time.time()) + 60)
    with httpx.Client(base_url=tenant_server.url) as anon:
        r = anon.get(f"/v1/artifacts/{key}", params={"expires": expires, "sig": store._sign(key, int(expires))})
        assert r.status_code == 403 and b"alpha-only" not in r.content
    with pytest.raises(StoreError):
        asyncio.run(store.link(key, tenant_server.url))
    # The session's artifacts never list it, and read through the workspace it is not there.
    arts = alpha.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]
    assert not any(".checkpoints" in a["path"] or ".kernelmode-checkpoint" in a["path"] for a in arts)
    assert alpha.get(f"/v1/sessions/{sid}/files").json()["files"] == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_a_damaged_checkpoint_gives_a_clear_error_and_a_fresh_kernel(tenant_server: Server, alpha: httpx.Client,
                                                                      damage: str) -> None:
    sid = _session(alpha)
    try:
        _run(alpha, sid, "import numpy as np\nbig = np.arange(100_000)\nsmall = 5")
        ck = _checkpoint(alpha, sid)
        blob = _blob(tenant_server, ck["checkpoint_id"])
        data = blob.read_bytes()
        if damage == "truncate":
            blob.write_bytes(data[: len(data) // 2])
        elif damage == "garbage":
            blob.write_bytes(b"\x80\x05not a checkpoint at all" * 100)
        else:  # one byte in big's array: its checksum fails, the rest comes back
            pos = len(data) // 3  # inside big's 800 kB buffer
            blob.write_bytes(data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1:])
        assert _run(alpha, sid, "import os\nos._exit(1)")["status"] == "kernel_died"
        r = _run(alpha, sid, "'big' in globals(), 'small' in globals()", timeout=120)
        assert r["status"] == "ok" and r["state_lost"] is True
        if damage == "flip":
            assert r["result"] == "(False, True)" and "big" in r["lost_variables"]
            assert r["restore_error"] is None
        else:
            assert r["result"] == "(False, False)"
            assert r["restore_error"] and ck["checkpoint_id"] in r["restore_error"]
            assert ("truncated" if damage == "truncate" else "bad header") in r["restore_error"]
            assert r["restored_from"] is None and set(r["lost_variables"]) >= {"big", "small"}
        # The session goes on.
        assert _run(alpha, sid, "1 + 1")["result"] == "2"
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


def test_a_checkpoint_is_only_ever_unpickled_in_a_sandbox(tenant_server: Server, alpha: httpx.Client) -> None:
    marker = Path(f"/tmp/km-unpickled-{secrets.token_hex(6)}")
    sid = _session(alpha)
    try:
        _run(alpha, sid, "import os\nclass Evil:\n    def __reduce__(self):\n"
                         f"        return (os.system, ('touch {marker}',))\nevil = Evil()")
        ck = _checkpoint(alpha, sid)
        assert "evil" in ck["saved"]
        fork = _session(alpha, from_checkpoint=ck["checkpoint_id"])  # loaded in the fork's kernel
        alpha.delete(f"/v1/sessions/{fork}")
        _run(alpha, sid, "import os\nos._exit(1)")
        _run(alpha, sid, "1", timeout=120)  # loaded in the fresh kernel
        assert not marker.exists(), "a checkpoint's pickle ran on the host"
    finally:
        alpha.delete(f"/v1/sessions/{sid}")
        marker.unlink(missing_ok=True)


def test_links_planted_in_the_checkpoint_folder_are_not_followed(tenant_server: Server, alpha: httpx.Client) -> None:
    sid = _session(alpha)
    try:
        # The folder is a link to the kernel's /tmp: the kernel writes there, the manager refuses
        # to look through the link (it would reach the host's /tmp).
        _run(alpha, sid, "import os\nos.symlink('/tmp', '/mnt/data/.kernelmode-checkpoint')\nv = 1")
        r = alpha.post(f"/v1/sessions/{sid}/checkpoint")
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_failed", r.text
        assert _run(alpha, sid, "v")["result"] == "1"
        _run(alpha, sid, "import os\nos.remove('/mnt/data/.kernelmode-checkpoint')")
        assert alpha.post(f"/v1/sessions/{sid}/checkpoint").status_code == 200
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


def test_a_kernel_cannot_reach_the_stored_checkpoints(tenant_server: Server, alpha: httpx.Client,
                                                      alpha_ck: tuple[str, dict]) -> None:
    sid = _session(alpha)
    try:
        where = str(tenant_server.data_dir / "artifacts" / ".checkpoints")
        r = _run(alpha, sid, f"import os\ntry:\n    print(os.listdir({where!r}))\nexcept OSError as e:\n"
                             "    print('refused', type(e).__name__)")
        assert r["stdout"].startswith("refused"), r
    finally:
        alpha.delete(f"/v1/sessions/{sid}")
