"""CPU of one forwarded request on the non-owner, against the same request served by the owner
(docs/high-availability.md "Cost").

Run:  .venv/bin/python bench/forward_cpu.py [--requests N] [--rounds R]

Two real `kernelmode serve` on one PostgreSQL store and one external Kernel Gateway
(tests/support/managers.py); a session on A; N sequential `GET /v1/sessions/{id}` and N one-line
runs, each sent to A (the owner) and to B (forwarded to A). Each manager's on-CPU time
(/proc/<pid>/task/*/schedstat) before and after, per request. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.support.managers import start_managers  # noqa: E402
from tests.support.postgres import PgCluster  # noqa: E402
from tests.support.procfs import cpu_ns  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    pg = PgCluster()
    try:
        with start_managers(2, pg.create_database("fwdcpu"), {"KERNELMODE_SESSIONS__POOL_SIZE": "0"}) as ms:
            auth = {"Authorization": f"Bearer {ms.token}"}
            with httpx.Client(base_url=ms[0].url, headers=auth, timeout=60) as a, \
                    httpx.Client(base_url=ms[1].url, headers=auth, timeout=60) as b:
                sid = a.post("/v1/sessions", json={}).json()["session_id"]
                a.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 0"})
                pids = ms[0].proc.pid, ms[1].proc.pid

                def measure(client: httpx.Client, what: str, req: Callable[[httpx.Client], httpx.Response]) -> None:
                    for _ in range(30):  # warm: connections, caches
                        req(client)
                    before, t = [cpu_ns(pid) for pid in pids], time.perf_counter()
                    for _ in range(args.requests):
                        r = req(client)
                        assert r.status_code < 300, r.text
                    wall = (time.perf_counter() - t) / args.requests * 1000
                    owner, other = ((cpu_ns(pid) - b0) / args.requests / 1e6 for pid, b0 in zip(pids, before, strict=True))
                    print(f"{what:24s} wall {wall:6.2f} ms   CPU: owner {owner:5.2f} ms, non-owner {other:5.2f} ms")

                for _ in range(args.rounds):
                    for client, where in ((a, "owner"), (b, "non-owner")):
                        measure(client, f"GET session, {where}", lambda c: c.get(f"/v1/sessions/{sid}"))
                        measure(client, f"run x+=1, {where}", lambda c: c.post(
                            f"/v1/sessions/{sid}/execute", json={"code": "x += 1; x"}))
                a.delete(f"/v1/sessions/{sid}")
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
