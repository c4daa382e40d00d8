"""Attacks on the approval gate: kernel code cannot get a gated tool to run without a person's
yes — not by calling it past the ``tools`` object, not by answering for itself, not from another
tenant's token — and a denied call never reaches the tool; nor can it pin the manager's memory
with gated calls left pending (bounded per session and per tenant, count and bytes)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, start_server, wait_for
from tests.support.procfs import rss_kb

OTHER = secrets.token_urlsafe(16)
CONFIG = """
server:
  tenants:
    - {name: other, token: "${KM_OTHER_TOKEN}"}
tools:
  - {name: bump, function: "tests.integration.host_tools:bump", requires_approval: true}
  - {name: bumps, function: "tests.integration.host_tools:bumps"}
tool_calls:
  max_pending_approval_bytes_per_tenant: 10485760  # 10 MiB; the other bounds: their defaults
"""
# A request made the way the preamble makes one, past the tools object (and its ToolDenied).
FORGE = """
import json, sys
kernel = get_ipython().kernel
marker = sys.modules['kernelmode_preamble'].MARKER
reply = json.loads(type(kernel).raw_input(kernel, marker + json.dumps(
    {"id": %r, "tool": "bump", "arguments": {}})))
print(json.dumps(reply))
"""


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG)
    srv = start_server({"KM_OTHER_TOKEN": OTHER}, args=["--config", str(cfg)])
    yield srv
    srv.discard()


@pytest.fixture(scope="module")
def api(gated: Server) -> Iterator[httpx.Client]:
    with gated.client() as c:
        yield c


@pytest.fixture(scope="module")
def sid(api: httpx.Client) -> Iterator[str]:
    s = api.post("/v1/sessions", json={}).json()["session_id"]
    yield s
    api.delete(f"/v1/sessions/{s}")


def _finish(api: httpx.Client, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        p = api.get(f"/v1/runs/{run_id}", params={"wait_seconds": 30}).json()
        if p["done"]:
            return p["result"]
    raise AssertionError("the run did not end")


def _bumps(api: httpx.Client, sid: str) -> int:
    return int(api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.bumps()"}).json()["result"])


def test_a_forged_request_is_gated_too_and_a_deny_never_reaches_the_tool(api: httpx.Client, sid: str) -> None:
    before = _bumps(api, sid)
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("f" * 32)})
    assert r.status_code == 202 and r.json()["status"] == "awaiting_approval", r.text
    run_id = r.json()["run_id"]
    [pending] = r.json()["pending_approvals"]
    assert pending["tool"] == "bump"
    assert api.post(f"/v1/runs/{run_id}/approvals/{pending['call_id']}",
                    json={"approve": False}).status_code == 200
    reply = json.loads(_finish(api, run_id)["stdout"].strip().splitlines()[-1])
    assert reply["ok"] is False and reply["denied"] is True
    assert _bumps(api, sid) == before  # the tool never ran


def test_a_reused_call_id_cannot_answer_another_call(api: httpx.Client, sid: str) -> None:
    """The kernel picks the request's id: an id already decided gets a fresh one, so a decision
    made for one call cannot be replayed onto another."""
    first = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("e" * 32)}).json()
    api.post(f"/v1/runs/{first['run_id']}/approvals/{first['pending_approvals'][0]['call_id']}",
             json={"approve": True})
    _finish(api, first["run_id"])
    second = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE % ("e" * 32)}).json()
    [pending] = second["pending_approvals"]
    assert pending["call_id"] != first["pending_approvals"][0]["call_id"]
    api.post(f"/v1/runs/{second['run_id']}/approvals/{pending['call_id']}", json={"approve": False})
    _finish(api, second["run_id"])


def test_another_tenant_or_no_token_cannot_decide(
        api: httpx.Client, sid: str, gated: Server) -> None:
    before = _bumps(api, sid)
    body = api.post(f"/v1/sessions/{sid}/execute", json={"code": "tools.bump()"}).json()
    url = f"/v1/runs/{body['run_id']}/approvals/{body['pending_approvals'][0]['call_id']}"
    with gated.client(OTHER) as other:
        r = other.post(url, json={"approve": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    with gated.client("not-a-token") as nobody:
        assert nobody.post(url, json={"approve": True}).status_code == 401
    api.post(url, json={"approve": False})
    result = _finish(api, body["run_id"])
    assert result["error"]["ename"] == "ToolDenied"
    assert _bumps(api, sid) == before


BLOB = 3 * 1024 * 1024  # the case: gated calls of 3 MB each, left pending
N = 30  # of them per session
# Gated requests forged onto the stdin channel without waiting for replies (so they are all in
# flight at once), then one small call whose arrival in the listing tells the test that every
# big one was handled; then every reply is read and printed.
FLOOD = """
import json, sys, uuid, zmq
kernel = get_ipython().kernel
marker = sys.modules['kernelmode_preamble'].MARKER
parent, ident = kernel.get_parent("shell"), kernel._parent_ident["shell"]
def ask(arguments):
    request = json.dumps({"id": uuid.uuid4().hex, "tool": "bump", "arguments": arguments})
    kernel.session.send(kernel.stdin_socket, "input_request", {"prompt": marker + request, "password": False},
                        parent, ident=ident)
