"""The capabilities of one day together, on one real server (a real index on loopback, a host
tool, hibernation by a session's own TTL): packages outlive a kernel's death, go to forks (their
own copy) and through hibernation and a server restart; the Jupyter API lists a hibernated
session without waking it and wakes it on attach; checkpoints keep the preamble's names out and
its tools working."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from websockets.sync.client import ClientConnection, connect

from kernelmode.api.jupyter_api import kernel_id_of
from tests.conftest import Server, start_server
from tests.support.package_index import PackageIndex, index_env, temporary_index

CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather"}
"""
SLEEPY = {"ttl_seconds": 10}  # hibernates after 10 s idle (hibernation is on, its global delay long)


@pytest.fixture(scope="module")
def index() -> Iterator[PackageIndex]:
    with temporary_index() as idx:
        yield idx


@pytest.fixture(scope="module")
def env(index: PackageIndex, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG)
    return {"vars": {**index_env(index, index.tmp), "KERNELMODE_SESSIONS__POOL_SIZE": "0",
                     "KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "3600"},
            "args": ["--config", str(cfg)]}


@pytest.fixture(scope="module")
def servers(env: dict[str, object]) -> Iterator[list[Server]]:
    """The server (a list: the last test restarts it on the same data directory)."""
    held = [start_server(env["vars"], args=env["args"])]  # type: ignore[arg-type]
    yield held
    for srv in held:  # both on one data directory
        srv.discard()


@pytest.fixture(scope="module")
def srv(servers: list[Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(timeout=300) as c:
        yield c


def new_session(api: httpx.Client, **body: object) -> dict:
    r = api.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def run(api: httpx.Client, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_seconds": 120})
    assert r.status_code == 200, r.text
    return r.json()


def ok(api: httpx.Client, sid: str, code: str) -> str | None:
    res = run(api, sid, code)
    assert res["status"] == "ok", res
    return res["result"]


def install(api: httpx.Client, sid: str, *packages: str) -> dict:
    r = api.post(f"/v1/sessions/{sid}/packages", json={"packages": list(packages)})
    assert r.status_code == 200, r.text
    return r.json()


def status(api: httpx.Client, sid: str) -> str:
    return str(api.get(f"/v1/sessions/{sid}").json()["status"])


def wait_hibernated(api: httpx.Client, sid: str, within: float = 180) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if status(api, sid) == "hibernated":
            return
        time.sleep(0.5)
    raise AssertionError(f"session {sid} never hibernated")


def layer_site(srv: Server, kernel_id: str) -> Path:
    """The session's package layer on the host (named after its first kernel's workspace)."""
    return srv.data_dir / "packages" / kernel_id / "site"


def test_packages_outlive_a_death_and_go_to_forks_their_own_copy(srv: Server, api: httpx.Client,
                                                                 index: PackageIndex) -> None:
    src = new_session(api, tools=["add"], limits={"memory_mb": 700})["session_id"]
    assert {p["name"] for p in install(api, src, "kmtest-app==1.0")["installed"]} == {"kmtest-app", "kmtest-lib"}
    ok(api, src, "import kmtest_app\nfrom tools import add\nv = kmtest_app.answer()\nplus = add\n"
                 "class Box:\n    pass\nbox = Box()\nbox.lib = kmtest_app")
    ck = api.post(f"/v1/sessions/{src}/checkpoint")
    assert ck.status_code == 200, ck.text
    info = ck.json()
    # The preamble's names are never saved; a tool function is saved by name; the packages recorded
    assert {"tools", "ToolError", "ToolDenied"}.isdisjoint(info["saved"]), info
    assert {"v", "plus", "kmtest_app"} <= set(info["saved"]), info
    assert {p["name"]: p["version"] for p in info["packages"]} == {"kmtest-app": "1.0", "kmtest-lib": "1.0"}

    # A fork: the packages come from the cache (the index is not asked), its variables with them
    asked = len(index.requests)
    forked = new_session(api, fork_of=src)
    fork = forked["session_id"]
    assert len(index.requests) == asked
    assert forked["limits"]["memory_mb"] == 700 and forked["tools"] == ["add"]  # a copy: its source's
    assert ok(api, fork, "(v, kmtest_app.answer(), plus(2, 3), box.lib.answer())") == "(42, 42, 5, 42)"
    # The restored session's tools work: typed module, search, ToolDenied the preamble's own
    assert ok(api, fork, "import tools as t\n(t.add(1, 1), tools.search('add')[0]['name'], "
                         "issubclass(ToolDenied, ToolError), plus is tools.add)") == "(2, 'add', True, True)"
    assert ok(api, fork, "'weather' in tools") == "False"  # the source's tools, not all of them
    # The source's kernel dies: the next run has its packages and its variables back
    died = run(api, src, "import os\nos._exit(1)")
    assert died["status"] == "kernel_died", died
    back = run(api, src, "(v, kmtest_app.answer(), plus(20, 1))")
    assert back["status"] == "ok" and back["result"] == "(42, 42, 21)", back
    assert back["state_lost"] is False and back["restored_from"] is not None, back

    # Independent: a package installed in the fork is not in the source
    install(api, fork, "kmtest-native==1.0")
    assert ok(api, fork, "import kmtest_native\nkmtest_native.PLATFORM") == "'manylinux'"
    res = run(api, src, "import kmtest_native")
    assert res["status"] == "error" and res["error"]["ename"] == "ModuleNotFoundError", res

    # From a checkpoint id too; a cached wheel changed since is not used: fetched again by its pin
    lib = next(p for p in info["packages"] if p["name"] == "kmtest-lib")
    cached = srv.data_dir / "package-cache" / "wheels" / lib["sha256"] / lib["filename"]
    cached.write_bytes(b"not the wheel the checkpoint names")
    asked = len(index.requests)
    other = new_session(api, from_checkpoint=info["checkpoint_id"])["session_id"]
    assert ok(api, other, "kmtest_app.answer() + v") == "84"
    assert len(index.requests) > asked
    for sid in (src, fork, other):
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def _channels(srv: Server, kernel_id: str) -> ClientConnection:
    """/api/kernels/{id}/channels with legacy JSON frames, as Jupyter Server's gateway client."""
    url = "ws" + srv.url[len("http"):] + f"/api/kernels/{kernel_id}/channels"
    return connect(url, additional_headers={"Authorization": f"token {srv.token}"}, open_timeout=300,
                   max_size=None)


def _execute(ws: ClientConnection, code: str) -> str:
    """Run a cell over the channels; the execute_result's text."""
    msg = Session(key=b"", username="person").msg(
        "execute_request", {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                            "allow_stdin": False})
    ws.send(json.dumps({**msg, "channel": "shell"}, default=json_default))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        got = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
        if got["parent_header"].get("msg_id") == msg["msg_id"] and got["msg_type"] in ("execute_result", "error"):
            assert got["msg_type"] == "execute_result", got["content"]
            return str(got["content"]["data"]["text/plain"])
    raise AssertionError("no execute_result")


def test_hibernated_sessions_keep_packages_and_the_jupyter_api_handles_them(srv: Server, api: httpx.Client) -> None:
    made = new_session(api, **SLEEPY)
    sid, first_kernel = made["session_id"], made["kernel_id"]
    kid = kernel_id_of(sid)
    install(api, sid, "kmtest-app==1.0")
    ok(api, sid, "import kmtest_app\nw = 7")
    wait_hibernated(api, sid)
    assert (layer_site(srv, first_kernel) / "kmtest_app").is_dir()  # kept while it sleeps

    # Listed, not woken: no kernel, "idle" (attaching wakes it), its status said
    jh = {"Authorization": f"token {srv.token}"}
    listed = {k["id"]: k for k in api.get("/api/kernels", headers=jh).json()}
    assert listed[kid]["execution_state"] == "idle" and listed[kid]["connections"] == 0
    assert listed[kid]["kernelmode"]["status"] == "hibernated"
    assert api.get(f"/api/kernels/{kid}", headers=jh).json()["kernelmode"]["status"] == "hibernated"
    assert api.post(f"/api/kernels/{kid}/interrupt", headers=jh).status_code == 204
    assert status(api, sid) == "hibernated"  # neither the listing nor the interrupt woke it

    # Attaching its channels wakes it, with its variables and its packages; while a client is
    # attached it does not hibernate again (that would cut the person off)
    with _channels(srv, kid) as ws:
        assert _execute(ws, "(w, kmtest_app.answer())") == "(7, 42)"
        assert status(api, sid) == "idle"
        time.sleep(SLEEPY["ttl_seconds"] + 3)  # past its idle time, while attached
        assert status(api, sid) == "idle"
        assert _execute(ws, "w + 1") == "8"

    # A restart of a hibernated kernel: a fresh, empty kernel at once; the packages stay
    wait_hibernated(api, sid)
    r = api.post(f"/api/kernels/{kid}/restart", headers=jh)
    assert r.status_code == 200, r.text
    assert r.json()["execution_state"] == "idle" and r.json()["kernelmode"]["status"] == "idle"
    res = run(api, sid, "import kmtest_app\n('w' in dir(), kmtest_app.answer())")
    assert res["status"] == "ok" and res["result"] == "(False, 42)" and res["restored_from"] is None, res

    # Deleting a hibernated session removes its package layer
    wait_hibernated(api, sid)
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert not layer_site(srv, first_kernel).parent.exists()


def test_a_hibernated_sessions_packages_survive_a_server_restart(
        servers: list[Server], env: dict[str, object], api: httpx.Client) -> None:
    old = servers[-1]
    made = new_session(api, **SLEEPY)
    sid = made["session_id"]
    install(api, sid, "kmtest-app==1.0")
    ok(api, sid, "import kmtest_app\nu = kmtest_app.answer()")
    wait_hibernated(api, sid)
    assert old.stop() == 0
    # Restarted with kmtest-lib deny-listed since: a fork of the checkpoint asks the policy again
    deny = {"KERNELMODE_PACKAGES__DENY": "[kmtest-denied, 'kmtest-evil*', kmtest-lib]"}
    new = start_server({**env["vars"], **deny}, data_dir=old.data_dir, args=env["args"])  # type: ignore[dict-item]
    servers.append(new)
    assert layer_site(new, made["kernel_id"]).is_dir()  # not swept as a leftover at start
    with new.client(timeout=300) as c:
        assert status(c, sid) == "hibernated"
        checkpoint = c.get(f"/v1/sessions/{sid}/checkpoints").json()["checkpoints"][0]["checkpoint_id"]
        refused = c.post("/v1/sessions", json={"from_checkpoint": checkpoint})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "package_refused", refused.text
        assert "kmtest-lib" in refused.json()["error"]["message"]
        assert len(c.get("/v1/sessions").json()["sessions"]) == 1  # the refused fork is gone
        assert ok(c, sid, "(u, kmtest_app.answer())") == "(42, 42)"
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
