"""Attacks through the Jupyter-gateway-compatible API (/api/kernels...): another tenant's kernel
is an unknown id on every route and on the channels websocket (both protocols); a client's
``env`` never reaches a kernel; a bad legacy frame ends only its own connection; a client's
shutdown_request does not stop the agent's kernel."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import pytest
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from kernelmode.api.jupyter_api import kernel_id_of
from tests.conftest import Server

from .conftest import ALPHA, BETA

HTTP = httpx.Client(timeout=120)  # tokens per request; kernels start slowly on a busy machine
UNKNOWN = "00000000-0000-4000-8000-000000000000"
V1 = "v1.kernel.websocket.jupyter.org"


@pytest.fixture(scope="module")
def alpha_sid(alpha: httpx.Client) -> Iterator[str]:
    r = alpha.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    assert alpha.post(f"/v1/sessions/{sid}/execute", json={"code": "secret = 41"}).json()["status"] == "ok"
    yield sid
    alpha.delete(f"/v1/sessions/{sid}")


def _ws_url(tenant_server: Server, kid: str) -> str:
    return "ws" + tenant_server.url[len("http"):] + f"/api/kernels/{kid}/channels"


def test_another_tenants_kernel_is_unknown_on_every_route(tenant_server: Server, alpha: httpx.Client, alpha_sid: str) -> None:
    kid = kernel_id_of(alpha_sid)
    beta = {"Authorization": f"token {BETA}"}
    routes = [("GET", ""), ("DELETE", ""), ("POST", "/interrupt"), ("POST", "/restart")]
    for method, tail in routes:
        r = HTTP.request(method, f"{tenant_server.url}/api/kernels/{kid}{tail}", headers=beta, json={})
        unknown = HTTP.request(method, f"{tenant_server.url}/api/kernels/{UNKNOWN}{tail}", headers=beta, json={})
        assert r.status_code == unknown.status_code == 404, (method, tail, r.text)
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"] == "session_not_found"
        assert r.json()["message"].replace(kid, UNKNOWN) == unknown.json()["message"]
    listed = HTTP.get(f"{tenant_server.url}/api/kernels", headers=beta).json()
    assert kid not in [k["id"] for k in listed]
    # The channels websocket, both protocols: refused at the handshake, like an unknown id
    for subprotocols in ([V1], None):
        for target in (kid, UNKNOWN):
            with pytest.raises(InvalidStatus) as refused:
                connect(_ws_url(tenant_server, target), additional_headers=beta,
                        subprotocols=subprotocols, open_timeout=60)  # type: ignore[arg-type]
            assert refused.value.response.status_code == 404
    # No token, or a wrong one: 401 before anything
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(tenant_server, kid), additional_headers={"Authorization": "token wrong"}, open_timeout=60)
    assert refused.value.response.status_code == 401
    # Nothing of alpha's was touched: no interrupt, no restart, no delete
    res = alpha.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": "secret"}).json()
    assert res["result"] == "41", res


def test_a_clients_env_never_reaches_the_kernel(tenant_server: Server, alpha: httpx.Client) -> None:
    canary = "KM_JUPYTER_ENV_" + secrets.token_hex(6)
    r = HTTP.post(f"{tenant_server.url}/api/kernels", headers={"Authorization": f"token {ALPHA}"},
                   json={"name": None, "env": {"KERNEL_CANARY": canary, "LD_PRELOAD": "/tmp/x.so",
                                               "PYTHONSTARTUP": "/tmp/x.py"}})
    assert r.status_code == 201, r.text
    sid = r.json()["kernelmode"]["session_id"]
    try:
        res = alpha.post(f"/v1/sessions/{sid}/execute", json={
            "code": "import os; sorted(k for k, v in os.environ.items() if "
                    f"'{canary}' in v or k in ('LD_PRELOAD', 'PYTHONSTARTUP', 'KERNEL_CANARY'))"}).json()
        assert res["status"] == "ok" and res["result"] == "[]", res
    finally:
        assert HTTP.delete(f"{tenant_server.url}/api/kernels/{r.json()['id']}",
                            headers={"Authorization": f"token {ALPHA}"}).status_code == 204
    assert alpha.get(f"/v1/sessions/{sid}").status_code == 404  # started here: stopped here


def test_bad_legacy_frames_and_shutdown_requests(tenant_server: Server, alpha: httpx.Client, alpha_sid: str) -> None:
    kid = kernel_id_of(alpha_sid)
    headers = {"Authorization": f"token {ALPHA}"}
    session = Session(key=b"", username="person")
    # A shutdown request from the person is not passed on: the agent's kernel stays
    with connect(_ws_url(tenant_server, kid), additional_headers=headers, open_timeout=60, max_size=None) as ws:
        for channel in ("shell", "control"):
            msg = session.msg("shutdown_request", {"restart": False})
            ws.send(json.dumps({**msg, "channel": channel}, default=json_default))
        probe = session.msg("kernel_info_request", {})
        ws.send(json.dumps({**probe, "channel": "shell"}, default=json_default))
        while True:  # the kernel still answers on this connection
            got = json.loads(ws.recv(timeout=120))
            if got["msg_type"] == "kernel_info_reply" and got["parent_header"]["msg_id"] == probe["msg_id"]:
                break
    bad = ["[]", '{"channel": "nowhere", "header": {}}', '{"channel": "shell", "header": 5}',
           "{" * 100 + "}" * 100, "not json"]
    for frame in bad:
        with connect(_ws_url(tenant_server, kid), additional_headers=headers, open_timeout=60) as ws:
            ws.send(frame)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    ws.recv(timeout=120)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400, frame
    res = alpha.post(f"/v1/sessions/{alpha_sid}/execute", json={"code": "secret"}).json()
    assert res["status"] == "ok" and res["result"] == "41" and not res.get("state_lost"), res
