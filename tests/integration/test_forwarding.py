"""A request that reaches a manager other than the session's owner is forwarded to the owner
(api/forwarding.py; docs/high-availability.md "Routing between managers"). Real parts: three
`kernelmode serve` on one PostgreSQL store and one external Kernel Gateway, the round-robin
balancer stand-in, the Python client, the MCP SDK client, `kernelmode console`, a Jupyter
kernel websocket."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import uuid
from collections.abc import Iterator

import httpx
import httpx2
import pytest
from jupyter_client.session import Session as JupyterSession
from mcp.client.client import Client as McpClient
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ElicitRequestParams, ElicitResult, TextContent
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from kernelmode.api.forwarding import FORWARDED_HEADER
from kernelmode.client import Client
from tests.support.managers import Managers, start_managers
from tests.support.postgres import PgCluster
from tests.support.round_robin import RoundRobin
from tests.support.server import attached_frontend, wait_for

LEASE = 10  # seconds; the kill test asks before the dead owner's lease is up
FORWARD_CAP = 4  # server.forward_max_connections: small, and every test here fits in it
ALPHA, BETA = "alpha-" + secrets.token_hex(8), "beta-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def three(pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Managers]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"  # a host tool that needs approval
    cfg.write_text('tools:\n  - {name: weather, function: "tests.integration.host_tools:weather", '
                   'requires_approval: true}\n')
    with start_managers(3, pg_cluster.create_database("forwarding"),
                        {"KERNELMODE_STORE__LEASE_SECONDS": str(LEASE),
                         # Sessions stay where they were made (rebalancing: test_rebalance.py).
                         "KERNELMODE_STORE__REBALANCE": "false",
                         "KERNELMODE_SERVER__FORWARD_MAX_CONNECTIONS": str(FORWARD_CAP),
                         "KERNELMODE_SERVER__TENANTS": f"[{{name: alpha, token: '{ALPHA}'}}, "
                                                       f"{{name: beta, token: '{BETA}'}}]"},
                        args=["--config", str(cfg)]) as ms:
        yield ms


def client(ms: Managers, i: int) -> Client:
    return Client(ms[i].url, ms.token, timeout=120)


def owner_of(ms: Managers, sid: str) -> str:
    """The URL of the manager holding the session's lease (read from the store)."""
    import psycopg

    with psycopg.connect(ms.env["KERNELMODE_STORE__URL"], autocommit=True) as conn:
        row = conn.execute("SELECT m.url FROM leases l JOIN managers m USING (manager_id) "
                           "WHERE l.session_id=%s AND l.expires_at > now()", (sid,)).fetchone()
    assert row is not None, f"nobody holds {sid}"
    return str(row[0])


def test_created_through_a_run_through_b_console_through_c(three: Managers) -> None:
    with client(three, 0) as a, client(three, 1) as b:
        s = a.create_session()
        try:
            assert owner_of(three, s.id) == three[0].url
            r = b.session(s.id).run("shared = 6 * 7")
            assert r.status == "ok", r
            with attached_frontend(three[2], s.id) as kc:  # `kernelmode console` through C
                reply = kc.execute_interactive("shared += 1; print(shared)", timeout=120,
                                               output_hook=(out := []).append)
            assert reply["content"]["status"] == "ok", reply["content"]
            assert "43" in "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")
            assert b.session(s.id).run("print(shared)").stdout.strip() == "43"
            assert a.get_session(s.id).session_id == s.id
        finally:
            s.close()


def test_jupyter_kernel_channels_through_another_manager(three: Managers) -> None:
    """What JupyterLab lists (/api/kernels) and attaches to (/api/kernels/{id}/channels, legacy
    JSON) on a non-owner."""
    with client(three, 0) as a:
        s = a.create_session()
        try:
            s.run("jup = 'seen'")
            kid = str(uuid.UUID(hex=s.id))
            for m in three.servers:  # JupyterLab's kernel list is the same whichever manager it asks
                listed = httpx.get(m.url + "/api/kernels", headers={"Authorization": f"Bearer {three.token}"}).json()
                assert kid in [k["id"] for k in listed], (m.url, listed)
            ws_url = "ws" + three[1].url.removeprefix("http") + f"/api/kernels/{uuid.UUID(hex=s.id)}/channels"
            with connect(ws_url, additional_headers={"Authorization": f"Bearer {three.token}"},
                         open_timeout=60) as ws:
                msg = JupyterSession(key=b"", username="person").msg(
                    "execute_request", {"code": "jup", "silent": False, "store_history": True,
                                        "user_expressions": {}, "allow_stdin": False})
                ws.send(json.dumps({**msg, "channel": "shell"}, default=str))
                while True:
                    got = json.loads(ws.recv(timeout=120))
                    if got["msg_type"] == "execute_result" and got["parent_header"]["msg_id"] == msg["header"]["msg_id"]:
                        break
            assert got["content"]["data"]["text/plain"] == "'seen'"
        finally:
            s.close()


