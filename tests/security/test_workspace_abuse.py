"""Nothing kernel code does in its workspace breaks its session's API: files churned while a run's
harvest walks the tree, names that are not UTF-8, trees deeper than any recursion, entries that
change type under the walk, more entries than the walk's bound. Each time every run answers with
its output (kept in the history), and listings, downloads, uploads and artifacts answer without
a 500 (issue 20, part 3)."""

from __future__ import annotations

import asyncio
import textwrap
import threading
from urllib.parse import quote

import httpx

from kernelmode.artifacts.workspace import SCAN_MAX_DEPTH, SCAN_MAX_ENTRIES
from tests.conftest import Server
from tests.mcp.conftest import mcp_client

# A kernel thread that makes and removes files (and folders) in /mnt/data as fast as it can, until
# `_churn_stop` is set: what any library writing temporary files does, only more.
CHURN = """
import os, threading
_churn_stop = threading.Event()
_churn_count = [0]
def _churn():
    os.makedirs('/mnt/data/tmp', exist_ok=True)
    i = 0
    while not _churn_stop.is_set():
        i += 1
        try:  # a window of 300 live files: each is listed by a walk, then gone before its stat
            with open(f'/mnt/data/tmp/t{i}', 'w') as f:
                f.write('x' * (i % 4096))
            if i > 300:
                os.remove(f'/mnt/data/tmp/t{i - 300}')
            if i % 7 == 0:
                os.makedirs(f'/mnt/data/tmp/d{i}/x'); open(f'/mnt/data/tmp/d{i}/x/f', 'w').close()
            if i % 7 == 0 and i > 300:
                d = f'/mnt/data/tmp/d{i - 294}'
                os.remove(d + '/x/f'); os.rmdir(d + '/x'); os.rmdir(d)
        except OSError:
            pass
        _churn_count[0] += 1
threading.Thread(target=_churn, daemon=True).start()
"""

# A name swapped between a file, a folder, a link loop, a fifo and a deep folder, all the time.
SWAPPER = """
import os, shutil, threading
_swap_stop = threading.Event()
_swaps = [0]
def _swap():
    p = '/mnt/data/shifty'
    kinds = ['file', 'dir', 'loop', 'fifo', 'tree']
    while not _swap_stop.is_set():
        for kind in kinds:
            try:
                if os.path.islink(p) or os.path.isfile(p) or (os.path.exists(p) and not os.path.isdir(p)):
                    os.remove(p)
                elif os.path.isdir(p):
                    shutil.rmtree(p)
                if kind == 'file':
                    with open(p, 'w') as f:
                        f.write('data' * 1000)
                elif kind == 'dir':
                    os.mkdir(p)
                elif kind == 'loop':
                    os.symlink(p, p)
                elif kind == 'fifo':
                    os.mkfifo(p)
                else:
                    os.makedirs(p + '/a/b'); open(p + '/a/b/c.txt', 'w').close()
            except OSError:
                pass
            _swaps[0] += 1
threading.Thread(target=_swap, daemon=True).start()
"""


def _ok(r: httpx.Response, *codes: int) -> httpx.Response:
    assert r.status_code in (codes or (200,)), (r.status_code, r.text)
    return r


def _history(api: httpx.Client, sid: str) -> str:
    """The session's notebook: every recorded run's code and output."""
    return _ok(api.get(f"/v1/sessions/{sid}/notebook")).text


def _check_api_answers(api: httpx.Client, sid: str, upload: int = 201) -> dict:
    """Listing, artifacts and an upload answer (no 500); the listing."""
    listing = _ok(api.get(f"/v1/sessions/{sid}/files")).json()
    _ok(api.get(f"/v1/sessions/{sid}/artifacts"))
    _ok(api.put(f"/v1/sessions/{sid}/files/in.txt?overwrite=true", content=b"upload"), upload)
    return listing


