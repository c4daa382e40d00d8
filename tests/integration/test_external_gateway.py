"""`serve` with `gateway.url`: a real Kernel Gateway that the test starts and owns (same host,
same data dir: the disk is shared in this step), a real `serve` that starts none of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, Server, start_server
from tests.support.external_gateway import ExternalGateway, start_external_gateway
from tests.support.procfs import unmount_under

CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
"""


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[ExternalGateway, Server, Path]]:
    data_dir = Path(tempfile.mkdtemp(prefix="kmext-", dir="/tmp"))
    data_dir.chmod(0o711)
    cfg = data_dir.with_suffix(".yaml")
    cfg.write_text(CONFIG)
    gw = start_external_gateway(data_dir)
    srv = start_server({**gw.env(), "KERNELMODE_SESSIONS__POOL_SIZE": "1"}, data_dir=data_dir,
                       args=["--config", str(cfg)])
    try:
        yield gw, srv, cfg
    finally:
        srv.stop()
        gw.stop()
        unmount_under(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
        for p in (cfg, data_dir.with_suffix(".log"), gw.log_path):
            p.unlink(missing_ok=True)


def _run(c, sid: str, code: str, **opts: object) -> dict:  # noqa: ANN001
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_runs_tools_and_pool_on_the_external_gateway(setup):
    gw, srv, _ = setup
    with srv.client() as c:
        ready = c.get("/readyz").json()["checks"]
        assert ready["gateway"]["ok"] is True and ready["gateway"]["mode"] == "external"
        assert c.post("/v1/sessions", json={"session_id": "ext"}).status_code == 201
        kernel = c.get("/v1/sessions/ext").json()["kernel_id"]
        # The session's kernel runs on the test's gateway (the manager started none).
        assert kernel in {k["id"] for k in gw.get("/api/kernels").json()}
        assert _run(c, "ext", "x = 20")["status"] == "ok"
        r = _run(c, "ext", "tools.add(x, 22)")
        assert r["status"] == "ok" and r["result"] == "42", r
        assert r["tool_calls"][0]["tool"] == "add"
        # The warm pool refills on the external gateway too.
        deadline = time.monotonic() + 120
        while c.get("/readyz").json()["checks"]["pool"]["ready"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/readyz").json()["checks"]["pool"]["ready"] == 1
    log = srv.log()
    assert "external kernel gateway" in log
    assert "kernel gateway starting" not in log  # no gateway of its own


def test_timeout_interrupt_and_death_cause_on_the_external_gateway(setup):
    _, srv, _ = setup
    with srv.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "intr"}).status_code == 201
        _run(c, "intr", "kept = 'yes'")
        r = _run(c, "intr", "import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_seconds=1)
        assert r["status"] == "timeout" and r["state_lost"] is False and "started" in r["stdout"], r
        assert _run(c, "intr", "kept")["result"] == "'yes'"
        r = _run(c, "intr", "import os\nos._exit(3)", timeout_seconds=30)
        assert r["cause"] == {"kind": "exit", "exit_code": 3, "signal": None}, r
        r = _run(c, "intr", "'kept' in globals()")
        assert r["result"] == "False" and r["state_lost"] is True
        assert c.delete("/v1/sessions/intr").status_code in (200, 204)


def _serve_fails(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    data_dir = Path(tempfile.mkdtemp(prefix="kmextbad-", dir="/tmp"))
    try:
        return subprocess.run(
            [sys.executable, "-m", "kernelmode.cli", "serve", "--port", "0", "--data-dir", str(data_dir)],
            env={**os.environ, **env}, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_wrong_token_or_unreachable_url_fails_serve_with_a_clear_error(setup):
    gw, _, _ = setup
    bad = _serve_fails({"KERNELMODE_GATEWAY__URL": gw.url, "KERNELMODE_GATEWAY__AUTH_TOKEN": "wrong"})
    assert bad.returncode != 0 and "gateway.auth_token" in bad.stderr and "serving on" not in bad.stdout
    with __import__("socket").socket() as s:  # a loopback port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    bad = _serve_fails({"KERNELMODE_GATEWAY__URL": dead, "KERNELMODE_GATEWAY__AUTH_TOKEN": "x"})
    assert bad.returncode != 0 and "gateway.url" in bad.stderr and "unreachable" in bad.stderr


def test_stop_leaves_the_gateway_and_a_restarted_serve_adopts_the_sessions(setup):
    gw, srv, cfg = setup
    with srv.client() as c:
        assert c.post("/v1/sessions", json={"session_id": "keep"}).status_code == 201
        assert c.post("/v1/sessions", json={"session_id": "gone"}).status_code == 201
        _run(c, "keep", "v = 41")
        kept = c.get("/v1/sessions/keep").json()["kernel_id"]
        gone = c.get("/v1/sessions/gone").json()["kernel_id"]
    assert srv.stop() == 0
    assert gw.proc.poll() is None  # the external gateway is not the manager's to stop
    running = {k["id"] for k in gw.get("/api/kernels").json()}
    assert kept in running and gone in running
    # A kernel that vanishes while no manager runs.
    r = httpx.delete(f"{gw.url}/api/kernels/{gone}", headers={"Authorization": f"token {gw.token}"})
    assert r.status_code == 204
    srv2 = start_server(gw.env(), data_dir=srv.data_dir, args=["--config", str(cfg)])
    try:
        with srv2.client() as c:
            assert c.get("/v1/sessions/keep").json()["status"] == "idle"
            r = _run(c, "keep", "v + 1")
            assert r["result"] == "42" and r["state_lost"] is False, r
            assert c.get("/v1/sessions/gone").json()["status"] == "lost"
        log = srv2.log()
        assert "survived: ext, keep; lost: none" in log, log[-3000:]
        assert "marked lost: gone" in log, log[-3000:]
    finally:
        srv2.stop()


def test_a_failing_launch_is_retried_then_answered_503_naming_the_cause(setup):
    gw, srv, _ = setup
    env = {**gw.env(), "KERNELMODE_GATEWAY__KERNEL_NAME": "no-such-kernelspec",
           "KERNELMODE_GATEWAY__LAUNCH_ATTEMPTS": "2", "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    bad = start_server(env)
    try:
        with bad.client() as c:
            r = c.post("/v1/sessions", json={"session_id": "nope"})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "kernel_unavailable" and "2 attempt(s)" in err["message"], err
            # The gateway's own answer (its message, not the traceback around it).
            assert "POST /api/kernels failed with 500: Unknown server error" in err["message"], err
            assert c.get("/v1/sessions/nope").status_code == 404  # nothing half-made is left
        events = [json.loads(x) for x in bad.log().splitlines() if x.startswith('{"ts"')]
        assert [e["attempt"] for e in events if e["event"] == "kernel_start_failed"] == [1]
    finally:
        bad.discard()


def test_doctor_reports_the_external_mode(setup):
    gw, _, _ = setup
    data_dir = Path(tempfile.mkdtemp(prefix="kmextdoc-", dir="/tmp"))
    try:
        cmd = [sys.executable, "-m", "kernelmode.cli", "doctor", "--json", "--data-dir", str(data_dir), "--port", "0"]
        ok = subprocess.run(cmd, env={**os.environ, **gw.env()}, cwd=str(REPO), capture_output=True,
                            text=True, timeout=120)
        check = {c["name"]: c for c in json.loads(ok.stdout)["checks"]}["gateway config"]
        assert check["status"] == "ok" and check["detail"].startswith(f"external (serve starts none): {gw.url}")
        bad = subprocess.run(cmd, env={**os.environ, **gw.env(), "KERNELMODE_GATEWAY__AUTH_TOKEN": "wrong"},
                             cwd=str(REPO), capture_output=True, text=True, timeout=120)
        check = {c["name"]: c for c in json.loads(bad.stdout)["checks"]}["gateway config"]
        assert check["status"] == "fail" and "gateway.auth_token" in check["detail"]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_restarted_external_gateway_is_noticed_and_its_lost_sessions_named(setup):
    gw, srv, cfg = setup  # runs last: the earlier tests stopped the fixture's serve
    srv3 = start_server(gw.env(), data_dir=srv.data_dir, args=["--config", str(cfg)])
    gw2 = None
    try:
        with srv3.client() as c:
            assert _run(c, "keep", "v")["result"] == "41"  # adopted again
            gw.stop()  # a SIGTERM'd gateway shuts its kernels down
            port = int(gw.url.rsplit(":", 1)[1])
            gw2 = start_external_gateway(srv.data_dir, port=port, token=gw.token)
            deadline = time.monotonic() + 60
            while "answers again" not in srv3.log() and time.monotonic() < deadline:
                time.sleep(0.2)
            info = c.get("/v1/sessions/keep").json()
            assert info["status"] == "dead" and info["cause"]["kind"] == "lost", info
            assert "no longer runs" in info["cause"]["detail"]
            r = _run(c, "keep", "'v' in globals()")
            assert r["status"] == "ok" and r["result"] == "False" and r["state_lost"] is True, r
            assert c.get("/readyz").json()["checks"]["gateway"]["ok"] is True
        assert "lost (kernel gone): ext, keep" in srv3.log(), srv3.log()[-3000:]
    finally:
        srv3.stop()
        if gw2 is not None:
            gw2.stop()