def test_upload_through_one_manager_download_through_another(three: Managers) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    with client(three, 0) as a, client(three, 1) as b, client(three, 2) as c:
        s = a.create_session()
        try:
            assert b.upload(s.id, "blob.bin", data).size_bytes == len(data)
            assert c.download(s.id, "blob.bin") == data
            assert s.run("print(len(open('blob.bin', 'rb').read()))").stdout.strip() == str(len(data))
        finally:
            s.close()


def test_checkpoint_and_fork_through_different_managers(three: Managers) -> None:
    with client(three, 0) as a, client(three, 1) as b, client(three, 2) as c:
        s = a.create_session()
        try:
            s.run("kept = [1, 2, 3]")
            cp = b.checkpoint(s.id)
            assert "kept" in cp.saved
            assert [x.checkpoint_id for x in c.checkpoints(s.id)][0] == cp.checkpoint_id
            with c.fork(s.id) as fork:  # the source is A's: C forwards the create to A
                assert fork.run("print(sum(kept))").stdout.strip() == "6"
            with b.fork(checkpoint_id=cp.checkpoint_id) as restored:
                assert restored.run("print(kept)").stdout.strip() == "[1, 2, 3]"
        finally:
            s.close()


def test_mcp_client_through_the_round_robin_balancer(three: Managers) -> None:
    async def go() -> list[str]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {three.token}"},
                                  timeout=httpx2.Timeout(30, read=300))
        outs = []
        with RoundRobin([m.url for m in three.servers]) as lb:
            async with McpClient(streamable_http_client(lb.url + "/mcp", http_client=http)) as mcp:
                for code in ("counter = 1", "counter += 1", "counter *= 10", "print(counter)"):
                    r = await mcp.call_tool("run_python", {"code": code})
                    assert not r.is_error, r
                    outs.append("\n".join(b.text for b in r.content if isinstance(b, TextContent)))
                await mcp.call_tool("close_session", {})
            assert len({url for url in lb.sent}) == 3  # every manager was reached
        await http.aclose()
        return outs

    outs = asyncio.run(go())
    assert "20" in outs[-1], outs


