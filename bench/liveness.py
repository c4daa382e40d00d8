"""Manager-owned liveness (sessions/liveness.py): how long until a kernel that stops answering
is reported lost, and what the gateway does meanwhile.

Run:  .venv/bin/python bench/liveness.py [--reps N] [--no-cluster] [--no-write]

1. frozen kernel, embedded gateway (bwrap): a session runs `time.sleep(600)`; its kernel's
   processes get SIGSTOP (alive to the gateway, never answering: a blackholed node's kernel).
   Time from the SIGSTOP until the run's result (kernel_died, cause lost) is readable, and the
   next run (a fresh kernel) takes. With the default probe settings (5 s / 10 s / 3 misses) and
   fast ones (1 s / 2 s / 2).
2. Enterprise Gateway rig (tests/cluster; needs root and `make setup-cluster`; skipped with
   --no-cluster): two sessions per node, a run in flight on node a; node a killed (every
   process of its namespace) or, on a fresh rig, blackholed (nftables drop all). Time until the
   run's result is readable and until every session of node a is `dead` with a cause; the
   longest answer of EG's `GET /api/kernels` and the manager's `GET /v1/sessions` meanwhile (EG
   freezes on a blackholed node: that is its figure). Probe settings 1 s / 3 s / 2 misses,
   launch timeout 30 s.

Results go to bench/RESULTS.md, section "liveness" (unless --no-write).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

import httpx
from harness import BENCH, loadavg, write_section
from servers import KmServer

from tests.support.procfs import processes_mentioning
from tests.support.server import Server

DEFAULTS = {"KERNELMODE_GATEWAY__PROBE_INTERVAL_SECONDS": "5", "KERNELMODE_GATEWAY__PROBE_TIMEOUT_SECONDS": "10",
            "KERNELMODE_GATEWAY__PROBE_MISSES": "3"}
FAST = {"KERNELMODE_GATEWAY__PROBE_INTERVAL_SECONDS": "1", "KERNELMODE_GATEWAY__PROBE_TIMEOUT_SECONDS": "2",
        "KERNELMODE_GATEWAY__PROBE_MISSES": "2"}
SLEEP = "import time\ntime.sleep(600)"


def _signal(text: str, sig: int) -> None:
    for pid in processes_mentioning(text):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_done(c: httpx.Client, run_id: str, bound: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        p = c.get(f"/v1/runs/{run_id}", params={"wait_seconds": 0.5}).json()
        if p["done"]:
            return dict(p["result"])
    raise RuntimeError(f"run {run_id} did not end within {bound} s")


def frozen_kernel(label: str, env: dict[str, str], reps: int) -> dict[str, Any]:
    km = KmServer("frozen", {"KERNELMODE_SESSIONS__POOL_SIZE": "1", **env})
    detect, nxt, causes = [], [], []
    try:
        km.start()
        assert km.srv is not None
        with km.srv.client(timeout=600) as c:
            for i in range(reps):
                sid = f"f{i}"
                assert c.post("/v1/sessions", json={"session_id": sid}).status_code == 201
                c.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"})
                kernel = c.get(f"/v1/sessions/{sid}").json()["kernel_id"]
                rid = c.post(f"/v1/sessions/{sid}/execute", json={"code": SLEEP, "timeout_seconds": 900,
                                                                   "wait_seconds": 0.5}).json()["run_id"]
                t0 = time.monotonic()
                _signal(f"run/{kernel}", signal.SIGSTOP)
                result = _wait_done(c, rid)
                detect.append(time.monotonic() - t0)
                causes.append(result["cause"]["kind"] if result["cause"] else None)
                t1 = time.monotonic()
                r = c.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()
                nxt.append(time.monotonic() - t1)
                assert r["status"] == "ok", r
                _signal(f"run/{kernel}", signal.SIGCONT)
                c.delete(f"/v1/sessions/{sid}")
    finally:
        asyncio.run(km.stop())  # kills what is left (a kernel still stopped, say)
    return {"label": label, "detect": detect, "next": nxt, "causes": causes}


class Slowest(threading.Thread):
    """Asks EG and the manager for an answer again and again; keeps the slowest of each."""

    def __init__(self, srv: Server, eg: Any) -> None:
        super().__init__(daemon=True)
        self.srv, self.eg = srv, eg
        self.slowest = {"manager": 0.0, "eg": 0.0}
        self.stop = threading.Event()

    def run(self) -> None:
        with self.srv.client(timeout=600) as c:
            while not self.stop.is_set():
                for name, call in (("manager", lambda: c.get("/v1/sessions")),
                                   ("eg", lambda: self.eg.request("GET", "/api/kernels"))):
                    t = time.monotonic()
                    with contextlib.suppress(httpx.HTTPError):
                        call()
                    self.slowest[name] = max(self.slowest[name], time.monotonic() - t)
                time.sleep(0.2)


def node_failure(how: str) -> dict[str, Any]:
    from tests.support.cluster import eg as eg_mod
    from tests.support.cluster import rig as rig_mod
    from tests.support.cluster.failures import BLACKHOLE, node_of
    from tests.support.cluster.failures import FAST as CLUSTER_FAST

    rig = rig_mod.claim()
    eg = km = None
    try:
        eg = eg_mod.start(rig)
        km = KmServer("node", {**eg.env(), **CLUSTER_FAST})
        km.start()
        srv = km.srv
        assert srv is not None
        with srv.client(timeout=600) as c:
            on: dict[str, list[str]] = {"a": [], "b": []}
            for i in range(8):
                sid = f"s{i}"
                c.post("/v1/sessions", json={"session_id": sid})
                on[node_of(c, rig, sid)].append(sid)
                if all(len(v) >= 2 for v in on.values()):
                    break
            rid = c.post(f"/v1/sessions/{on['a'][0]}/execute",
                         json={"code": SLEEP, "timeout_seconds": 900, "wait_seconds": 0.5}).json()["run_id"]
            watch = Slowest(srv, eg)
            watch.start()
            t0 = time.monotonic()
            if how == "killed":
                rig.kill_node(rig.node("a"))
            else:
                rig_mod._run(rig_mod.IP, "netns", "exec", rig.node("a").netns, rig_mod.NFT, "-f", "-",
                             input=BLACKHOLE)
            result = _wait_done(c, rid)
            run_end = time.monotonic() - t0
            deadline = time.monotonic() + 600
            while any(c.get(f"/v1/sessions/{sid}").json()["status"] != "dead" for sid in on["a"][1:]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the node's sessions were not reported dead")
                time.sleep(0.5)
            all_dead = time.monotonic() - t0
            watch.stop.set()
            watch.join(660)
        return {"how": how, "run_end": run_end, "all_dead": all_dead, "cause": result["cause"],
                "eg_slowest": watch.slowest["eg"], "manager_slowest": watch.slowest["manager"]}
    finally:
        if km is not None:
            asyncio.run(km.stop())
        if eg is not None:
            eg.stop()
        rig.down()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} / {max(xs):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-cluster", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    t_start, load = time.monotonic(), loadavg()
    frozen = [frozen_kernel("defaults (5 s / 10 s / 3)", DEFAULTS, args.reps),
              frozen_kernel("fast (1 s / 2 s / 2)", FAST, args.reps)]
    nodes: list[dict[str, Any]] = []
    if not args.no_cluster:
        from tests.support.cluster import eg as eg_mod
        from tests.support.cluster import rig as rig_mod

        why = rig_mod.missing() or eg_mod.missing()
        if why:
            print(f"cluster part skipped: {why}")
        else:
            nodes = [node_failure("killed"), node_failure("blackholed")]
    lines = [
        "## Liveness: how fast a kernel that stops answering is reported lost (bench/liveness.py)", "",
        f"Generated by `bench/liveness.py --reps {args.reps}`; wall time {time.monotonic() - t_start:.0f} s; "
        f"load average at the start {load}. The machine is shared and busy (other engineers' runs): "
        "absolute times move; they are bounded by the probe settings, not by the machine.", "",
        "Frozen kernel (SIGSTOP of its processes), embedded gateway, bwrap: seconds from the SIGSTOP "
        "until the run in flight is readable as `kernel_died` (median / max), and the next run on a "
        "fresh kernel.", "",
        "| probe settings (interval / timeout / misses) | runs | detected, s | next run, s | causes |",
        "|---|---|---|---|---|",
    ]
    for f in frozen:
        lines.append(f"| {f['label']} | {len(f['detect'])} | {_fmt(f['detect'])} | {_fmt(f['next'])} | "
                     f"{', '.join(sorted(set(map(str, f['causes']))))} |")
    if nodes:
        lines += ["", "Enterprise Gateway rig (2 nodes over SSH), probe 1 s / 3 s / 2 misses, launch timeout 30 s; "
                  "one run each:", "",
                  "| node | run in flight ended, s | all its sessions dead, s | cause of the run | "
                  "slowest EG answer meanwhile, s | slowest manager answer, s |", "|---|---|---|---|---|---|"]
        for n in nodes:
            lines.append(f"| {n['how']} | {n['run_end']:.1f} | {n['all_dead']:.1f} | {n['cause']['kind']} | "
                         f"{n['eg_slowest']:.1f} | {n['manager_slowest']:.2f} |")
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", "liveness", body)
    print("SUMMARY " + json.dumps({f["label"]: round(statistics.median(f["detect"]), 1) for f in frozen}
                                  | {n["how"]: round(n["all_dead"], 1) for n in nodes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
