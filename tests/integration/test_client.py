"""The Python client (kernelmode.Client / AsyncClient) and one-shot runs, against a real server."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kernelmode
from kernelmode import AsyncClient, Client
from kernelmode.client import ServerUnreachable
from kernelmode.errors import (
    InvalidRequest,
    KernelmodeError,
    PayloadTooLarge,
    RunNotFound,
    SessionExists,
    SessionNotFound,
    Unauthorized,
)
from kernelmode.models import Artifact, RunResult, SessionInfo, WorkspaceFile
from tests.conftest import Server


@pytest.fixture()
def km(server: Server):
    with Client(server.url, server.token) as c:
        yield c


def test_session_context_manager_typed_results_and_cleanup(km: Client) -> None:
    with km.create_session(limits={"memory_mb": 512}) as s:
        assert isinstance(s.info, SessionInfo) and s.info.limits.memory_mb == 512
        r = s.run("x = 20\nprint('hi')\nx + 22")
        assert isinstance(r, RunResult)
        assert (r.status, r.stdout, r.result) == ("ok", "hi\n", "42")
        err = s.run("1/0")
        assert err.status == "error" and err.error is not None and err.error.ename == "ZeroDivisionError"
        assert s.run("x").result == "20"  # a code error is a result, and the session lives on
        assert s.refresh().execution_count >= 3
        assert any(i.session_id == s.id for i in km.list_sessions())
        sid = s.id
    with pytest.raises(SessionNotFound) as e:
        km.get_session(sid)
    assert e.value.code == "session_not_found" and e.value.http_status == 404


def test_errors_are_the_projects_exceptions_with_the_servers_code(km: Client, server: Server) -> None:
    with pytest.raises(SessionNotFound):
        km.execute("no-such-session", "1")
    with pytest.raises(RunNotFound):
        km.get_run("0" * 32)
    with km.create_session() as s:
        with pytest.raises(SessionExists) as e:
            km.create_session(s.id)
        assert e.value.code == "session_exists"
        with pytest.raises(InvalidRequest) as v:
            s.run("1", timeout_seconds=10**6)
        assert v.value.code == "invalid_request" and v.value.details
    with pytest.raises(ValueError):  # refused client-side: the same model as the server's
        km.create_session(limits={"memory_mb": 1})
    with Client(server.url, "wrong") as bad, pytest.raises(Unauthorized):
        bad.list_sessions()
    assert issubclass(Unauthorized, KernelmodeError)


# A program that imports the client and nothing else (no server module loaded first).
_BARE_CLIENT = """
import sys
from kernelmode import errors
from kernelmode.client import Client
with Client(sys.argv[1], sys.argv[2]) as km, km.create_session() as s:
    try:
        s.download("missing.txt")
    except errors.KernelmodeError as e:
        print(type(e).__name__, e.code, e.http_status)
