"""What a connection makes the manager hold is bounded, and downloads carry nosniff.

- A console (the channels websocket) that floods a busy kernel with big execute_requests it
  never gets replies to does not pin the manager's memory (the tap keeps a bounded prefix of a
  bounded number of pending requests).
- Exporting a long notebook with big outputs streams it (one run in memory at a time).
- Finished runs' display data stays in the store, not in the manager's memory.

Memory is the manager's own (its /proc RSS and peak RSS), with generous margins; the figures of
the attack before the fix are in docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nbformat
import pytest
import websockets
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session as JupyterSession
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)

from kernelmode.gateway.client import WS_PROTOCOL
from tests.conftest import Server, start_server
from tests.support.procfs import hwm_kb, reset_hwm, rss_kb

MB = 1024 * 1024
DISPLAY = "from IPython.display import display\ndisplay({{'text/plain': {ch!r} * 8_000_000}}, raw=True)\n"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    """A server of this module's own: its memory is measured, so no other test's sessions."""
    s = start_server({"KERNELMODE_SESSIONS__POOL_SIZE": "0"})
    yield s
    s.discard()


@pytest.fixture()
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(timeout=300) as c:
        yield c


@pytest.fixture()
def sid(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    session_id = r.json()["session_id"]
    yield session_id
    api.delete(f"/v1/sessions/{session_id}")


def rss_mb(srv: Server) -> float:
    gc.collect()
    return rss_kb(srv.proc.pid) / 1024


def execute(api: httpx.Client, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 120})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "ok", out
    return out


def encode(msg: dict[str, Any], channel: str) -> bytes:
    """A v1 frame, made by jupyter_server's own encoder (what consoles send)."""
    return bytes(serialize_msg_to_ws_v1(msg, channel, lambda o: json.dumps(o, default=json_default).encode()))


def decode(raw: bytes) -> dict[str, Any]:
    channel, parts = deserialize_msg_from_ws_v1(raw)
    header, parent = json.loads(parts[0]), json.loads(parts[1])
    return {"channel": channel, "msg_type": header["msg_type"], "header": header,
            "parent_header": parent, "content": json.loads(parts[3])}