def read(n, replies):
    poller = zmq.Poller()
    poller.register(kernel.stdin_socket, zmq.POLLIN)
    while len(replies) < n and poller.poll(120_000):
        replies.append(json.loads(kernel.session.recv(kernel.stdin_socket)[1]["content"]["value"]))
blob = "x" * %(size)d
replies = []
for _ in range(%(n)d):
    ask({"blob": blob})
del blob
read(%(refused)d, replies)
ask({"done": True})
read(%(n)d + 1, replies)
print(json.dumps(replies))
"""


def _flood(api: httpx.Client, sid: str, n: int, pending: int) -> str:
    """Start the flood in ``sid``; return its run once the marker call is listed."""
    r = api.post(f"/v1/sessions/{sid}/execute", json={
        "code": FLOOD % {"size": BLOB, "n": n, "refused": n - pending}, "timeout_seconds": 600})
    assert r.status_code in (200, 202), r.text
    run_id = r.json()["run_id"]

    def listed() -> list[dict[str, Any]] | None:
        p = api.get(f"/v1/runs/{run_id}").json()
        assert not p["done"], p
        shown = p["pending_approvals"]
        return shown if any(a["arguments"] == {"done": True} for a in shown) else None

    wait_for(listed, "the flood's last call in the listing", timeout=300)
    return run_id


def _deny_all(api: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    """Deny what the run has pending; the replies the kernel got (its last stdout line)."""
    for a in api.get(f"/v1/runs/{run_id}").json()["pending_approvals"]:
        api.post(f"/v1/runs/{run_id}/approvals/{a['call_id']}", json={"approve": False})
    result = _finish(api, run_id)
    assert result["status"] == "ok", result
    return json.loads(result["stdout"].strip().splitlines()[-1])


def _rss_mb(srv: Server) -> float:
    """The manager's RSS and its Kernel Gateway's (which relays the kernel's requests), in MB."""
    pids = [srv.proc.pid]
    for child in Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split():
        if b"kernel_gateway" in Path(f"/proc/{child}/cmdline").read_bytes().replace(b"-", b"_"):
            pids.append(int(child))
    assert len(pids) == 2, pids
    return sum(rss_kb(p) for p in pids) / 1024


def test_pending_approvals_are_bounded_and_pin_no_memory(api: httpx.Client, gated: Server) -> None:
    """Sixty 3 MB gated calls (forty pinned 500 MB before) from two sessions of one tenant: per
    session at most 8 MiB wait (two calls), per tenant at most 10 MiB (one more); the rest are
    refused at once with the bound's name; the manager's RSS grows by a fraction of what was
    sent; another tenant's session still gets its calls put up for approval."""
    sids = [api.post("/v1/sessions", json={}).json()["session_id"] for _ in range(2)]
    before = min(_rss_mb(gated) for _ in range(3))
    runs = [_flood(api, sids[0], N, pending=2), _flood(api, sids[1], N, pending=1)]
    grown_mb = _rss_mb(gated) - before
    sent_mb = 2 * N * BLOB / 1024 / 1024
    listings = [api.get(f"/v1/runs/{r}").json()["pending_approvals"] for r in runs]
    assert [len(x) for x in listings] == [3, 2]  # the big calls that fit, and each marker
    assert all(len(json.dumps(a["arguments"])) < 5_000 for x in listings for a in x)  # a preview
    with gated.client(OTHER) as other:  # the full tenant takes no room from another
        osid = other.post("/v1/sessions", json={}).json()["session_id"]
        orun = _flood(other, osid, 1, pending=1)
        assert len(other.get(f"/v1/runs/{orun}").json()["pending_approvals"]) == 2
        assert [x["denied"] for x in _deny_all(other, orun)] == [True, True]
        other.delete(f"/v1/sessions/{osid}")
    replies = [_deny_all(api, r) for r in runs]
    for got, refused, bound in ((replies[0], N - 2, "max_pending_approval_bytes_per_session"),
                                (replies[1], N - 1, "max_pending_approval_bytes_per_tenant")):
        assert len(got) == N + 1 and all(x["ok"] is False and x["denied"] for x in got)
        bounded = [x["error"] for x in got if "was not put up for approval" in x["error"]]
        assert len(bounded) == refused and all(bound in e for e in bounded), bounded[:1]
    for sid in sids:
        api.delete(f"/v1/sessions/{sid}")
    print(f"RSS growth {grown_mb:.0f} MB for {sent_mb:.0f} MB sent")
    assert grown_mb < sent_mb / 4, (grown_mb, sent_mb)
