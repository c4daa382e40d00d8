"""What a failing node of the Enterprise Gateway rig is made of, shared by
tests/cluster/test_node_failures.py and bench/liveness.py: quick liveness settings, the
nftables table that blackholes a node, and which node a session's kernel runs on."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.cluster import rig as rig_mod

WHERE = "import subprocess; subprocess.run(['hostname', '-I'], capture_output=True, text=True).stdout.split()[0]"
# Liveness made quick for the test (the defaults are 5 s / 10 s / 3).
FAST = {
    "KERNELMODE_SESSIONS__POOL_SIZE": "0",
    "KERNELMODE_GATEWAY__PROBE_INTERVAL_SECONDS": "1",
    "KERNELMODE_GATEWAY__PROBE_TIMEOUT_SECONDS": "3",
    "KERNELMODE_GATEWAY__PROBE_MISSES": "2",
    "KERNELMODE_GATEWAY__LAUNCH_TIMEOUT_SECONDS": "30",
    "KERNELMODE_GATEWAY__LAUNCH_ATTEMPTS": "3",
    "KERNELMODE_GATEWAY__SHUTDOWN_TIMEOUT_SECONDS": "10",
}
BLACKHOLE = """table inet kmblackhole {
    chain input { type filter hook input priority -10; policy drop; }
    chain output { type filter hook output priority -10; policy drop; }
}
"""


def run(c: httpx.Client, sid: str, code: str, **opts: object) -> dict[str, Any]:
    r = c.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts}, timeout=300)
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


def node_of(c: httpx.Client, rig: rig_mod.Rig, sid: str) -> str:
    r = run(c, sid, WHERE)
    assert r["status"] == "ok", r
    node = rig.node_of(json.loads(r["result"].replace("'", '"')))
    assert node is not None, r
    return node.name
