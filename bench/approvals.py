"""What the approval gate and the code policy cost (issue 17).

Run:  .venv/bin/python bench/approvals.py [--samples N] [--no-write]

Two `kernelmode serve`s at once (one warm session each), the same tools on both; the second has
`policy.module: examples.code_policy:check`. Interleaved round by round (machine noise hits all
paths alike), each a REST execute of one tool call, timed by the client:

  plain     `tools.add(a=1, b=2)` on the server without a policy: the reference;
  policy    the same on the server with the example policy (ast-parses the code before each run);
  gated     `tools.gated(a=1, b=2)` (requires_approval) without a policy: the execute answers
            202 awaiting_approval, the client POSTs the approval at once, then long-polls
            GET /v1/runs/{id} until the run ends; the whole exchange (three requests);
  decided   of `gated`, from sending the approval to having the final result.

What counts is the difference to `plain` measured in the same run: the gate's and the hook's
own overhead (a person's answer takes seconds to minutes; this is the machinery around it).
Results go to a section of bench/RESULTS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import BENCH, Http, Stats, interleave, loadavg, ms_since, run_stoppable, write_section
from servers import KmServer

SECTION = "approvals"
CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: gated, function: "tests.integration.host_tools:add", requires_approval: true}
mcp_servers: []
"""


async def execute(conn: Http, sid: str, code: str) -> tuple[int, Any]:
    return await conn.json("POST", f"/v1/sessions/{sid}/execute", {"code": code})


async def main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="km-bench-approvals-"))
    plain_cfg, policy_cfg = tmp / "plain.yaml", tmp / "policy.yaml"
    plain_cfg.write_text(CONFIG)
    policy_cfg.write_text(CONFIG + 'policy: {module: "examples.code_policy:check"}\n')
    env = {"KERNELMODE_SESSIONS__POOL_SIZE": "1"}
    servers = [KmServer("plain", env, args=["--config", str(plain_cfg)]),
               KmServer("policy", env, args=["--config", str(policy_cfg)])]
    load_start = loadavg()
    try:
        for s in servers:
            s.start()
        (a, b) = [s.http() for s in servers]
        sid_a = (await servers[0].create({}))["session_id"]
        sid_b = (await servers[1].create({}))["session_id"]
        decided = Stats("decided")

        async def plain() -> float:
            t0 = time.perf_counter_ns()
            status, body = await execute(a, sid_a, "tools.add(a=1, b=2)")
            assert status == 200 and body["result"] == "3", body
            return ms_since(t0)

        async def policy() -> float:
            t0 = time.perf_counter_ns()
            status, body = await execute(b, sid_b, "tools.add(a=1, b=2)")
            assert status == 200 and body["result"] == "3", body
            return ms_since(t0)

        async def gated() -> float:
            t0 = time.perf_counter_ns()
            status, body = await execute(a, sid_a, "tools.gated(a=1, b=2)")
            assert status == 202 and body["status"] == "awaiting_approval", body
            run_id, call_id = body["run_id"], body["pending_approvals"][0]["call_id"]
            t1 = time.perf_counter_ns()
            status, _ = await a.json("POST", f"/v1/runs/{run_id}/approvals/{call_id}", {"approve": True})
            assert status == 200
            while True:
                status, p = await a.json("GET", f"/v1/runs/{run_id}?wait_seconds=30")
                if p["done"]:
                    break
            assert p["result"]["result"] == "3", p
            decided.samples.append(ms_since(t1))
            return ms_since(t0)

        stats = {n: Stats(n) for n in ("plain", "policy", "gated")}
        await interleave({"plain": plain, "policy": policy, "gated": gated}, stats, args.samples,
                         batch=10, warmup=3)
        decided.samples = decided.samples[3:]  # the warm-up's
        rows = [stats["plain"], stats["policy"], stats["gated"], decided]
        base = stats["plain"].median
        table = ["| path | n | median ms | p90 ms | median - plain |", "|---|---|---|---|---|"]
        for st in rows:
            extra = f"{st.median - base:+.1f} ms" if st.name in ("policy", "gated") else ""
            table.append(f"| {st.name} | {st.n} | {st.median:.1f} | {st.pct(90):.1f} | {extra} |")
        body = "\n".join([
            "## Approval gate and code policy: their own overhead",
            "",
            f"`python bench/approvals.py --samples {args.samples}` (bench/approvals.py), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, bwrap, two servers at once, "
            f"interleaved. The machine is shared and busy (load average at the start: {load_start}): "
            "absolute figures are noisy; the differences within this run are what count.",
            "",
            *table,
            "",
            "`gated` is three requests (execute answering 202, the approval, the long-poll for the "
            "end) instead of one; `decided` is the approval's way to the kernel and back. The "
            "`policy` difference is the example policy (an `ast` parse in a worker thread) per run.",
        ])
        print(body)
        if not args.no_write:
            write_section(BENCH / "RESULTS.md", SECTION, body)
        print("SUMMARY " + json.dumps({s.name: round(s.median, 2) for s in rows}))
        return 0
    finally:
        for s in servers:
            await s.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--no-write", action="store_true")
    sys.exit(run_stoppable(main, p.parse_args()))