def test_temp_file_churn_during_runs_listings_and_uploads(server: Server, session_factory, run, api) -> None:
    sid = session_factory()
    assert run(sid, CHURN)["status"] == "ok"
    errors: list[str] = []

    def listings() -> None:  # a second client lists and uploads while the runs go on
        with server.client() as c:
            for i in range(15):
                for r in (c.get(f"/v1/sessions/{sid}/files"),
                          c.put(f"/v1/sessions/{sid}/files/up{i}.txt", content=b"u" * 1000)):
                    if r.status_code not in (200, 201):
                        errors.append(f"{r.request.method} {r.request.url}: {r.status_code} {r.text}")

    t = threading.Thread(target=listings)
    t.start()
    markers = [f"churn-run-{i}" for i in range(10)]
    try:
        for m in markers:
            result = run(sid, f"print({m!r}); open('/mnt/data/{m}.txt', 'w').write('kept'); _churn_count[0]")
            assert result["status"] == "ok", result
            assert m in result["stdout"]
            _check_api_answers(api, sid)
    finally:
        t.join(300)
    assert not errors, errors
    assert run(sid, "_churn_stop.set(); _churn_count[0] > 1000")["result"] == "True"  # it did churn
    history = _history(api, sid)
    for m in markers:  # every run's code and output were recorded
        assert history.count(m) >= 2, m
    listing = _check_api_answers(api, sid)
    assert {f"/mnt/data/{m}.txt" for m in markers} <= {f["path"] for f in listing["files"]}


