"""What a session listing costs with many stored sessions, before and after the store answered a
page from its indexes (part L of session 9; session 8 made `GET /v1/sessions` answer pages).

Run:  .venv/bin/python bench/listing.py [--before DIR] [--sessions N] [--samples N] [--no-write]

Two `kernelmode serve` (bwrap, no warm pool), one from another checkout (``--before``,
/work/main by default) and one from this one, each on a data directory whose store holds N
sessions (lost ones: a record each, no kernel, as a server restart leaves them). Interleaved
round by round, each timed by the client on one keep-alive connection per server, with the
manager's on-CPU time per request measured over the same requests:

  first page   `GET /v1/sessions` (the default page of 100);
  deep page    `GET /v1/sessions?limit=100&cursor=C`, C the cursor 9/10 of the way through;
  kernels      `GET /api/kernels` (the Jupyter API: sessions with a kernel, here none).

Results go to the "listing-index" section of bench/RESULTS.md (unless --no-write); the
"listing" section before it is session 8's single-server run of the earlier version of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
from harness import REPO, Stats, interleave, loadavg, run_stoppable, write_section
from servers import AS_DEPLOYED, CpuMeter, KmServer, is_checkout

from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.store import SqliteStore

SECTION = "listing-index"
PROBES = ("first page", "deep page", "kernels")


def fill(data_dir: Path, n: int) -> None:
    """``n`` lost sessions in the store of ``data_dir`` (created one second apart)."""
    store = SqliteStore(data_dir / "sessions.sqlite3")
    t0 = datetime.now(timezone.utc) - timedelta(days=1)
    for i in range(n):
        t = t0 + timedelta(seconds=i)
        info = SessionInfo(session_id=f"stored-{i:06d}", status="lost", created_at=t, last_activity=t,
                           ttl_seconds=1800, limits=Limits(), sandbox="bwrap", tenant="admin")
        store.save(info, f"kernel-{i}", data_dir / "workspaces" / f"gone-{i}")
    store.close()


async def probes(c: httpx.AsyncClient, n: int) -> dict[str, Callable[[], Awaitable[float]]]:
    """The timed requests on one server, and the deep page's cursor found first."""
    cursor, seen, step = None, 0, min(1000, max(1, n // 10))
    while seen < n * 9 // 10:
        body = (await c.get("/v1/sessions", params={"limit": step, **({"cursor": cursor} if cursor else {})})).json()
        seen, cursor = seen + len(body["sessions"]), body["next_cursor"]
    assert cursor, "the deep page's cursor"

    def timed(path: str, params: dict[str, str | int], check: Callable[[httpx.Response], bool]
              ) -> Callable[[], Awaitable[float]]:
        async def probe() -> float:
            t0 = time.perf_counter_ns()
            r = await c.get(path, params=params)
            took = (time.perf_counter_ns() - t0) / 1e6
            assert r.status_code == 200 and check(r), r.text[:300]
            return took
        return probe

    return {
        "first page": timed("/v1/sessions", {}, lambda r: len(r.json()["sessions"]) == 100),
        "deep page": timed("/v1/sessions", {"limit": 100, "cursor": cursor},
                           lambda r: r.json()["sessions"][0]["session_id"] == f"stored-{seen:06d}"),
        "kernels": timed("/api/kernels", {}, lambda r: r.json() == []),
    }


async def main(args: argparse.Namespace) -> int:
    load_start = loadavg()
    env = {**AS_DEPLOYED, "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    servers = {name: KmServer(name, env, checkout=checkout)
               for name, checkout in (("before", args.before), ("after", None))}
    async with contextlib.AsyncExitStack() as stack:
        fns: dict[str, Callable[[], Awaitable[float]]] = {}
        pids: dict[str, int] = {}
        for name, km in servers.items():
            print(f"starting {name} ({km.checkout or REPO}), filling its store with {args.sessions:,} sessions ...",
                  flush=True)
            stack.push_async_callback(km.stop)
            km.start()
            assert km.srv is not None and km.data_dir is not None
            fill(km.data_dir, args.sessions)  # read by each listing (the store is the truth)
            c = httpx.AsyncClient(base_url=km.srv.url, timeout=300,
                                  headers={"Authorization": f"Bearer {km.srv.token}"})
            stack.push_async_callback(c.aclose)
            for probe, fn in (await probes(c, args.sessions)).items():
                fns[f"{probe} {name}"], pids[f"{probe} {name}"] = fn, km.manager_pid
        stats = {path: Stats(path) for path in fns}
        cpu = CpuMeter(stats)
        for path, manager in pids.items():
            cpu.watch(path, manager=manager)
        await interleave(fns, stats, args.samples, batch=args.batch, warmup=1, around=cpu.around)
    text = report(stats, cpu, args, load_start, loadavg())
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", SECTION, text)
    print("SUMMARY " + json.dumps({n: round(s.median, 2) for n, s in stats.items()}))
    return 0


def report(stats: dict[str, Stats], cpu: CpuMeter, args: argparse.Namespace,
           load_start: str, load_end: str) -> str:
    def per_req(path: str) -> float:
        return cpu.per_run(path, "manager")

    rows = [f"| {p} | {s.n} | {s.median:.2f} | {s.pct(90):.2f} | {per_req(p):.2f} |" for p, s in stats.items()]
    ratios = [f"{p}: median {stats[p + ' before'].median / stats[p + ' after'].median:.1f}x faster, manager CPU "
              f"{per_req(p + ' before'):.1f} -> {per_req(p + ' after'):.2f} ms per request" for p in PROBES]
    return "\n".join([
        "## Session listing from an index (L)",
        "",
        f"`python bench/listing.py --sessions {args.sessions} --samples {args.samples}` (bench/listing.py), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: two servers, before ({args.before}) and after "
        f"(this checkout), each with {args.sessions:,} stored sessions, interleaved in batches of {args.batch}, "
        f"one keep-alive connection each. Shared 2-core machine: load average {load_start} at the start, "
        f"{load_end} at the end (the ratios and CPU per request, measured in this one run, are what count).",
        "",
        "| request | n | median ms | p90 ms | manager CPU ms/req |",
        "|---|---|---|---|---|",
        *rows,
        "",
        *[f"- {r}" for r in ratios],
        "",
        "Before, each page read and decoded every stored session and sorted them (so did `/api/kernels`, "
        "to show the live ones); after, the store's indexes give a page's `limit + 1` rows "
        "(tenant, creation time, id) and `/api/kernels` reads the live and hibernated sessions only.",
    ])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, default=Path("/work/main"), help="the checkout to compare with")
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    if not is_checkout(a.before):
        p.error(f"{a.before} is not a kernelmode checkout")
    sys.exit(run_stoppable(main, a))
