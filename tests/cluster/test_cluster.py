"""The manager drives Enterprise Gateway, which launches sandboxed kernels on two nodes over
SSH: sessions spread over both, variables persist, tools, interrupts, timeouts and a kernel's
death behave as with the embedded gateway, the kernels get the kernel env's IPython config, and
the manager's disk holds no workspace."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.cluster.rig import Rig

WHERE = "import subprocess; subprocess.run(['hostname', '-I'], capture_output=True, text=True).stdout.split()[0]"


def run(c, sid: str, code: str, **opts: object) -> dict:  # noqa: ANN001
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def node_of(c, rig: Rig, sid: str) -> str:  # noqa: ANN001
    """Which node the session's kernel runs on, from the kernel's own addresses."""
    r = run(c, sid, WHERE)
    assert r["status"] == "ok", r
    node = rig.node_of(json.loads(r["result"].replace("'", '"')))
    assert node is not None, r
    return node.name


def test_sessions_spread_over_both_nodes_with_state_and_tools(served, rig):
    with served.client() as c:
        nodes = {}
        for sid in ("spread-1", "spread-2", "spread-3"):
            assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
            nodes[sid] = node_of(c, rig, sid)
        assert set(nodes.values()) == {"a", "b"}, nodes  # least-connection uses both nodes
        for i, sid in enumerate(nodes):
            assert run(c, sid, f"x = {20 + i}")["status"] == "ok"
        # EG's launcher takes no IPython options: the kernel env's ipython_kernel_config.json
        # (`kernelmode setup` writes it) keeps the history in memory, with no thread.
        for sid in nodes:
            r = run(c, sid, "hm = get_ipython().history_manager\n(str(hm.hist_file), hm.save_thread is None)")
            assert r["result"] == "(':memory:', True)", (r, "the kernel env lacks it? `make setup`")
        for i, sid in enumerate(nodes):
            r = run(c, sid, "tools.add(x, 22)")
            assert r["status"] == "ok" and r["result"] == str(42 + i), r
            assert r["tool_calls"][0]["tool"] == "add"
        # The kernel's workspace is a directory on its node, not on the manager's disk.
        sid = "spread-1"
        r = run(c, sid, "import os\nopen('here.txt', 'w').write('on the node')\nos.getcwd()")
        assert r["result"] == "'/mnt/data'", r
        kernel = c.get(f"/v1/sessions/{sid}").json()["kernel_id"]
        on_node = rig.root / f"node-{nodes[sid]}" / "workspaces" / kernel / "here.txt"
        assert on_node.read_text() == "on the node"
        for sid in nodes:
            assert c.delete(f"/v1/sessions/{sid}").status_code in (200, 204)


def test_timeout_interrupt_and_kernel_death(served):
    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "intr"}).status_code == 201
        run(c, "intr", "kept = 'yes'")
        r = run(c, "intr", "import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_seconds=2)
        assert r["status"] == "timeout" and r["state_lost"] is False and "started" in r["stdout"], r
        assert run(c, "intr", "kept")["result"] == "'yes'"
        # An interrupt asked for while the cell runs (EG signals the launcher on the node).
        rid = c.post("/v1/sessions/intr/execute", json={
            "code": "import time\nprint('go', flush=True)\ntime.sleep(60)", "wait_seconds": 0}).json()["run_id"]
        deadline = time.monotonic() + 60
        while not c.get(f"/v1/runs/{rid}?wait_seconds=5").json()["events"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.post("/v1/sessions/intr/interrupt").status_code in (200, 202, 204)
        deadline = time.monotonic() + 60
        while not (status := c.get(f"/v1/runs/{rid}?offset=1&wait_seconds=5").json())["done"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["result"]["status"] == "interrupted", status
        assert run(c, "intr", "kept")["result"] == "'yes'"
        # The kernel dies: the run says so; what the remote gateway cannot tell is not guessed.
        r = run(c, "intr", "import os\nos._exit(3)", timeout_seconds=60)
        assert r["status"] == "kernel_died", r
        r = run(c, "intr", "'kept' in globals()")
        assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r
        assert c.delete("/v1/sessions/intr").status_code in (200, 204)


def test_the_managers_disk_holds_no_workspace(served):
    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "nodisk"}).status_code == 201
        assert run(c, "nodisk", "open('f.txt', 'w').write('x')")["status"] == "ok"
        data = Path(served.data_dir)
        # The file comes back only as a harvested artifact (through the kernel's channel).
        found = [p for p in data.rglob("*") if p.name == "f.txt" and "artifacts" not in p.relative_to(data).parts]
        assert found == [], found
        workspaces = data / "workspaces"
        assert not workspaces.exists() or not any(workspaces.iterdir()), list(workspaces.iterdir())
        # What needs that disk says so, by name, instead of failing somewhere further on.
        r = c.post("/v1/sessions/nodisk/packages", json={"packages": ["tabulate"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "host_only", r.text
        assert run(c, "nodisk", "1 + 1")["result"] == "2"
        assert c.delete("/v1/sessions/nodisk").status_code in (200, 204)


def test_a_restarted_gateway_is_noticed_and_the_lost_sessions_named(served, eg, rig):
    """Runs last in this module: it replaces the module's EG by a new one (same port, token)."""
    from tests.support.cluster.eg import start

    with served.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "before"}).status_code == 201
        assert run(c, "before", "v = 41")["status"] == "ok"
        eg.stop()  # a SIGTERM'd EG shuts its kernels down on the nodes
        eg2 = start(rig, port=eg.port, token=eg.token)
        try:
            deadline = time.monotonic() + 90
            while "answers again" not in served.log() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "lost (kernel gone): " in served.log() and "before" in served.log().split("lost (kernel gone): ")[-1]
            r = run(c, "before", "'v' in globals()")
            assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r
            assert c.get("/readyz").json()["checks"]["gateway"]["ok"] is True
        finally:
            eg2.stop()
