"""What a session listing costs with many stored sessions, a page against the whole (S3 of
session 8: `GET /v1/sessions` answers pages).

Run:  .venv/bin/python bench/listing.py [--sessions N] [--samples N] [--no-write]

One `kernelmode serve` on a data directory whose store holds N sessions (lost ones: a record
each, no kernel, as a server restart leaves them). Interleaved round by round, each timed by the
client on one keep-alive connection, with the answer's size:

  first page   `GET /v1/sessions` with no paging asked (the default page of 100);
  one of 1000  `GET /v1/sessions?limit=1000`, the largest page;
  every page   the whole listing walked with `limit=1000` and each next_cursor (what an answer
               without paging was: every session).

Results go to a section of bench/RESULTS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from harness import (
    BENCH,
    KmServer,
    Stats,
    interleave,
    loadavg,
    ms_since,
    run_stoppable,
    write_section,
)

from kernelmode.models import Limits, SessionInfo
from kernelmode.sessions.store import SessionStore

SECTION = "listing"


def fill(data_dir: Path, n: int) -> None:
    """``n`` lost sessions in the store of ``data_dir`` (created one second apart)."""
    store = SessionStore(data_dir / "sessions.sqlite3")
    t0 = datetime.now(timezone.utc) - timedelta(days=1)
    for i in range(n):
        t = t0 + timedelta(seconds=i)
        info = SessionInfo(session_id=f"stored-{i:06d}", status="lost", created_at=t, last_activity=t,
                           ttl_seconds=1800, limits=Limits(), sandbox="bwrap", tenant="admin")
        store.save(info, f"kernel-{i}", data_dir / "workspaces" / f"gone-{i}")
    store.close()


async def main(args: argparse.Namespace) -> int:
    data_dir = Path(tempfile.mkdtemp(prefix="km-bench-listing-", dir="/tmp"))
    os.chmod(data_dir, 0o711)
    fill(data_dir, args.sessions)
    km = KmServer("listing", {"KERNELMODE_SESSIONS__POOL_SIZE": "0"}, data_dir=data_dir)
    load_start = loadavg()
    sizes: dict[str, list[int]] = {"first page": [], "one of 1000": [], "every page": []}
    try:
        km.start()
        conn = km.http()

        async def get(path: str) -> dict:
            status, data = await conn.request("GET", path)
            assert status == 200, data[:300]
            return json.loads(data) | {"_bytes": len(data)}

        async def first_page() -> float:
            t0 = time.perf_counter_ns()
            body = await get("/v1/sessions")
            took = ms_since(t0)
            assert len(body["sessions"]) == 100 and body["next_cursor"]
            sizes["first page"].append(body["_bytes"])
            return took

        async def one_of_1000() -> float:
            t0 = time.perf_counter_ns()
            body = await get("/v1/sessions?limit=1000")
            took = ms_since(t0)
            assert len(body["sessions"]) == min(1000, args.sessions)
            sizes["one of 1000"].append(body["_bytes"])
            return took

        async def every_page() -> float:
            t0, seen, size, cursor = time.perf_counter_ns(), 0, 0, ""
            while True:
                body = await get("/v1/sessions?limit=1000" + (f"&cursor={cursor}" if cursor else ""))
                seen, size = seen + len(body["sessions"]), size + body["_bytes"]
                if not (cursor := body["next_cursor"]):
                    break
            took = ms_since(t0)
            assert seen == args.sessions, seen
            sizes["every page"].append(size)
            return took

        stats = {n: Stats(n) for n in sizes}
        await interleave({"first page": first_page, "one of 1000": one_of_1000, "every page": every_page},
                         stats, args.samples, batch=1, warmup=1)
        load_end = loadavg()
        pages = -(-args.sessions // 1000)
        table = ["| request | n | median ms | p90 ms | answer bytes |", "|---|---|---|---|---|"]
        for name, st in stats.items():
            table.append(f"| {name} | {st.n} | {st.median:.0f} | {st.pct(90):.0f} | {sizes[name][-1]:,} |")
        body = "\n".join([
            "## Session listing in pages (S3, session 8)",
            "",
            f"`python bench/listing.py --sessions {args.sessions} --samples {args.samples}` "
            f"(bench/listing.py), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one server whose "
            f"store holds {args.sessions:,} sessions, interleaved, one keep-alive connection. Shared, "
            f"busy machine: load average {load_start} at the start, {load_end} at the end.",
            "",
            *table,
            "",
            f"An answer is now at most a page: the default one is {sizes['first page'][-1]:,} bytes "
            f"where the whole listing was {sizes['every page'][-1]:,}. Each page still reads and sorts "
            f"every stored session (the store has no index on creation time), so walking all {pages} "
            "pages costs that read once per page: paging bounds the answer, not the server's work (the "
            "first page and the page of 1000 cost about the same: both are that read).",
        ])
        print(body)
        if not args.no_write:
            write_section(BENCH / "RESULTS.md", SECTION, body)
        print("SUMMARY " + json.dumps({n: round(s.median, 1) for n, s in stats.items()}))
        return 0
    finally:
        await km.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    sys.exit(run_stoppable(main, p.parse_args()))