"""


def test_a_program_that_imports_only_the_client_gets_file_not_found(server: Server) -> None:
    """``Session.download`` promises FileNotFound: it held only if kernelmode.artifacts.workspace
    happened to be imported first (in pytest it always was)."""
    root = Path(kernelmode.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", _BARE_CLIENT, server.url, server.token], capture_output=True,
                         text=True, check=True, timeout=120, cwd=root, env={"PYTHONPATH": str(root)})
    assert out.stdout.split() == ["FileNotFound", "file_not_found", "404"], out


def test_unreachable_server_is_a_clear_error_after_retries() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    with Client(f"http://127.0.0.1:{port}", "t", retries=1) as c, pytest.raises(ServerUnreachable) as e:
        c.health()
    assert "cannot reach" in e.value.message


def test_files_up_and_down_and_artifacts(km: Client, tmp_path) -> None:
    local = tmp_path / "local.csv"
    local.write_bytes(b"a,b\n1,2\n")
    with km.create_session() as s:
        assert s.upload("raw/bytes.bin", b"\x00\x01\x02").path == "/mnt/data/raw/bytes.bin"
        assert s.upload("from_path.csv", str(local)).size_bytes == 8
        assert s.upload("from_file.txt", io.BytesIO(b"streamed")).size_bytes == 8
        with pytest.raises(KernelmodeError) as e:  # no overwrite by default
            s.upload("from_file.txt", b"again")
        assert e.value.code == "file_exists"
        s.upload("from_file.txt", b"replaced", overwrite=True)
        assert s.download("/mnt/data/from_file.txt") == b"replaced"
        assert s.download("raw/bytes.bin") == b"\x00\x01\x02"
        r = s.run("open('/mnt/data/out.txt', 'w').write('made by code')")
        (art,) = r.artifacts
        assert isinstance(art, Artifact) and art.path == "/mnt/data/out.txt"
        assert km.download_artifact(art) == b"made by code"  # signed link, no token
        assert [a.path for a in s.artifacts()] == ["/mnt/data/out.txt"]
        names = {f.path for f in s.files()}
        assert all(isinstance(f, WorkspaceFile) for f in s.files())
        assert names == {"/mnt/data/raw/bytes.bin", "/mnt/data/from_path.csv", "/mnt/data/from_file.txt",
                         "/mnt/data/out.txt"}


def test_long_run_streaming_and_polling(km: Client) -> None:
    code = "import time\nfor i in range(4):\n    print(i, flush=True)\n    time.sleep(0.3)\n'end'"
    with km.create_session() as s:
        seen: list[dict] = []
        r = s.run(code, on_event=seen.append)
        assert r.status == "ok" and r.result == "'end'"
        assert "".join(e["text"] for e in seen if e["type"] == "stream") == "0\n1\n2\n3\n"
        first = s.run(code, wait_seconds=0.2)
        assert first.status == "running"
        events = list(km.stream(first.run_id))
        assert "".join(e.get("text", "") for e in events) == "0\n1\n2\n3\n"
        final = km.follow(first.run_id)
        assert final.status == "ok" and final.stdout == "0\n1\n2\n3\n"


def test_a_run_whose_session_was_deleted_raises_on_follow(km: Client) -> None:
    s = km.create_session()
    first = s.run("import time; time.sleep(30)", wait_seconds=0.2)
    s.close()
    s.close()  # closing twice is fine
    with pytest.raises(SessionNotFound):
        km.follow(first.run_id)


def test_one_shot_run_with_files_and_artifacts(km: Client) -> None:
    before = {i.session_id for i in km.list_sessions()}
    r = km.run_once("import pandas as pd\ndf = pd.read_csv('/mnt/data/in/t.csv')\n"
               "df.assign(c=df.a * 2).to_csv('/mnt/data/out.csv', index=False)\nint(df.a.sum())",
               files={"in/t.csv": b"a\n1\n2\n"})
    assert r.status == "ok" and r.result == "3", r
    assert r.session_id.startswith("oneshot-")
    (art,) = r.artifacts  # the input is not an artifact; the output is
    assert km.download_artifact(art) == b"a,c\n1,2\n2,4\n"
    # The kernel is gone: nothing is left but the artifacts.
    assert {i.session_id for i in km.list_sessions()} == before
    with pytest.raises(SessionNotFound):
        km.get_session(r.session_id)
    # State never leaks from one one-shot run to the next.
    assert km.run_once("x = 1").status == "ok"
    assert km.run_once("x").error.ename == "NameError"


def test_one_shot_bad_input(km: Client, server: Server) -> None:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as raw:
        r = raw.post("/v1/execute", json={"code": "1", "files": [{"path": "a", "content_base64": "%%%"}]})
        assert r.status_code == 422 and "base64" in r.json()["error"]["message"]
        r = raw.post("/v1/execute", json={"code": "1", "files": [{"path": "../escape", "content_base64": ""}]})
        assert r.status_code in (400, 422), r.text
        assert raw.post("/v1/execute", json={"cod": "1"}).status_code == 422
        assert raw.post("/v1/execute", json={"code": "1", "timeout_seconds": 10**7}).status_code == 422
    assert km.run_once("'still fine'").result == "'still fine'"
    with pytest.raises(PayloadTooLarge):
        km.run_once("x = '" + "a" * (2 * 1024 * 1024) + "'")


async def test_async_client(server: Server) -> None:
    async with AsyncClient(server.url, server.token) as km:
        async with await km.create_session() as s:
            assert (await s.run("y = 5; y * 2")).result == "10"
            await s.upload("f.txt", b"async")
            assert await s.download("f.txt") == b"async"
            assert (await s.upload("g.txt", io.BytesIO(b"from a file"))).size_bytes == 11
            assert await s.download("/mnt/data/g.txt") == b"from a file"
            first = await s.run("import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.2)",
                                wait_seconds=0.1)
            streamed = [e async for e in km.stream(first.run_id)]
            assert "".join(e.get("text", "") for e in streamed) == "0\n1\n2\n"
            events: list[dict] = []
            r = await s.run("print('streamed')", on_event=events.append)
            assert r.stdout == "streamed\n" and events[0]["text"] == "streamed\n"
            sid = s.id
        with pytest.raises(SessionNotFound):
            await km.get_session(sid)
        one = await km.run_once("6 * 7")
        assert one.result == "42"
        assert [t.name for t in await km.tools()] == [t.name for t in Client(server.url, server.token).tools()]
        assert (await km.health()).status == "ok"