def test_a_queued_run_is_followed_through_another_manager(three: Managers) -> None:
    """A run queued behind another on its owner (A) is not in the store yet: polling it through B
    still finds it (its id names the manager that took it), and its answer is the owner's; so are
    the run in flight (the store names its session's owner) and, done, the store's record. A
    made-up run id is answered 404 by B alone (a poll of an unknown run used to ask every other
    manager: an amplification any client could drive). The proof that it reached neither A nor
    C: their logs, where each 404 of theirs is a line, show a marker 404 asked of them directly
    after it, and never the made-up id."""
    auth = {"Authorization": f"Bearer {three.token}"}
    with client(three, 0) as a, httpx.Client(base_url=three[1].url, headers=auth, timeout=120) as b:
        s = a.create_session()
        try:
            first = a.execute(s.id, "import time; time.sleep(3); print('first')", wait_seconds=0)
            queued = a.execute(s.id, "print('after')", wait_seconds=0)
            assert first.status == queued.status == "running"
            for run in (queued, first):  # queued on A, then in flight there
                seen = b.get(f"/v1/runs/{run.run_id}")
                assert seen.status_code == 200 and seen.json()["run_id"] == run.run_id, seen.text
            progress = {"done": False, "next_offset": 0}
            while not progress["done"]:
                progress = b.get(f"/v1/runs/{queued.run_id}", params={
                    "wait_seconds": 30, "offset": progress["next_offset"]}).json()
            assert progress["result"]["stdout"] == "after\n"
            assert b.get(f"/v1/runs/{first.run_id}").json()["result"]["stdout"] == "first\n"  # the store's
        finally:
            s.close()
        made_up = secrets.token_hex(16)
        gone = b.get(f"/v1/runs/{made_up}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "run_not_found", gone.text
    for m in (three[0], three[2]):
        marker = secrets.token_hex(16)
        assert httpx.get(f"{m.url}/v1/runs/{marker}", headers=auth).status_code == 404
        wait_for(lambda m=m, marker=marker: marker in m.log(), f"the marker 404 in {m.url}'s log")
        assert made_up not in m.log(), f"{m.url} was asked about a made-up run id"


def test_python_client_and_consoles_through_the_round_robin_balancer(three: Managers) -> None:
    """A client behind a balancer that sends each request (and each websocket) to the next
    manager does not notice: its runs, files and three console connections (one per manager)
    see one session."""
    with RoundRobin([m.url for m in three.servers]) as lb, Client(lb.url, three.token, timeout=120) as km:
        with km.create_session() as s:
            for code in ("total = 0", "total += 1", "total += 1", "total += 1"):
                assert s.run(code).status == "ok"
            s.upload("note.txt", b"through the balancer")
            assert s.download("note.txt") == b"through the balancer"
            ws_url = "ws" + lb.url.removeprefix("http") + f"/api/kernels/{uuid.UUID(hex=s.id)}/channels"
            for _ in range(3):
                with connect(ws_url, additional_headers={"Authorization": f"Bearer {three.token}"},
                             open_timeout=60) as ws:
                    msg = JupyterSession(key=b"", username="person").msg(
                        "execute_request", {"code": "total += 10; total", "silent": False, "store_history": True,
                                            "user_expressions": {}, "allow_stdin": False})
                    ws.send(json.dumps({**msg, "channel": "shell"}, default=str))
                    while True:
                        got = json.loads(ws.recv(timeout=120))
                        if got["msg_type"] == "execute_result" and \
                                got["parent_header"]["msg_id"] == msg["header"]["msg_id"]:
                            break
            assert got["content"]["data"]["text/plain"] == "33"
            assert s.run("print(total)").stdout.strip() == "33"
        assert len(set(lb.sent)) == 3


def test_a_forwarded_request_is_never_forwarded_again(three: Managers) -> None:
    """B gets a request marked as forwarded for a session A owns: it answers 503 session_owned_elsewhere
    (the client sends it again) instead of passing it on a second time."""
    with client(three, 0) as a:
        s = a.create_session()
        try:
            with httpx.Client(base_url=three[1].url, headers={"Authorization": f"Bearer {three.token}"},
                              timeout=60) as raw:
                plain = raw.get(f"/v1/sessions/{s.id}")
                assert plain.status_code == 200  # forwarded once
                again = raw.get(f"/v1/sessions/{s.id}", headers={FORWARDED_HEADER: "someone"})
                assert again.status_code == 503, again.text
                assert again.json()["error"]["code"] == "session_owned_elsewhere"
                assert "send it again" in again.json()["error"]["message"]
                assert int(again.headers["Retry-After"]) >= 1
        finally:
            s.close()


def test_forwarding_trusts_no_identity_but_the_token(three: Managers) -> None:
    """Attack: the owner checks the bearer token of a forwarded request itself. Another tenant's
    token reaching a non-owner finds nothing (REST and websocket alike), and the forwarding mark
    a client sets itself opens nothing without a token."""
    with Client(three[0].url, ALPHA, timeout=120) as alpha:
        s = alpha.create_session()
        try:
            with httpx.Client(base_url=three[1].url, timeout=60) as raw:
                beta = {"Authorization": f"Bearer {BETA}"}
                assert raw.get(f"/v1/sessions/{s.id}", headers=beta).status_code == 404
                assert raw.post(f"/v1/sessions/{s.id}/execute", json={"code": "1"}, headers={
                    **beta, "X-Kernelmode-Tenant": "alpha"}).status_code == 404
                marked = raw.get(f"/v1/sessions/{s.id}", headers={FORWARDED_HEADER: "m", "X-Kernelmode-Tenant": "alpha"})
                assert marked.status_code == 401
                assert raw.get(f"/v1/sessions/{s.id}", headers={"Authorization": f"Bearer {ALPHA}"}).status_code == 200
            ws_url = "ws" + three[1].url.removeprefix("http") + f"/v1/sessions/{s.id}/channels"
            with pytest.raises(InvalidStatus) as refused:
                connect(ws_url, additional_headers={"Authorization": f"Bearer {BETA}"},
                        subprotocols=["v1.kernel.websocket.jupyter.org"], open_timeout=60)
            assert refused.value.response.status_code == 404
        finally:
            s.close()


def test_unreachable_owner_is_a_503_with_retry_after(three: Managers) -> None:
    """The owner is SIGKILLed; before its lease is up another manager answers 503 manager_gone
    with Retry-After = the lease bound, and an MCP connection that lived there is a 404 (the
    client opens a new one)."""
    with client(three, 2) as victim:
        s = victim.create_session()
    auth = {"Authorization": f"Bearer {three.token}"}
    with httpx.Client(base_url=three[2].url, headers=auth, timeout=60) as raw:
        init = raw.post("/mcp", headers={"Accept": "application/json, text/event-stream"},
                        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                            "protocolVersion": "2025-06-18", "capabilities": {},
                            "clientInfo": {"name": "t", "version": "1"}}})
        assert init.status_code == 200, init.text
        mcp_sid = init.headers["mcp-session-id"]
    three.kill(2)
    try:
        with httpx.Client(base_url=three[0].url, headers=auth, timeout=60) as raw:
            r = raw.post(f"/v1/sessions/{s.id}/execute", json={"code": "1"})
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == str(LEASE)
            err = r.json()["error"]
            assert err["code"] == "manager_gone"
            assert "gone" in err["message"] and f"within {LEASE} s" in err["message"]
            assert "send the request again then" in err["message"] and not err["details"].get("maybe_done")  # never reached
            lost = raw.post("/mcp", headers={"Accept": "application/json, text/event-stream",
                                             "Mcp-Session-Id": mcp_sid},
                            json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
            assert lost.status_code == 404, lost.text
    finally:
        three.restart(2)


def _text(r: CallToolResult) -> str:
    """A tool answer's text, with what differs per run made neutral: ids, the cell's number."""
    text = "\n".join(b.text for b in r.content if isinstance(b, TextContent))
    return re.sub(r"In\[\d+\]", "In[N]", re.sub(r"[0-9a-f]{32}", "ID", text))


def test_mcp_tool_calls_for_a_session_another_manager_owns(three: Managers) -> None:
    """A failover: the session lives on C (made there over REST), the MCP client (re)connects to
    B. Its tool calls naming the session are served by C with the caller's token, and read exactly
    as C's own answers: a value, an error, an unknown session, output as progress, a long run
    followed with get_run."""
    with client(three, 2) as c:
        s = c.create_session()
        s.run("kept = 41")

    async def go() -> None:
        auth = {"Authorization": f"Bearer {three.token}"}
        async with httpx2.AsyncClient(headers=auth, timeout=httpx2.Timeout(30, read=300)) as http, \
                McpClient(streamable_http_client(three[1].url + "/mcp", http_client=http)) as b, \
                McpClient(streamable_http_client(three[2].url + "/mcp", http_client=http)) as own:
            first = await b.call_tool("run_python", {"code": "kept += 1", "session_id": s.id})
            assert not first.is_error, first
            for code in ("kept + 1", "print(kept)", "1/0", "kept"):
                via_b = await b.call_tool("run_python", {"code": code, "session_id": s.id})
                local = await own.call_tool("run_python", {"code": code, "session_id": s.id})
                assert via_b.is_error == local.is_error == (code == "1/0"), (via_b, local)
                assert _text(via_b) == _text(local), (code, via_b, local)
            assert _text(via_b).endswith("42"), via_b
            gone = {"code": "1", "session_id": "0" * 32}
            unknown_b, unknown_c = await b.call_tool("run_python", gone), await own.call_tool("run_python", gone)
            assert unknown_b.is_error and _text(unknown_b) == _text(unknown_c), (unknown_b, unknown_c)
            # Output as progress (the SDK path: a progress token), then a run followed with get_run.
            seen: list[str] = []

            async def progress(_p: float, _t: float | None, message: str | None) -> None:
                seen.append(message or "")

            r = await b.call_tool("run_python", {"code": "import time\nfor i in range(3):\n    print('tick', i, "
                                  "flush=True); time.sleep(0.3)", "session_id": s.id}, progress_callback=progress)
            assert not r.is_error and "tick 2" in _text(r), r
            assert "tick 0" in "".join(seen), seen
            # Followed there and still running: the answer says what the owner cut so far.
            flood = "print('x' * (1 << 20) + 'y' * 4096, flush=True)\nimport time; time.sleep(3)"
            r = await b.call_tool("run_python", {"code": flood, "session_id": s.id, "wait_seconds": 1},
                                  progress_callback=progress)
            assert "status: RUNNING" in _text(r) and "NOTE: the server cut some output" in _text(r), r
            await b.call_tool("get_run", {"run_id": r.structured_content["run_id"], "wait_seconds": 60})
            r = await b.call_tool("run_python", {"code": "import time; time.sleep(2); print('late')",
                                                 "session_id": s.id, "wait_seconds": 0})
            assert "status: RUNNING" in _text(r), r
            # Queued behind it on C, not in the store yet: its id names C.
            q = await b.call_tool("run_python", {"code": "print('queued')", "session_id": s.id, "wait_seconds": 0})
            assert "status: RUNNING" in _text(q), q
            assert isinstance(r.structured_content, dict) and isinstance(q.structured_content, dict)
            queued = await b.call_tool("get_run", {"run_id": q.structured_content["run_id"], "wait_seconds": 60})
            assert not queued.is_error and "queued" in _text(queued) and "status: ok" in _text(queued), queued
            done = await b.call_tool("get_run", {"run_id": r.structured_content["run_id"], "wait_seconds": 60})
            assert not done.is_error and "late" in _text(done) and "status: ok" in _text(done), done
            made_up = {"run_id": secrets.token_hex(16)}
            nowhere_b, nowhere_c = await b.call_tool("get_run", made_up), await own.call_tool("get_run", made_up)
            assert nowhere_b.is_error and _text(nowhere_b) == _text(nowhere_c), (nowhere_b, nowhere_c)
            # The session's other tools, through B, read as C's own answers.
            sent = await b.call_tool("upload_file", {"filename": "notes/a.txt", "session_id": s.id,
                                                     "content_base64": base64.b64encode(b"hello").decode()})
            assert not sent.is_error and "Saved /mnt/data/notes/a.txt (5 bytes) in session ID" in _text(sent), sent
            for tool, args in (("list_files", {}), ("read_artifact", {"path_or_artifact": "notes/a.txt"}),
                               ("read_artifact", {"path_or_artifact": "nothing.txt"}), ("interrupt", {})):
                via_b = await b.call_tool(tool, {**args, "session_id": s.id})
                local = await own.call_tool(tool, {**args, "session_id": s.id})
                assert _text(via_b) == _text(local) and via_b.is_error == local.is_error, (tool, via_b, local)
            assert "hello" in _text(via_b := await b.call_tool("read_artifact", {
                "path_or_artifact": "/mnt/data/notes/a.txt", "session_id": s.id})), via_b
            cp = await b.call_tool("checkpoint", {"session_id": s.id})
            assert not cp.is_error and "kept" in _text(cp), cp
            fork = await b.call_tool("fork_session", {"session_id": s.id})
            assert not fork.is_error, fork
            fork_id = re.search(r"New session ([0-9a-f]{32})", "".join(
                x.text for x in fork.content if isinstance(x, TextContent)))
            assert fork_id is not None, fork
            in_fork = await b.call_tool("run_python", {"code": "kept", "session_id": fork_id[1]})
            assert _text(in_fork).endswith("42"), in_fork
            closed = await b.call_tool("close_session", {"session_id": fork_id[1]})
            assert _text(closed) == "Session ID is closed.", closed

    try:
        asyncio.run(go())
    finally:
        with client(three, 2) as c:
            c.session(s.id).close()


def test_mcp_tool_call_for_another_tenants_session_elsewhere_finds_nothing(three: Managers) -> None:
    """Attack: a beta token naming alpha's session (owned by C) through B's MCP: the same answer as
    an unknown session; nothing reaches the session."""
    with Client(three[2].url, ALPHA, timeout=120) as alpha:
        s = alpha.create_session()

    async def go() -> tuple[CallToolResult, CallToolResult]:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {BETA}", "X-Kernelmode-Tenant": "alpha"},
                                      timeout=httpx2.Timeout(30, read=300)) as http, \
                McpClient(streamable_http_client(three[1].url + "/mcp", http_client=http)) as b:
            theirs = await b.call_tool("run_python", {"code": "leak = 1", "session_id": s.id})
            nobodys = await b.call_tool("run_python", {"code": "leak = 1", "session_id": "0" * 32})
            return theirs, nobodys

    try:
        theirs, nobodys = asyncio.run(go())
        assert theirs.is_error and _text(theirs).replace(s.id, "ID") == _text(nobodys).replace("0" * 32, "ID")
        with Client(three[2].url, ALPHA, timeout=120) as alpha:
            assert "leak" not in alpha.session(s.id).run("print(dir())").stdout
    finally:
        with Client(three[2].url, ALPHA, timeout=120) as alpha:
            alpha.session(s.id).close()


