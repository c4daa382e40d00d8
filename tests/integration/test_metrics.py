"""GET /metrics: Prometheus text that counts what really happened (parsed with prometheus_client)."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kernelmode.config import Settings
from tests.conftest import Server


def scrape(api: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_runs_deaths_sessions(api: httpx.Client, session_factory, run, server: Server) -> None:
    before = scrape(api)
    sid = session_factory()
    run(sid, "open('/mnt/data/m.txt', 'w').write('12345')")
    run(sid, "1/0")
    run(sid, "import os; os._exit(2)")
    after = scrape(api)
    for status in ("ok", "error", "kernel_died"):
        assert value(after, "kernelmode_runs_total", status=status, source="api", tenant="admin") == \
            value(before, "kernelmode_runs_total", status=status, source="api", tenant="admin") + 1, status
    assert value(after, "kernelmode_kernel_deaths_total", cause="exit") == \
        value(before, "kernelmode_kernel_deaths_total", cause="exit") + 1
    assert value(after, "kernelmode_artifact_bytes_total") >= value(before, "kernelmode_artifact_bytes_total") + 5
    created = sum(v for (n, _), v in after.items() if n == "kernelmode_sessions_created_total")
    assert created >= 1
    assert value(after, "kernelmode_run_duration_seconds_count", source="api") >= 3
    assert value(after, "kernelmode_sessions", status="idle") + value(after, "kernelmode_sessions", status="restarting") >= 1
    assert ("kernelmode_pool_size", ()) in after
    api.delete(f"/v1/sessions/{sid}")
    assert value(scrape(api), "kernelmode_sessions_ended_total", reason="closed", tenant="admin") >= 1


def test_metrics_need_the_token(server: Server) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401


def _audit(server: Server, session_id: str) -> list[dict]:
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith('{"ts"')]
    return [x for x in lines if x.get("session_id") == session_id]


def test_audit_line_per_session_event_and_run(api: httpx.Client, server: Server, run) -> None:
    """One JSON line per session event and run on stderr (logger kernelmode.audit), with the tenant."""
    sid = api.post("/v1/sessions", json={}).json()["session_id"]
    ok = run(sid, "x = 1")
    died = run(sid, "import os; os._exit(3)")
    assert died["status"] == "kernel_died"
    api.delete(f"/v1/sessions/{sid}")
    deadline = time.monotonic() + 10  # stderr is written by another process
    while time.monotonic() < deadline and not any(x["event"] == "session_closed" for x in _audit(server, sid)):
        time.sleep(0.1)
    lines = _audit(server, sid)
    events = [x["event"] for x in lines]
    assert events[0] == "session_created" and events[-1] == "session_closed", events
    assert events.count("run") == 2, events
    by_run = {x["run_id"]: x for x in lines if x["event"] == "run"}
    assert by_run[ok["run_id"]]["status"] == "ok"
    assert by_run[died["run_id"]]["status"] == "kernel_died"
    assert by_run[died["run_id"]]["cause"] == {"kind": "exit", "exit_code": 3, "signal": None}
    assert {x["tenant"] for x in lines} == {"admin"}
    assert lines[-1]["reason"] == "closed"
    assert all(x["ts"].endswith("+00:00") for x in lines)


def test_pool_gauges_say_configured_size_and_ready_count(api: httpx.Client) -> None:
    """kernelmode_pool_size is the configured size (as its help says), whatever is ready now;
    kernelmode_pool_ready is the count of warm kernels ready to hand out."""
    size = api.get("/readyz").json()["checks"]["pool"]["size"]
    assert size >= 1  # the test server keeps a warm pool, so the two gauges can differ
    sid = api.post("/v1/sessions", json={}).json()["session_id"]  # takes a pool kernel
    try:
        m = scrape(api)
        assert value(m, "kernelmode_pool_size") == size
        # Above the floor after a burst (the adaptive pool), never above its ceiling.
        assert 0 <= value(m, "kernelmode_pool_ready") <= max(size, Settings().sessions.pool_max)
    finally:
        api.delete(f"/v1/sessions/{sid}")
