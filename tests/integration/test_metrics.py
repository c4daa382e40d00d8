"""GET /metrics: Prometheus text that counts what really happened (parsed with prometheus_client)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
        assert value(after, "kernelmode_runs_total", status=status, source="api") == \
            value(before, "kernelmode_runs_total", status=status, source="api") + 1, status
    assert value(after, "kernelmode_kernel_deaths_total", cause="exit") == \
        value(before, "kernelmode_kernel_deaths_total", cause="exit") + 1
    assert value(after, "kernelmode_artifact_bytes_total") >= value(before, "kernelmode_artifact_bytes_total") + 5
    created = sum(v for (n, _), v in after.items() if n == "kernelmode_sessions_created_total")
    assert created >= 1
    assert value(after, "kernelmode_run_duration_seconds_count", source="api") >= 3
    assert value(after, "kernelmode_sessions", status="idle") + value(after, "kernelmode_sessions", status="restarting") >= 1
    assert ("kernelmode_pool_size", ()) in after
    api.delete(f"/v1/sessions/{sid}")
    assert value(scrape(api), "kernelmode_sessions_ended_total", reason="closed") >= 1


def test_metrics_need_the_token(server: Server) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401
