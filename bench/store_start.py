"""What a `kernelmode serve` start and a hibernation expiry pass cost with many stored sessions,
before and after they read only what they need (part B of session 10).

Run:  .venv/bin/python bench/store_start.py [--before DIR] [--sessions N] [--runs N] [--rounds N]
      [--passes N] [--saves N] [--no-write]

Two checkouts, before (``--before``, /work/main by default) and after (this one). For each, a
store of N sessions is made once by that checkout's own code, as a server leaves it: 90% lost,
9% hibernated (expiring tomorrow), 1% idle (a crash left them: the start marks them lost), each
with --runs ended runs (3); then
opened once more by it (a normal start meets a store its own version opened before).

  start  per round, a fresh data dir with a copy of that store; `kernelmode serve` (bwrap, no
         warm pool) started from the checkout; time from the spawn until `GET /readyz` is 200
         (polled every 20 ms), and the manager process's on-CPU time until then.
  expiry per round, a fresh process of the checkout on a store of N hibernated sessions (none
         expired: the usual pass) runs the expiry pass (Hibernation.expired) --passes times;
         its CPU time per pass.
  save   per round, a fresh process of the checkout saves one session of that store --saves
         times (status and last activity changing, as runs do): CPU per save (the cost of the
         triggers on the run path).

Rounds alternate before/after (the order swapped every round), so load on the shared machine
falls on both alike. Results go to the "store-start" section of bench/RESULTS.md (unless
--no-write).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import REPO, Stats, loadavg, run_stoppable, write_section

from tests.support.procfs import cpu_ns

SECTION = "store-start"

# Run in a checkout's own python process (cwd: the checkout, so `kernelmode` is its code).
FILL = """
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from kernelmode.models import Limits, RunResult, SessionInfo
try:
    from kernelmode.sessions.store import SqliteStore as SessionStore
except ImportError:  # a checkout from before the store had backends
    from kernelmode.sessions.store import SessionStore
path, n, mix, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = SessionStore(path)
t0 = datetime.now(timezone.utc) - timedelta(days=1)
tomorrow = t0 + timedelta(days=2)
store._db.execute("BEGIN")
for i in range(n):
    t = t0 + timedelta(seconds=i)
    status = "hibernated" if mix == "hibernated" else ("idle" if i % 100 == 0 else "hibernated" if i % 100 < 10 else "lost")
    info = SessionInfo(session_id=f"stored-{i:06d}", status=status, created_at=t, last_activity=t,
                       ttl_seconds=1800, limits=Limits(), sandbox="bwrap", tenant="admin",
                       kernel_id=f"kernel-{i}", expires_at=tomorrow if status == "hibernated" else None)
    store.save(info, f"kernel-{i}", path.parent / "workspaces" / f"gone-{i}")
    for k in range(runs if mix == "start" else 0):  # ended runs, with a little output each
        store.add_run(f"x = {k}", RunResult(run_id=f"run-{i}-{k}", session_id=info.session_id, status="ok",
                                            stdout=f"line {k}\\n" * 20, execution_count=k + 1))
store._db.execute("COMMIT")
store.close()
SessionStore(path).close()  # the store as a later start of this version finds it
"""
EXPIRY = """
import sys, time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from kernelmode.sessions.hibernation import Hibernation
try:
    from kernelmode.sessions.store import SqliteStore as SessionStore
except ImportError:  # a checkout from before the store had backends
    from kernelmode.sessions.store import SessionStore
store = SessionStore(Path(sys.argv[1]))
h = SimpleNamespace(store=store, live={})  # what Hibernation.expired uses
at = datetime.now(timezone.utc)
Hibernation.expired(h, at)  # warm: imports, first query
t0 = time.process_time_ns()
for _ in range(int(sys.argv[2])):
    assert Hibernation.expired(h, at) == []