def test_forwarding_beyond_its_bound_is_503_server_busy_at_once(three: Managers) -> None:
    """More long requests through a non-owner than its forwarding bound: the extra ones are
    answered 503 server_busy (with Retry-After) while the others still wait on the owner, the
    others complete, and once they have, new ones go through again."""
    auth = {"Authorization": f"Bearer {three.token}"}
    with client(three, 0) as a:
        s = a.create_session()
        run = a.execute(s.id, "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.05)",
                        wait_seconds=0)  # silent until released: each poll of it waits its full term

        async def go() -> None:
            async with httpx.AsyncClient(base_url=three[1].url, headers=auth, timeout=120,
                                         limits=httpx.Limits(max_connections=50)) as b:
                polls = [asyncio.create_task(b.get(f"/v1/runs/{run.run_id}", params={"wait_seconds": 60}))
                         for _ in range(FORWARD_CAP + 2)]
                busy: set[asyncio.Task[httpx.Response]] = set()
                while len(busy) < 2:  # answered before the run is released: not queued behind the others
                    done, _ = await asyncio.wait([p for p in polls if p not in busy], timeout=55,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    assert done, "the requests over the bound were not answered while the others waited"
                    for p in done:
                        r = p.result()
                        assert r.status_code == 503, r.text
                        assert r.json()["error"]["code"] == "server_busy", r.text
                        # the bound's own answer, not a wait for a pooled connection that timed out
                        assert "passing 4 requests on" in r.json()["error"]["message"], r.text
                        assert r.headers["Retry-After"] == "1"
                        busy.add(p)
                assert len(busy) == 2
                await asyncio.to_thread(a.upload, s.id, "go", b"")  # release the run (through its owner)
                for p in polls:
                    if p not in busy:
                        r = await p
                        assert r.status_code == 200 and r.json()["done"], r.text
                again = await asyncio.gather(*(b.get(f"/v1/sessions/{s.id}") for _ in range(FORWARD_CAP)))
                assert [r.status_code for r in again] == [200] * FORWARD_CAP, [r.text for r in again]

        try:
            asyncio.run(go())
        finally:
            s.close()


def test_mcp_approvals_of_a_run_another_manager_owns(three: Managers) -> None:
    """A run on C that calls a tool needing approval, started through B's MCP: a client that
    answers elicitations is asked (B relays its answer to C); one that does not gets the pending
    answer, an operator decides on C, and get_run through B follows the run to its end."""
    with client(three, 2) as c:
        s = c.create_session()
    code = 'r = tools.weather(city="Paris")\nr["city"]'
    seen: list[str] = []

    async def approve(_context: object, params: ElicitRequestParams) -> ElicitResult:
        seen.append(params.message)
        return ElicitResult(action="accept", content={"approve": True})

    async def go() -> None:
        auth = {"Authorization": f"Bearer {three.token}"}
        async with httpx2.AsyncClient(headers=auth, timeout=httpx2.Timeout(30, read=300)) as http:
            async with McpClient(streamable_http_client(three[1].url + "/mcp", http_client=http),
                                 elicitation_callback=approve) as asks:
                r = await asks.call_tool("run_python", {"code": code, "session_id": s.id})
                assert not r.is_error and "[result]\n'Paris'" in _text(r), r
                assert len(seen) == 1 and "weather" in seen[0], seen
            async with McpClient(streamable_http_client(three[1].url + "/mcp", http_client=http)) as plain:
                r = await plain.call_tool("run_python", {"code": code, "session_id": s.id})
                assert isinstance(r.structured_content, dict), r
                assert r.structured_content["status"] == "awaiting_approval", r
                [pending] = r.structured_content["pending_approvals"]
                assert "AWAITING APPROVAL" in _text(r)
                run_id = r.structured_content["run_id"]
                with three.client(2) as api:
                    assert api.post(f"/v1/runs/{run_id}/approvals/{pending['call_id']}",
                                    json={"approve": True}).status_code == 200
                done = await plain.call_tool("get_run", {"run_id": run_id, "wait_seconds": 60})
                assert not done.is_error and "[result]\n'Paris'" in _text(done), done

    try:
        asyncio.run(go())
    finally:
        with client(three, 2) as c:
            c.session(s.id).close()