def test_a_name_that_is_not_utf8(server: Server, session_factory, run, api) -> None:
    sid = session_factory()
    made = run(sid, "open(b'/mnt/data/\\xff\\xfe.txt', 'w').write('bytes'); "
                    "import os; os.makedirs(b'/mnt/data/d\\xe9', exist_ok=True); "
                    "open(b'/mnt/data/d\\xe9/in.csv', 'w').write('a,b')")
    assert made["status"] == "ok", made
    shown = {a["path"] for a in made["artifacts"]}
    assert {"/mnt/data/\\xff\\xfe.txt", "/mnt/data/d\\xe9/in.csv"} <= shown, made
    assert made["artifact_error"] is None
    later = run(sid, "print('still fine')")
    assert later["status"] == "ok" and later["stdout"] == "still fine\n"
    listing = _check_api_answers(api, sid)
    paths = {f["path"] for f in listing["files"]}
    assert {"/mnt/data/\\xff\\xfe.txt", "/mnt/data/d\\xe9/in.csv"} <= paths
    assert listing["truncated"] is False and listing["note"] is None
    # Downloading it by its shown name: the bytes, or a clear refusal (a path may not hold '\').
    for path in ("\\xff\\xfe.txt", "d\\xe9/in.csv"):
        r = api.get(f"/v1/sessions/{sid}/files/{quote(path)}")
        assert r.status_code in (200, 404, 422), (r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["code"], r.text
    # Its kept artifact downloads by its link.
    arts = {a["path"]: a for a in _ok(api.get(f"/v1/sessions/{sid}/artifacts")).json()["artifacts"]}
    link = arts["/mnt/data/\\xff\\xfe.txt"]["download_url"]
    assert _ok(httpx.get(link)).content == b"bytes"
    assert "still fine" in _history(api, sid)
    assert _ok(api.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"

    async def over_mcp() -> tuple[str, str]:
        async with mcp_client(server, close=False) as c:
            files = await c.call_tool("list_files", {"session_id": sid})
            read = await c.call_tool("read_artifact", {"session_id": sid,
                                                        "path_or_artifact": "/mnt/data/\\xff\\xfe.txt"})
            assert not files.is_error
            return (files.content[0].text, read.content[0].text)  # type: ignore[union-attr]

    files_text, read_text = asyncio.run(over_mcp())
    assert "/mnt/data/\\xff\\xfe.txt" in files_text
    assert "bytes" in read_text  # served from the run's kept artifact


def test_a_tree_1500_levels_deep(session_factory, run, api) -> None:
    sid = session_factory()
    made = run(sid, textwrap.dedent("""
        import os
        fd = os.open('/mnt/data', os.O_RDONLY)
        for level in range(1500):
            os.mkdir('d', dir_fd=fd)
            nfd = os.open('d', os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open('bottom.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))
        os.close(fd)
        open('/mnt/data/top.txt', 'w').write('top')
        print('deep')
    """), timeout_seconds=120)
    assert made["status"] == "ok" and made["stdout"] == "deep\n", made
    assert [a["path"] for a in made["artifacts"]] == ["/mnt/data/top.txt"]
    assert f"{SCAN_MAX_DEPTH} levels" in made["artifact_error"], made
    for _ in range(2):
        later = run(sid, "print('after')")
        assert later["status"] == "ok" and later["stdout"] == "after\n"
        listing = _check_api_answers(api, sid)
        assert "/mnt/data/top.txt" in {f["path"] for f in listing["files"]}
        assert listing["truncated"] is True and f"{SCAN_MAX_DEPTH} levels" in listing["note"]
    assert "after" in _history(api, sid)
    _ok(api.delete(f"/v1/sessions/{sid}"), 204)


def test_a_name_swapped_between_file_folder_loop_and_fifo(session_factory, run, api) -> None:
    sid = session_factory()
    assert run(sid, "import os; os.mkfifo('/mnt/data/pipe')")["status"] == "ok"
    r = api.get(f"/v1/sessions/{sid}/files/pipe")  # never opened for reading: no hang, no 500
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found", r.text
    assert run(sid, SWAPPER)["status"] == "ok"
    try:
        for i in range(10):
            result = run(sid, f"print('swap-{i}', _swaps[0] >= 0)")
            assert result["status"] == "ok" and f"swap-{i} True" in result["stdout"], result
            _check_api_answers(api, sid)
            r = api.get(f"/v1/sessions/{sid}/files/shifty")  # a file one moment, a fifo the next
            assert r.status_code in (200, 404), (r.status_code, r.text)
            r = api.get(f"/v1/sessions/{sid}/files/shifty/a/b/c.txt")
            assert r.status_code in (200, 404), (r.status_code, r.text)
            r = api.put(f"/v1/sessions/{sid}/files/shifty/up.txt", content=b"x")
            assert r.status_code in (201, 409), (r.status_code, r.text)
    finally:
        done = run(sid, "_swap_stop.set(); _swaps[0]")
    assert int(done["result"]) > 100
    history = _history(api, sid)
    assert all(f"swap-{i}" in history for i in range(10))


def test_more_entries_than_the_walk_reads(session_factory, run, api) -> None:
    sid = session_factory()
    n = 2 * SCAN_MAX_ENTRIES
    made = run(sid, f"import os\nos.mkdir('/mnt/data/many')\n"
                    f"for i in range({n}):\n    open(f'/mnt/data/many/{{i}}', 'w').close()\n"
                    "print('made')", timeout_seconds=300)
    assert made["status"] == "ok" and made["stdout"] == "made\n", made
    assert made["artifacts_truncated"] is True
    assert f"stopped after {SCAN_MAX_ENTRIES} entries" in made["artifact_error"]
    # More entries than the walk reads: the workspace counts as full for uploads (413).
    listing = _check_api_answers(api, sid, upload=413)
    assert 0 < len(listing["files"]) <= SCAN_MAX_ENTRIES
    assert listing["truncated"] is True and f"{SCAN_MAX_ENTRIES} entries" in listing["note"]
    later = run(sid, "print('later')")
    assert later["status"] == "ok" and later["stdout"] == "later\n"
    # A run that makes nothing keeps nothing, though the walk sees a different part each time.
    assert later["artifacts"] == []