print((time.process_time_ns() - t0) / int(sys.argv[2]) / 1e6)
"""
# What the triggers cost where it counts (issue 18: a save per run): one session saved over and
# over (its status and last activity changing, as runs do), in a store of N sessions.
SAVE = """
import shutil, sys, tempfile, time
from datetime import timedelta
from pathlib import Path
try:
    from kernelmode.sessions.store import SqliteStore as SessionStore
except ImportError:  # a checkout from before the store had backends
    from kernelmode.sessions.store import SessionStore
copy = Path(tempfile.mkdtemp(prefix="kmstart-save-")) / "sessions.sqlite3"
shutil.copy(sys.argv[1], copy)  # the store the other measures read stays as it was
store = SessionStore(copy)
info = store.get("stored-000001")
n = int(sys.argv[2])
for _ in range(2):  # the first pass warms up
    t0 = time.process_time_ns()
    for k in range(n):
        info.status = "busy" if k % 2 else "idle"
        info.last_activity += timedelta(microseconds=1)
        store.save(info, "kernel-1", Path("/w"))
print((time.process_time_ns() - t0) / n / 1e3)
store.close()
shutil.rmtree(copy.parent)
"""


def python_in(checkout: Path, code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=checkout, env=env, check=True,
                          capture_output=True, text=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_dir_with(store: Path) -> Path:
    """A fresh data dir holding a copy of ``store``."""
    data_dir = Path(tempfile.mkdtemp(prefix="kmstart-", dir="/tmp"))
    data_dir.chmod(0o711)
    shutil.copy(store, data_dir / "sessions.sqlite3")
    return data_dir


def idle_left(data_dir: Path) -> int:
    """Sessions still idle in the store of a stopped `serve` (its start marks them lost); the
    data dir is removed."""
    try:
        db = sqlite3.connect(data_dir / "sessions.sqlite3")
        try:
            return int(db.execute("SELECT COUNT(*) FROM sessions WHERE json_extract(info, '$.status') = 'idle'")
                       .fetchone()[0])
        finally:
            db.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


async def one_start(checkout: Path, store: Path) -> tuple[float, float]:
    """(ms from spawn to /readyz 200, manager CPU ms until then) of one `serve` on a copy of ``store``."""
    data_dir = await asyncio.to_thread(data_dir_with, store)
    port, token = free_port(), "t" + secrets.token_urlsafe(16)
    env = {**os.environ, "KERNELMODE_TOKEN": token, "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter_ns()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kernelmode.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
        "--sandbox", "bwrap", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(checkout))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.returncode is None, f"serve ({checkout}) exited with {proc.returncode}"
                with contextlib.suppress(httpx.TransportError):
                    if (await c.get("/readyz")).status_code == 200:
                        return (time.perf_counter_ns() - t0) / 1e6, cpu_ns(proc.pid) / 1e6
                await asyncio.sleep(0.02)
            raise RuntimeError(f"serve ({checkout}) not ready in 180 s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        left = await asyncio.to_thread(idle_left, data_dir)
        assert left == 0, f"{checkout}: {left} idle sessions left after the start"


async def main(args: argparse.Namespace) -> int:
    load_start = loadavg()
    work = Path(tempfile.mkdtemp(prefix="kmstart-stores-", dir="/tmp"))
    sides = {"before": args.before, "after": REPO}
    stats = {f"{what} {side}": Stats(f"{what} {side}") for what in ("start", "start cpu", "expiry cpu", "save cpu")
             for side in sides}
    try:
        for side, checkout in sides.items():
            print(f"filling {side}'s stores ({checkout}) with {args.sessions:,} sessions ...", flush=True)
            for mix in ("start", "hibernated"):
                (work / side / mix).mkdir(parents=True)
                python_in(checkout, FILL, str(work / side / mix / "sessions.sqlite3"), str(args.sessions), mix,
                          str(args.runs))
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
            for side in order:
                took, cpu = await one_start(sides[side], work / side / "start" / "sessions.sqlite3")
                stats[f"start {side}"].samples.append(took)
                stats[f"start cpu {side}"].samples.append(cpu)
                per_pass = float(python_in(sides[side], EXPIRY, str(work / side / "hibernated" / "sessions.sqlite3"),
                                           str(args.passes)))
                stats[f"expiry cpu {side}"].samples.append(per_pass)
                per_save = float(python_in(sides[side], SAVE, str(work / side / "hibernated" / "sessions.sqlite3"),
                                           str(args.saves)))
                stats[f"save cpu {side}"].samples.append(per_save)
            print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{n} {s.samples[-1]:.1f}" for n, s in stats.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(stats, args, load_start, loadavg())
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", SECTION, text)
    print("SUMMARY " + json.dumps({n: round(s.median, 2) for n, s in stats.items()}))
    return 0


def report(stats: dict[str, Stats], args: argparse.Namespace, load_start: str, load_end: str) -> str:
    rows = [f"| {n} | {s.n} | {s.median:.2f} | {s.pct(90):.2f} |" for n, s in stats.items() if "save" not in n]
    rows += [f"| {n} (µs) | {s.n} | {s.median:.1f} µs | {s.pct(90):.1f} µs |" for n, s in stats.items() if "save" in n]

    def ratio(what: str) -> str:
        b, a = stats[f"{what} before"].median, stats[f"{what} after"].median
        unit = "µs" if "save" in what else "ms"
        return f"{what}: {b:.2f} -> {a:.2f} {unit} median ({b - a:+.2f} {unit} saved, {b / a:.3g}x)"

    return "\n".join([
        "## Store open, `serve` start and hibernation expiry with many stored sessions (B, session 10)",
        "",
        f"`python bench/store_start.py --sessions {args.sessions} --runs {args.runs} --rounds {args.rounds} "
        f"--passes {args.passes}` "
        f"(bench/store_start.py), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: before ({args.before}) "
        f"and after (this checkout), rounds interleaved. Shared 2-core machine: load average {load_start} at "
        f"the start, {load_end} at the end (the differences measured in this one run are what count).",
        "",
        f"- start: `kernelmode serve` (bwrap, no warm pool) on a store of {args.sessions:,} sessions (90% lost, "
        f"9% hibernated, 1% idle left by a crash, which the start marks lost) with {args.runs} ended runs each, "
        "from spawn to `/readyz` 200; "
        "start cpu: the manager process's CPU until then (its imports and the gateway's start included).",
        f"- expiry cpu: one hibernation expiry pass (`Hibernation.expired`, nothing due) over {args.sessions:,} "
        "hibernated sessions, CPU per pass; save cpu: `SessionStore.save` of one session (status and last "
        f"activity changing), {args.saves} times, CPU per save in µs (the triggers' cost on the run path).",
        "",
        "| measure | n | median ms | p90 ms |",
        "|---|---|---|---|",
        *rows,
        "",
        *[f"- {ratio(w)}" for w in ("start", "start cpu", "expiry cpu", "save cpu")],
        "",
        "Before, each start's store open ran a json_extract over every record (to catch rows an older "
        "kernelmode changed), and the start decoded every record twice (the lost ones to name, "
        "`mark_all_lost`) and re-encoded each it marked lost, and ran a json_extract over every run to find "
        "the interrupted ones; each expiry pass decoded every hibernated "
        "record. After, triggers in the database keep the listing columns in step whoever writes, the start "
        "marks the live sessions lost in one UPDATE over the status index and decodes only adoptable ones, "
        "the interrupted runs come from a partial index of the runs not known to have ended, "
        "and the expiry pass reads the due sessions from a partial index on a generated `expires_ms` column.",
    ])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, default=Path("/work/main"), help="the checkout to compare with")
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--passes", type=int, default=20)
    p.add_argument("--saves", type=int, default=5000)
    p.add_argument("--runs", type=int, default=3, help="ended runs stored per session (the start's store)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    if not (a.before / "kernelmode" / "__init__.py").is_file():
        p.error(f"{a.before} is not a kernelmode checkout")
    sys.exit(run_stoppable(main, a))
