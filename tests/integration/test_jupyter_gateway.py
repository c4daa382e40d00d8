"""JupyterLab's own server against a live ``kernelmode serve``: Jupyter Server started with
``--gateway-url`` (its GatewayClient, GatewayKernelManager and GatewayWebSocketConnection),
driven the way JupyterLab's frontend drives it (REST + the kernel websocket), next to an agent
that works in the same session over kernelmode's REST API."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from websockets.sync.client import ClientConnection, connect

from kernelmode.api.jupyter_api import kernel_id_of
from tests.conftest import Server, start_server
from tests.support.jupyter_server import ATTACHING, JUPYTER_TOKEN, start_jupyter_server

ALPHA, BETA = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
HTTP = httpx.Client(timeout=120)  # tokens per request; kernels start slowly on a busy machine
TENANTS = f"[{{name: alpha, token: '{ALPHA}'}}, {{name: beta, token: '{BETA}'}}]"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text('tools:\n  - {name: add, function: "tests.integration.host_tools:add"}\n')
    s = start_server({"KERNELMODE_SERVER__TENANTS": TENANTS, "KERNELMODE_SESSIONS__POOL_SIZE": "1"},
                     args=["--config", str(cfg)])
    yield s
    s.discard()


@pytest.fixture(scope="module")
def jupyter(srv: Server) -> Iterator[httpx.Client]:
    """A Jupyter Server whose gateway is kernelmode (tenant alpha's token)."""
    proc, url, root = start_jupyter_server(srv.url, ALPHA, [ATTACHING])
    with httpx.Client(base_url=url, headers={"Authorization": f"token {JUPYTER_TOKEN}"}, timeout=120) as c:
        yield c
    proc.terminate()
    proc.wait(60)
    shutil.rmtree(root.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def alpha(srv: Server) -> Iterator[httpx.Client]:
    with srv.client(ALPHA) as c:
        yield c


@pytest.fixture(scope="module")
def agent_sid(alpha: httpx.Client) -> Iterator[str]:
    """The agent's session (REST), with a variable."""
    r = alpha.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    res = alpha.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).json()
    assert res["status"] == "ok", res
    yield sid
    alpha.delete(f"/v1/sessions/{sid}")


class Kernel:
    """A kernel websocket through Jupyter Server, in the protocol JupyterLab gets through a
    gateway (legacy JSON: one message a text frame, its channel a key)."""

    def __init__(self, url: str, kernel_id: str) -> None:
        ws_url = "ws" + url[len("http"):] + f"/api/kernels/{kernel_id}/channels"
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(connect(
            ws_url, additional_headers={"Authorization": f"token {JUPYTER_TOKEN}"},
            max_size=None, open_timeout=120))
        self.session = Session(key=b"", username="person")
        self.seen: list[dict[str, Any]] = []  # every message read, in order

    def send(self, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(msg_type, content)
        msg["channel"] = channel
        self.ws.send(json.dumps(msg, default=json_default))
        return str(msg["header"]["msg_id"])

    def execute(self, code: str, **content: Any) -> str:
        return self.send("shell", "execute_request", {"code": code, "silent": False, "store_history": True,
                                                      "user_expressions": {}, "allow_stdin": False, **content})

    def until(self, test: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict[str, Any]:
        """Read messages until one passes ``test`` (a generous bound: the machine is shared)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
            self.seen.append(msg)
            if test(msg):
                return msg
        raise AssertionError(f"no such message in {timeout} s; seen {[m['msg_type'] for m in self.seen]}")

    def reply(self, msg_id: str, kind: str) -> dict[str, Any]:
        return self.until(lambda m: m["msg_type"] == kind and m["parent_header"].get("msg_id") == msg_id)

    def result(self, msg_id: str) -> str:
        """The text of the cell's execute_result, once its reply is in."""
        found = self.until(lambda m: m["msg_type"] in ("execute_result", "error")
                           and m["parent_header"].get("msg_id") == msg_id)
        assert found["msg_type"] == "execute_result", found["content"]
        return str(found["content"]["data"]["text/plain"])

    def close(self) -> None:
        self._stack.close()


def attach(jupyter: httpx.Client, kernel_id: str, path: str = "agent.ipynb") -> None:
    """What JupyterLab does to open a notebook on an existing kernel: a Jupyter session for it."""
    r = jupyter.post("/api/sessions", json={"path": path, "type": "notebook", "name": path,
                                            "kernel": {"id": kernel_id}})
    assert r.status_code == 201, r.text
    assert r.json()["kernel"]["id"] == kernel_id


def test_jupyterlab_lists_the_agents_session(jupyter: httpx.Client, agent_sid: str) -> None:
    """With kernelmode's AttachingKernelManager, Jupyter Server lists the sessions the token may
    see as running kernels (its own manager lists only kernels it started): JupyterLab's kernel
    list and Select Kernel dialog show the agent's session."""
    kid = kernel_id_of(agent_sid)
    listed = jupyter.get("/api/kernels").json()
    assert kid in [k["id"] for k in listed], listed
    model = next(k for k in listed if k["id"] == kid)
    assert model["execution_state"] in ("idle", "busy")


def test_kernelspecs_and_the_agents_session_through_jupyter_server(
        jupyter: httpx.Client, alpha: httpx.Client, agent_sid: str) -> None:
    name = f"kernelmode-{alpha.get(f'/v1/sessions/{agent_sid}').json()['sandbox']}"
    specs = jupyter.get("/api/kernelspecs").json()
    assert name in specs["kernelspecs"]
    # Jupyter Server takes the gateway's default from the next fetch on
    assert jupyter.get("/api/kernelspecs").json()["default"] == name
    spec = specs["kernelspecs"][name]["spec"]
    assert spec["language"] == "python" and "MB" in spec["display_name"]
    assert spec["metadata"]["kernelmode"]["limits"]["memory_mb"] > 0
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    model = jupyter.get(f"/api/kernels/{kid}").json()
    # JupyterLab labels a kernel by its model's name: AttachingKernelManager names it after the
    # session and tenant; kernelmode's own Jupyter API keeps the kernelspec's name.
    assert model["id"] == kid and model["name"] == f"{agent_sid} · alpha"
    assert model["execution_state"] in ("idle", "busy")
    assert alpha.get(f"/api/kernels/{kid}").json()["name"] == name


def test_a_person_runs_cells_next_to_the_agent(
        srv: Server, jupyter: httpx.Client, alpha: httpx.Client, agent_sid: str) -> None:
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    k = Kernel(str(jupyter.base_url), kid)
    try:
        info = k.reply(k.send("shell", "kernel_info_request", {}), "kernel_info_reply")
        assert info["content"]["language_info"]["name"] == "python"
        # The agent's variable, seen from the person's cell
        assert k.result(k.execute("x + 1")) == "42"
        # Connections: the person's websocket is counted on kernelmode's side
        direct = {"Authorization": f"token {ALPHA}"}
        model = HTTP.get(f"{srv.url}/api/kernels/{kid}", headers=direct).json()
        assert model["connections"] >= 1
        # The variable inspection requests JupyterLab sends
        reply = k.reply(k.send("shell", "inspect_request", {"code": "x", "cursor_pos": 1, "detail_level": 0}),
                        "inspect_reply")
        assert reply["content"]["status"] == "ok" and reply["content"]["found"]
        assert "41" in reply["content"]["data"]["text/plain"]
        reply = k.reply(k.send("shell", "complete_request", {"code": "import collections; collections.Ord",
                                                            "cursor_pos": 35}), "complete_reply")
        assert "OrderedDict" in " ".join(reply["content"]["matches"])
        # The agent's run, while the person is attached: its output reaches the person as it
        # happens (the run is still waiting for a file when the person sees its first line)
        marker, go = secrets.token_hex(6), f"go-{secrets.token_hex(4)}"
        code = (f"import os, time\nprint('{marker}', flush=True)\n"
                f"while not os.path.exists('/mnt/data/{go}'): time.sleep(0.05)\nprint('end')")
        started = alpha.post(f"/v1/sessions/{agent_sid}/execute", json={"code": code, "wait_seconds": 0})
        assert started.status_code == 202, started.text
        k.until(lambda m: m["msg_type"] == "stream" and marker in m["content"]["text"])
        run_id = started.json()["run_id"]
        assert alpha.get(f"/v1/runs/{run_id}").json()["done"] is False  # still running
        assert alpha.put(f"/v1/sessions/{agent_sid}/files/{go}", content=b"").status_code == 201
        done = alpha.get(f"/v1/runs/{run_id}", params={"wait_seconds": 60}).json()
        while not done.get("done"):
            done = alpha.get(f"/v1/runs/{run_id}", params={"wait_seconds": 60}).json()
        assert done["result"]["status"] == "ok" and done["result"]["stdout"] == f"{marker}\nend\n", done
        # The person's cells are in the session's history and notebook export
        nb = alpha.get(f"/v1/sessions/{agent_sid}/notebook").json()
        sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        assert "x + 1" in sources and code in sources
    finally:
        k.close()


def test_an_error_in_a_persons_cell_aborts_nothing_queued_behind_it(
        jupyter: httpx.Client, alpha: httpx.Client, agent_sid: str) -> None:
    """JupyterLab sends stop_on_error: an error would abort every cell queued in the kernel
    behind it, the agent's included. kernelmode turns it off for attached clients' cells."""
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    k = Kernel(str(jupyter.base_url), kid)
    go = f"go-{secrets.token_hex(4)}"
    try:
        failing = k.execute("import os, time\n"
                            f"while not os.path.exists('/mnt/data/{go}'): time.sleep(0.05)\n1/0",
                            stop_on_error=True)
        behind = k.execute("after_error = 7", stop_on_error=True)  # queued in the kernel behind it
        k.until(lambda m: m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == failing)
        # The agent's run queues behind the person's cell too
        agent = alpha.post(f"/v1/sessions/{agent_sid}/execute", json={"code": "agent_after = 8", "wait_seconds": 0})
        assert agent.status_code == 202, agent.text
        assert alpha.put(f"/v1/sessions/{agent_sid}/files/{go}", content=b"").status_code == 201
        assert k.reply(failing, "execute_reply")["content"]["status"] == "error"
        assert k.reply(behind, "execute_reply")["content"]["status"] == "ok"  # not "aborted"
        run_id = agent.json()["run_id"]
        done = alpha.get(f"/v1/runs/{run_id}", params={"wait_seconds": 60}).json()
        while not done.get("done"):
            done = alpha.get(f"/v1/runs/{run_id}", params={"wait_seconds": 60}).json()
        assert done["result"]["status"] == "ok", done
        res = alpha.post(f"/v1/sessions/{agent_sid}/execute", json={"code": "(after_error, agent_after)"}).json()
        assert res["result"] == "(7, 8)", res
    finally:
        k.close()


def test_host_tools_from_a_jupyter_cell(jupyter: httpx.Client, agent_sid: str) -> None:
    """A cell's tool call is answered by kernelmode (the client never sees the request)."""
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    k = Kernel(str(jupyter.base_url), kid)
    try:
        assert k.result(k.execute("tools.add(2, 3)", allow_stdin=True)) == "5"
        assert not [m for m in k.seen if m["msg_type"] == "input_request"]
    finally:
        k.close()


def test_restart_from_jupyter(jupyter: httpx.Client, alpha: httpx.Client) -> None:
    sid = alpha.post("/v1/sessions", json={}).json()["session_id"]
    try:
        assert alpha.post(f"/v1/sessions/{sid}/execute", json={"code": "gone = 1"}).json()["status"] == "ok"
        kid = kernel_id_of(sid)
        attach(jupyter, kid, "restart.ipynb")
        assert jupyter.post(f"/api/kernels/{kid}/restart").status_code == 200
        res = alpha.post(f"/v1/sessions/{sid}/execute", json={"code": "'gone' in dir()"}).json()
        assert res["status"] == "ok" and res["result"] == "False", res
    finally:
        alpha.delete(f"/v1/sessions/{sid}")


def test_interrupt_from_jupyter(jupyter: httpx.Client, agent_sid: str) -> None:
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    k = Kernel(str(jupyter.base_url), kid)
    try:
        cell = k.execute("import time\nfor _ in range(6000): time.sleep(0.05)")
        k.until(lambda m: m["msg_type"] == "execute_input" and m["parent_header"].get("msg_id") == cell)
        assert jupyter.post(f"/api/kernels/{kid}/interrupt").status_code == 204
        reply = k.reply(cell, "execute_reply")
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert k.result(k.execute("x")) == "41"  # the session's state is intact
    finally:
        k.close()


def test_debugger_requests(jupyter: httpx.Client, agent_sid: str) -> None:
    """ipykernel's debugger (debugpy, in the kernel image) answers JupyterLab's first requests."""
    kid = kernel_id_of(agent_sid)
    attach(jupyter, kid)
    k = Kernel(str(jupyter.base_url), kid)
    try:
        info = k.reply(k.send("shell", "kernel_info_request", {}), "kernel_info_reply")
        if "debugger" not in info["content"].get("supported_features", []) and not info["content"].get("debugger"):
            pytest.skip("this kernel does not enable the debugger")
        init = k.reply(k.send("control", "debug_request", {
            "type": "request", "seq": 1, "command": "initialize",
            "arguments": {"clientID": "jupyterlab", "adapterID": "python", "pathFormat": "path",
                          "linesStartAt1": True, "columnsStartAt1": True, "supportsVariableType": True}}),
            "debug_reply")
        assert init["content"]["success"], init["content"]
        attach_reply = k.reply(k.send("control", "debug_request", {
            "type": "request", "seq": 2, "command": "attach", "arguments": {}}), "debug_reply")
        assert attach_reply["content"]["success"], attach_reply["content"]
        variables = k.reply(k.send("control", "debug_request", {
            "type": "request", "seq": 3, "command": "inspectVariables", "arguments": {}}), "debug_reply")
        assert variables["content"]["success"], variables["content"]
        names = {v["name"] for v in variables["content"]["body"]["variables"]}
        assert "x" in names
    finally:
        k.close()


def test_new_kernel_and_delete(srv: Server, jupyter: httpx.Client, alpha: httpx.Client, agent_sid: str) -> None:
    """A notebook's new kernel is a new session of the tenant; JupyterLab deleting it stops it,
    but deleting the agent's kernel only detaches (the agent's session stays)."""
    r = jupyter.post("/api/sessions", json={"path": "mine.ipynb", "type": "notebook", "name": "mine.ipynb",
                                            "kernel": {"name": f"kernelmode-{srv_backend(alpha, agent_sid)}"}})
    assert r.status_code == 201, r.text
    jsid, kid = r.json()["id"], r.json()["kernel"]["id"]
    own = [s for s in alpha.get("/v1/sessions").json()["sessions"] if kernel_id_of(s["session_id"]) == kid]
    assert len(own) == 1 and own[0]["tenant"] == "alpha"
    assert jupyter.delete(f"/api/sessions/{jsid}").status_code == 204
    assert alpha.get(f"/v1/sessions/{own[0]['session_id']}").status_code == 404
    # The agent's: detached, not deleted
    agent_kid = kernel_id_of(agent_sid)
    direct = {"Authorization": f"token {ALPHA}"}
    assert HTTP.delete(f"{srv.url}/api/kernels/{agent_kid}", headers=direct).status_code == 204
    assert alpha.get(f"/v1/sessions/{agent_sid}").json()["status"] != "lost"
    res = alpha.post(f"/v1/sessions/{agent_sid}/execute", json={"code": "x"}).json()
    assert res["result"] == "41", res


def srv_backend(alpha: httpx.Client, sid: str) -> str:
    return str(alpha.get(f"/v1/sessions/{sid}").json()["sandbox"])


def test_token_scheme_and_jupyter_error_shape(srv: Server, agent_sid: str) -> None:
    kid = kernel_id_of(agent_sid)
    for scheme in ("token", "Bearer"):
        r = HTTP.get(f"{srv.url}/api/kernels", headers={"Authorization": f"{scheme} {ALPHA}"})
        assert r.status_code == 200 and kid in [k["id"] for k in r.json()]
    r = HTTP.get(f"{srv.url}/api/kernels", headers={"Authorization": "token wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized" and r.json()["message"]
    r = HTTP.get(f"{srv.url}/api/kernels/{kid}", headers={"Authorization": f"token {BETA}"})
    assert r.status_code == 404 and r.json()["reason"] == "session_not_found"
    assert kid not in [k["id"] for k in HTTP.get(
        f"{srv.url}/api/kernels", headers={"Authorization": f"token {BETA}"}).json()]
    r = HTTP.post(f"{srv.url}/api/kernels", headers={"Authorization": f"token {ALPHA}"},
                   json={"name": "no-such-spec"})
    assert r.status_code == 422 and "no-such-spec" in r.json()["message"]
    r = HTTP.post(f"{srv.url}/api/kernels", headers={"Authorization": f"token {ALPHA}"}, content=b"[1")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json"
