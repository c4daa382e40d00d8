"""Prometheus metrics of one service (``GET /metrics``), with the prometheus_client library.

Counters and the run-duration histogram are updated where things happen (the SessionManager);
gauges (live sessions by status; the warm pool's ready count and its configured size) are read
from the manager when scraped.

Every label value comes from the server's own vocabulary, never from what a kernel or a client
sent: each series lives until restart, so a label fed from a forged value lets kernel code grow
``/metrics`` (and the manager's memory) without bound. Statuses, sources, causes and reasons are
the server's literals, tenants are configured; a tool name is kept only if the server knows that
tool (``known_tool``), else counted as ``other``.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .models import RunResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LiveState(Collector):
    def __init__(self, read: Callable[[], tuple[dict[str, int], int, int]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        by_status, pool_ready, pool_size = self.read()
        live = GaugeMetricFamily("kernelmode_sessions", "Sessions by status (live ones, and lost ones "
                                 "of an earlier run)", labels=["status"])
        for status, n in sorted(by_status.items()):
            live.add_metric([status], n)
        yield live
        yield GaugeMetricFamily("kernelmode_pool_ready", "Warm kernels ready to be handed out", value=pool_ready)
        yield GaugeMetricFamily("kernelmode_pool_size", "Configured warm pool size", value=pool_size)


OTHER_TOOL = "other"  # the tool label of a call to a name the server does not know


class Metrics:
    def __init__(self, known_tool: Callable[[str], bool] = lambda _name: False) -> None:
        self.known_tool = known_tool
        # A registry of its own: several services in one process (tests, library mode) do not mix.
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Tenants are configured (few), so a tenant label keeps the series count small.
        self.runs = Counter("kernelmode_runs", "Runs by final status, where they came from and tenant",
                            ["status", "source", "tenant"], registry=r)
        self.run_seconds = Histogram(
            "kernelmode_run_duration_seconds", "Wall time of runs (queueing excluded)", ["source"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600), registry=r)
        self.deaths = Counter("kernelmode_kernel_deaths", "Kernels that died in a run, by cause", ["cause"],
                              registry=r)
        self.tool_calls = Counter("kernelmode_tool_calls", "Host tool calls from kernel code",
                                  ["tool", "outcome"], registry=r)
        self.artifact_bytes = Counter("kernelmode_artifact_bytes", "Bytes of artifacts kept", registry=r)
        self.artifacts = Counter("kernelmode_artifacts", "Artifacts kept", registry=r)
        self.sessions_created = Counter("kernelmode_sessions_created", "Sessions created",
                                        ["from_pool", "tenant"], registry=r)
        self.sessions_ended = Counter("kernelmode_sessions_ended", "Sessions deleted or reaped",
                                      ["reason", "tenant"], registry=r)
        self.gateway_restarts = Counter("kernelmode_gateway_restarts",
                                        "Kernel Gateway deaths followed by a restart", registry=r)
        # decision: allowed | refused (the proxy's own vocabulary, never a host name).
        self.egress_connections = Counter("kernelmode_egress_connections", "Connections to the egress "
                                          "proxy, by decision", ["decision"], registry=r)
        self.egress_bytes = Counter("kernelmode_egress_bytes", "Bytes (up and down) moved by the "
                                    "egress proxy", registry=r)
        self.mcp_fast_calls = Counter("kernelmode_mcp_fast_calls", "MCP tool calls answered on the "
                                      "direct route (mcp.fast_calls) instead of through the SDK", registry=r)

    def watch(self, read: Callable[[], tuple[dict[str, int], int, int]]) -> None:
        """``read() -> ({status: count}, pool kernels ready now, configured pool size)``, called at
        each scrape (and once when registered)."""
        self.registry.register(_LiveState(read))

    def observe_run(self, result: RunResult, tenant: str, source: str = "api") -> None:
        self.runs.labels(result.status, source, tenant).inc()
        self.run_seconds.labels(source).observe(result.duration_ms / 1000)
        if result.status == "kernel_died":
            self.deaths.labels(result.cause.kind if result.cause else "unknown").inc()
        for (tool, ok), n in Tally((self.tool_label(c.tool), c.ok) for c in result.tool_calls).items():
            self.tool_calls.labels(tool, "ok" if ok else "error").inc(n)
        if result.artifacts:
            self.artifacts.inc(len(result.artifacts))
            self.artifact_bytes.inc(sum(a.size_bytes for a in result.artifacts))

    def tool_label(self, name: str) -> str:
        """``name`` if it is one of the server's tools (or its own reserved calls), else ``other``."""
        return name if name != OTHER_TOOL and self.known_tool(name) else OTHER_TOOL

    def render(self) -> bytes:
        return generate_latest(self.registry)
