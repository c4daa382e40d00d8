"""A kernel that lies on its file channel: kernel code replaces the file agent's comm target
(kernelmode.files) with its own handler, which answers with a path escape, a huge claimed size,
more bytes than asked, a bad checksum, garbage, or nothing at all. The manager refuses each
cleanly (a JSON error, never a 500, never a hang past its deadline), keeps its memory, and
keeps serving the other sessions; another session's files are never reachable (issue 19)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Server, start_server

TIMEOUT_S = 4  # sessions.files_timeout_seconds of this module's server

# Kernel code that takes over the file agent's target. ANSWER is the handler's body: ``comm``,
# ``data`` (the request) and ``hashlib``/``json`` are at hand.
EVIL = """
import hashlib, json
def _evil(comm, msg):
    data = msg['content']['data']
{answer}
get_ipython().kernel.comm_manager.register_target('kernelmode.files', _evil)
"""

LIES = {
    "path_escape": ("    comm.send({'count': 1}, buffers=[json.dumps({'files': [['../../etc/passwd', 1, 1, 1, 1]]}).encode()])",
                    "list", 502, "file_transfer_failed"),
    "garbage": ("    comm.send({'count': 1}, buffers=[b'\\xff\\x00{{{ not json'])", "list", 502, "file_transfer_failed"),
    "not_a_dict": ("    comm.send(['x'] * 5)", "list", 502, "file_transfer_failed"),
    "huge_size": ("    comm.send({'size': 10**18, 'eof': False}, buffers=[b'x'])", "get", 413, "payload_too_large"),
    "more_bytes": ("    comm.send({'size': 3, 'eof': True, 'sha256': ''}, buffers=[b'x' * 100000])", "get", 502,
                   "file_transfer_failed"),
    "bad_checksum": ("    comm.send({'size': 3, 'eof': True, 'sha256': '0' * 64}, buffers=[b'abc'])", "get", 502,
                     "file_transfer_failed"),
    "silence": ("    pass", "list", 503, "files_timeout"),
    "upload_silence": ("    pass", "put", 503, "files_timeout"),
}


@pytest.fixture(scope="module")
def lie_server() -> Iterator[Server]:
    srv = start_server(env_extra={"KERNELMODE_SESSIONS__FILES_TIMEOUT_SECONDS": str(TIMEOUT_S)})
    yield srv
    srv.discard()


@pytest.fixture(scope="module")
def lie_api(lie_server: Server) -> Iterator[httpx.Client]:
    with lie_server.client() as c:
        yield c


def _session(api: httpx.Client) -> str:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_file_agent_is_refused_cleanly(lie_api: httpx.Client, lie: str) -> None:
    answer, op, status, code = LIES[lie]
    sid = _session(lie_api)
    honest = _session(lie_api)
    try:
        r = lie_api.post(f"/v1/sessions/{sid}/execute", json={"code": EVIL.format(answer=answer)})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        url = f"/v1/sessions/{sid}/files"
        if op == "list":
            got = lie_api.get(url)
        elif op == "get":
            got = lie_api.get(f"{url}/a.txt")
        else:
            got = lie_api.put(f"{url}/a.txt", content=b"abc")
        assert got.status_code == status, got.text
        assert got.json()["error"]["code"] == code
        # The manager is fine, and so is a session whose kernel tells the truth.
        assert lie_api.get("/healthz").status_code == 200
        assert lie_api.put(f"/v1/sessions/{honest}/files/b.txt", content=b"b").status_code == 201
        assert lie_api.get(f"/v1/sessions/{honest}/files/b.txt").content == b"b"
    finally:
        lie_api.delete(f"/v1/sessions/{sid}")
        lie_api.delete(f"/v1/sessions/{honest}")


def test_a_lying_change_note_leaves_the_run_standing(lie_api: httpx.Client) -> None:
    """The post-run note is kernel data too: a forged one (a path escape) is refused, the run
    keeps its output and says why no files were kept."""
    sid = _session(lie_api)
    try:
        forge = (
            "import json, sys\n"
            "agent = sys.modules['kernelmode_files']\n"
            "agent._changes = lambda: {'files': [['../../../etc/shadow', 5, 1, 1, 1]], 'truncated': False,"
            " 'stopped': None}\n"
        )
        assert lie_api.post(f"/v1/sessions/{sid}/execute", json={"code": forge}).json()["status"] == "ok"
        r = lie_api.post(f"/v1/sessions/{sid}/execute", json={"code": "print('still here')"}).json()
        assert r["status"] == "ok" and r["stdout"] == "still here\n"
        assert r["artifacts"] == [] and "outside the workspace" in (r["artifact_error"] or "")
    finally:
        lie_api.delete(f"/v1/sessions/{sid}")


def test_another_sessions_files_are_unreachable(lie_api: httpx.Client) -> None:
    a, b = _session(lie_api), _session(lie_api)
    try:
        assert lie_api.put(f"/v1/sessions/{a}/files/secret.txt", content=b"s").status_code == 201
        assert lie_api.get(f"/v1/sessions/{b}/files/secret.txt").status_code == 404
        assert lie_api.delete(f"/v1/sessions/{b}/files/secret.txt").status_code == 404
        names = [f["name"] for f in lie_api.get(f"/v1/sessions/{b}/files").json()["files"]]
        assert "secret.txt" not in names
        assert lie_api.get(f"/v1/sessions/{a}/files/secret.txt").content == b"s"
    finally:
        lie_api.delete(f"/v1/sessions/{a}")
        lie_api.delete(f"/v1/sessions/{b}")