class Console:
    """A console's side of /v1/sessions/{id}/channels, in the v1 binary protocol."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.session = JupyterSession(key=b"", username="attacker")
        self.backlog: list[dict[str, Any]] = []  # frames read but not yet looked for

    async def send(self, channel: str, kind: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(kind, content)
        await self.ws.send(encode(msg, channel))
        return str(msg["header"]["msg_id"])

    async def execute(self, code: str) -> str:
        return await self.send("shell", "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False})

    async def until(self, predicate: Any, timeout: float = 120) -> dict[str, Any]:
        """The first frame whose (channel, msg_type, parent msg_id) matches, among those read
        before and not taken yet, else read on. Shell and IOPub are separate sockets: a cell's
        execute_reply may come before the stream its cell printed, so a frame read while waiting
        for another is kept, never lost."""
        def matches(msg: dict[str, Any]) -> bool:
            return bool(predicate(msg["channel"], msg["msg_type"], msg["parent_header"].get("msg_id")))

        for i, msg in enumerate(self.backlog):
            if matches(msg):
                return self.backlog.pop(i)

        async def read() -> dict[str, Any]:
            while True:
                msg = decode(await self.ws.recv())
                if matches(msg):
                    return msg
                self.backlog.append(msg)
                del self.backlog[:-256]  # the newest are what a test looks for

        try:
            return await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            seen = [(m["channel"], m["msg_type"]) for m in self.backlog[-20:]]
            raise AssertionError(f"no such frame in {timeout} s; the last ones read: {seen}") from None


@contextlib.asynccontextmanager
async def console(srv: Server, sid: str):  # type: ignore[no-untyped-def]
    url = srv.url.replace("http://", "ws://") + f"/v1/sessions/{sid}/channels"
    async with websockets.connect(url, subprotocols=[WS_PROTOCOL], max_size=None, compression=None,
                                  additional_headers={"Authorization": f"Bearer {srv.token}"},
                                  open_timeout=60, ping_interval=None) as ws:
        yield Console(ws)


async def test_a_console_flood_of_unanswered_requests_is_bounded(srv: Server, api: httpx.Client, sid: str) -> None:
    count, size = 40, 5_000_000  # 200 MB of code, each frame under the console's frame bound
    async with console(srv, sid) as c:
        sleeper = await c.execute("import time; time.sleep(600)")
        await c.until(lambda ch, kind, parent: kind == "execute_input" and parent == sleeper)
        before = rss_mb(srv)
        for i in range(count):
            await c.execute(f"flood_{i} = {i}  # " + "x" * size)
        # The control channel is answered while the kernel sleeps; its reply comes after the
        # manager has taken in every frame sent before it.
        probe = await c.send("control", "kernel_info_request", {})
        await c.until(lambda ch, kind, parent: kind == "kernel_info_reply" and parent == probe)
        grown = rss_mb(srv) - before
        print(f"manager RSS +{grown:.0f} MB while {count} x {size / MB:.1f} MB requests wait")
        assert grown < 100, f"the manager holds {grown:.0f} MB for {count * size / MB:.0f} MB of unanswered code"
        # The server is fine; the kernel still answers on its control channel.
        assert (await asyncio.to_thread(api.get, f"/v1/sessions/{sid}")).status_code == 200
        again = await c.send("control", "kernel_info_request", {})
        await c.until(lambda ch, kind, parent: kind == "kernel_info_reply" and parent == again)
    assert (await asyncio.to_thread(api.get, "/healthz")).status_code == 200


async def test_a_console_cell_over_the_code_cap_is_kept_cut(srv: Server, api: httpx.Client, sid: str) -> None:
    async with console(srv, sid) as c:
        code = "big = 1  # " + "y" * (2 * MB) + "\nprint('ran whole')"
        msg_id = await c.execute(code)
        out = await c.until(lambda ch, kind, parent: kind == "stream" and parent == msg_id)
        assert out["content"]["text"].strip() == "ran whole"  # the kernel ran all of it
        await c.until(lambda ch, kind, parent: kind == "execute_reply" and parent == msg_id)
    deadline = time.monotonic() + 30
    while True:
        r = await asyncio.to_thread(api.get, f"/v1/sessions/{sid}/notebook")
        cells = nbformat.reads(r.text, as_version=4).cells[1:]
        if cells or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    source = "".join(cells[-1].source)
    assert source.startswith("big = 1  # yyy") and "print('ran whole')" not in source
    assert source.endswith("more characters of this cell were not kept]")
    assert cells[-1].outputs[0].text == "ran whole\n"


def test_a_big_notebook_export_is_streamed(srv: Server, api: httpx.Client, sid: str) -> None:
    runs = 12
    for i in range(runs):
        execute(api, sid, DISPLAY.format(ch=chr(ord("a") + i)))
    before = rss_mb(srv)
    if not reset_hwm(srv.proc.pid):
        pytest.skip("this kernel cannot reset a process's peak RSS (clear_refs)")
    with tempfile.TemporaryFile() as f:
        with api.stream("GET", f"/v1/sessions/{sid}/notebook") as r:
            assert r.status_code == 200
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.headers["content-type"] == "application/x-ipynb+json"
            for chunk in r.iter_bytes():
                f.write(chunk)
        peak = (hwm_kb(srv.proc.pid) or 0) / 1024 - before
        size = f.tell()
        assert int(r.headers["content-length"]) == size
        f.seek(0)
        nb = nbformat.read(f, as_version=4)
    nbformat.validate(nb)
    print(f"notebook of {size / MB:.0f} MB exported with manager peak RSS +{peak:.0f} MB")
    assert size > runs * 8_000_000
    cells = nb.cells[1:]
    assert len(cells) == runs and f"- runs: {runs}" in nb.cells[0].source
    for i, cell in enumerate(cells):
        (out,) = cell.outputs
        text = out.data["text/plain"]
        assert len(text) == 8_000_000 and text[0] == text[-1] == chr(ord("a") + i)
    assert peak < 200, f"exporting {size / MB:.0f} MB took the manager's peak RSS up {peak:.0f} MB"


def test_finished_runs_display_data_is_not_kept_in_memory(srv: Server, api: httpx.Client, sid: str) -> None:
    execute(api, sid, DISPLAY.format(ch="w"))  # warm up: allocator arenas of this size exist
    before = rss_mb(srv)
    runs = []
    for i in range(20):
        runs.append(execute(api, sid, DISPLAY.format(ch=chr(ord("a") + i)))["run_id"])
    time.sleep(1)
    kept = rss_mb(srv) - before
    print(f"manager RSS +{kept:.0f} MB after 20 runs of 8 MB displays")
    assert kept < 60, f"the manager keeps {kept:.0f} MB after 20 runs of 8 MB of display data"
    # Still all there for a poller, read back from the store.
    r = api.get(f"/v1/runs/{runs[3]}", params={"offset": 0})
    assert r.status_code == 200
    progress = r.json()
    assert progress["done"] and progress["result"]["status"] == "ok"
    (event,) = [e for e in progress["events"] if e["type"] == "display_data"]
    assert len(event["data"]["text/plain"]) == 8_000_000 and event["data"]["text/plain"][0] == "d"
    assert progress["result"]["outputs"][0]["data"]["text/plain"][-1] == "d"
    assert api.get(f"/v1/runs/{runs[3]}", params={"offset": progress["next_offset"]}).json()["events"] == []


def test_every_download_carries_nosniff(srv: Server, api: httpx.Client, sid: str) -> None:
    assert api.put(f"/v1/sessions/{sid}/files/page.html", content=b"<script>1</script>").status_code == 201
    execute(api, sid, "open('/mnt/data/made.html', 'w').write('<b>made</b>')")
    artifacts = api.get(f"/v1/sessions/{sid}/artifacts").json()["artifacts"]
    (made,) = [a for a in artifacts if a["name"] == "made.html"]
    downloads = {
        "workspace file": api.get(f"/v1/sessions/{sid}/files/page.html"),
        "notebook": api.get(f"/v1/sessions/{sid}/notebook"),
        "artifact link": httpx.get(made["download_url"]),  # signed, no token
    }
    for name, r in downloads.items():
        assert r.status_code == 200, (name, r.text)
        assert r.headers.get("x-content-type-options") == "nosniff", name
    json.loads(downloads["notebook"].text)
