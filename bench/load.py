"""Load: many sessions executing at once, every reply checked; the manager's memory under output floods.

Run:  .venv/bin/python bench/load.py [--quick] [--no-write] [--sessions N] [--runs N]

One `kernelmode serve` (Kernel Gateway + bubblewrap-sandboxed ipykernels; started with
tests.support.server.start_server through bench/servers.py's KmServer), driven with kernelmode's own
``AsyncClient`` (httpx, one keep-alive connection per concurrent caller):

  0. floor  the warm round trip of the same small cell without load: an unsandboxed ipykernel
            driven with jupyter_client (bench/harness.py's DirectKernel) against one session
            over REST, interleaved in batches.
  1. load   S sessions (default 50) x R executions (default 200): all sessions at once, each
            session's runs one after the other. Every run returns a unique value built in the
            kernel from the request (session index, run index, a random nonce) and from the
            session's own state (a random token set when the session starts, a counter), and
            prints the nonce. Every reply is checked: nothing lost, duplicated, answered out of
            order, or delivered to another session; then the session store (SQLite) and
            /metrics are cross-checked, and each kernel's counter is read back. Latency
            p50/p95/p99/max, throughput, CPU per run, and the manager's and the gateway's RSS
            (before / peak / after, sampled from /proc, plus the kernel's own peak VmHWM).
  2. flood  F sessions (default 10) each print far more than max_output_bytes in a loop
            (stdout, and every 16th line to stderr too) while one more session prints one
            huge string, all at once, for a few rounds; the manager's and the gateway's RSS is
            sampled every 50 ms against the baseline, and every reply is checked (cut at the
            cap, marked truncated, the cell's own result intact).

Results are printed and written (unless --no-write) as one marked section of bench/RESULTS.md:
a rerun replaces that section and leaves the rest of the file as it is (bench/roundtrip.py keeps
the section when it rewrites the file: bench/harness.py's write_page). The very last line printed is a one-line SUMMARY.
Everything started is stopped at the end, also on failure or Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from direct_kernels import DirectKernel
from harness import (
    BENCH,
    CONCURRENCY,
    Stats,
    loadavg,
    ms_since,
    require_kernel_venv,
    run_stoppable,
    server_machine_info,
    verdict,
    write_section,
)
from servers import KmServer

from kernelmode.client import AsyncClient, AsyncSession
from tests.support.procfs import CLK_TCK, cpu_ticks, descendants, hwm_kb, reset_hwm, rss_kb

SECTION = "bench/load.py"
MAX_OUTPUT_BYTES = 1024 * 1024  # the default cap per stream, set explicitly so the checks know it
LINE = "x" * 1023  # + "\n": 1 KiB per printed line


# -- memory from /proc ---------------------------------------------------------------------------------


class RssSampler:
    """A thread sampling the RSS of some processes every ``interval`` seconds while entered.

    On entry the processes' VmHWM is reset, so ``hwm`` afterwards is their true peak over the
    block (transient spikes between two samples included)."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        self.pids = pids
        self.interval = interval
        self.samples: dict[str, list[int]] = {name: [] for name in pids}
        self.hwm: dict[str, int | None] = {}
        self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self.hwm_reset = all([reset_hwm(pid) for pid in self.pids.values()])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm = {name: hwm_kb(pid) if self.hwm_reset else None for name, pid in self.pids.items()}

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            self.samples[name].append(rss_kb(pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def peak(self, name: str) -> int:
        return max(self.samples[name], default=0)


async def settled_rss(pids: dict[str, int], seconds: float = 1.0) -> dict[str, int]:
    """RSS of each process after ``seconds`` of quiet: the median of a few samples."""
    out: dict[str, list[int]] = {name: [] for name in pids}
    n = 5
    for _ in range(n):
        await asyncio.sleep(seconds / n)
        for name, pid in pids.items():
            out[name].append(rss_kb(pid))
    return {name: sorted(xs)[len(xs) // 2] for name, xs in out.items()}


def mb(kb: int | float | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.1f}"


# -- the cells -------------------------------------------------------------------------------------------


def init_code(token: str) -> str:
    return f"_load_token = {token!r}\n_load_n = 0\n'ready'"


def run_code(idx: int, i: int, nonce: str) -> str:
    """A cell whose value is unique: the request's (idx, i, nonce) and the session's state."""
    return (f"_load_n += 1\nprint({nonce!r})\n"
            f"_load_token + '|{idx}|{i}|{nonce}|' + str(_load_n)")


def expected_value(token: str, idx: int, i: int, nonce: str, n: int) -> str:
    return f"{token}|{idx}|{i}|{nonce}|{n}"


def flood_code(lines: int, tag: str) -> str:
    return (f"import sys\n_line = {LINE!r}\nfor _k in range({lines}):\n    print(_line)\n"
            f"    if _k % 16 == 0:\n        print(_line, file=sys.stderr)\n{tag!r}")


def huge_code(nbytes: int, tag: str) -> str:
    return f"print('y' * {nbytes})\n{tag!r}"


# -- 0. the floor ----------------------------------------------------------------------------------------


async def step_floor(srv: KmServer, km: AsyncClient, tmp: Path,
                     args: argparse.Namespace) -> dict[str, Stats]:
    print(f"\n[0] the floor: {args.floor} warm runs each, direct ipykernel vs one REST session, "
          "interleaved ...", flush=True)
    (tmp / "direct").mkdir()
    direct = DirectKernel(tmp / "direct", "ipc")
    stats = {"direct": Stats("direct"), "rest": Stats("rest")}
    session: AsyncSession | None = None
    try:
        await direct.start()
        session = await km.create_session()
        await srv.wait_pool_full()  # the refill after the take starts a kernel: let it finish first
        token = secrets.token_hex(8)
        _, res, _ = await direct.run_cell(init_code(token))
        rinit = await session.run(init_code(token))
        if res != "'ready'" or rinit.result != "'ready'":
            raise RuntimeError(f"the floor's init cells answered {res!r} and {rinit.result!r}")
        n = {"direct": 0, "rest": 0}

        async def one(path: str, record: bool) -> None:
            i = n[path]
            n[path] += 1
            nonce = secrets.token_hex(6)
            code = run_code(0, i, nonce)
            want = repr(expected_value(token, 0, i, nonce, i + 1))
            if path == "direct":
                ms, result, out = await direct.run_cell(code)
            else:
                t0 = time.perf_counter_ns()
                r = await session.run(code)  # type: ignore[union-attr]
                ms, result, out = ms_since(t0), r.result, r.stdout
            if result != want or out != nonce + "\n":
                raise RuntimeError(f"floor ({path}): {result!r} / {out!r}, expected {want!r}")
            if record:
                stats[path].samples.append(ms)

        for _ in range(10):  # warm-up
            for path in stats:
                await one(path, False)
        batch, rnd = 10, 0
        while stats["direct"].n < args.floor:
            order = list(stats) if rnd % 2 == 0 else list(reversed(stats))
            for path in order:
                for _ in range(min(batch, args.floor - stats[path].n)):
                    await one(path, True)
            rnd += 1
    finally:
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()
        await direct.stop()
    for s in stats.values():
        print(f"  {s.name}: median {s.median:.2f} ms, p99 {s.pct(99):.2f} ms", flush=True)
    return stats


# -- 1. load ---------------------------------------------------------------------------------------------


ANOMALIES = ("lost", "duplicated", "wrong_session", "mismatched", "out_of_order", "stdout_wrong")


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    found: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in ANOMALIES})
    errors: dict[str, int] = field(default_factory=dict)  # exceptions and non-ok statuses, by kind

    def flag(self, kind: str, text: str) -> None:
        self.found[kind].append(text[:300])

    def count(self, kind: str) -> int:
        return len(self.found[kind])

    @property
    def clean(self) -> bool:
        return all(not v for v in self.found.values())


@dataclass
class SessionState:
    idx: int
    session: AsyncSession
    token: str
    last_n: int = 0
    last_count: int | None = None
    finished_at: float = 0.0
    nonces: list[str] = field(default_factory=list)


def _proc_ticks(groups: dict[str, list[int]]) -> dict[str, int]:
    ticks = {g: cpu_ticks(p) for g, p in groups.items()}
    t = os.times()
    ticks["client"] = round((t.user + t.system) * CLK_TCK)
    return ticks


async def runs_total(http: httpx.AsyncClient) -> dict[str, float]:
    """kernelmode_runs_total by status (source api) from GET /metrics."""
    r = await http.get("/metrics")
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("kernelmode_runs_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("source") == "api":
                out[labels["status"]] = out.get(labels["status"], 0) + float(line.rsplit(" ", 1)[1])
    return out


async def create_sessions(km: AsyncClient, n: int) -> tuple[list[AsyncSession], list[str]]:
    sessions: list[AsyncSession] = []
    errors: list[str] = []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            try:
                sessions.append(await km.create_session())
            except Exception as e:  # counted and reported, the others go on
                errors.append(f"{type(e).__name__}: {e}")

    await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, n))))
    return sessions, errors


def own_clients(srv: KmServer, sessions: list[AsyncSession]) -> tuple[list[AsyncSession], list[AsyncClient]]:
    """The sessions, each driven through an AsyncClient of its own (one keep-alive connection).

    Like one client per agent. One client shared by every concurrent caller would cost the
    benchmark's process CPU per request that grows with the number of connections (httpcore's
    connection-pool bookkeeping, encode/httpcore#1035), and on a small machine the client shares
    the CPUs with the server."""
    assert srv.srv is not None
    clients = [AsyncClient(srv.srv.url, srv.srv.token, timeout=60, retries=0) for _ in sessions]
    return [AsyncSession(c, s.info) for c, s in zip(clients, sessions, strict=True)], clients


async def delete_all(srv: KmServer, sessions: list[AsyncSession], clients: list[AsyncClient],
                     procs: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Delete the sessions (all at once); (peak RSS while deleting, settled RSS after)."""
    with RssSampler(procs, 0.05) as sampler:
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        await srv.wait_pool_full(strict=False)
    await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    peak = {k: max(sampler.peak(k), sampler.hwm.get(k) or 0) for k in procs}
    return peak, await settled_rss(procs, 2.0)


def check_store(db_path: Path, states: list[SessionState], tally: Tally) -> dict[str, int]:
    """Every run the benchmark sent is recorded exactly once, under its session, with its value."""
    want: dict[str, tuple[SessionState, int]] = {}
    for st in states:
        for i, nonce in enumerate(st.nonces):
            want[nonce] = (st, i)
    seen: dict[str, int] = {}
    wrong = bad_value = 0
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        sids = [st.session.id for st in states]
        rows = db.execute(f"SELECT session_id, code, result FROM runs WHERE session_id IN "
                          f"({','.join('?' * len(sids))})", sids).fetchall()
    finally:
        db.close()
    for sid, code, result in rows:
        m = re.search(r"^print\('([0-9a-f]+)'\)$", code, re.M)
        if m is None or m.group(1) not in want:
            continue  # an init or final cell
        nonce = m.group(1)
        seen[nonce] = seen.get(nonce, 0) + 1
        st, i = want[nonce]
        if sid != st.session.id:
            wrong += 1
            tally.flag("wrong_session", f"store: run of session {st.idx} recorded under {sid}")
        value = json.loads(result).get("result")
        if value != repr(expected_value(st.token, st.idx, i, nonce, i + 1)):
            bad_value += 1
    missing = sum(1 for nonce in want if nonce not in seen)
    dup = sum(n - 1 for n in seen.values() if n > 1)
    if dup:
        tally.flag("duplicated", f"store: {dup} run(s) recorded more than once")
    return {"rows": len(rows), "recorded": len(seen), "missing": missing, "recorded_twice": dup,
            "wrong_session": wrong, "value_differs": bad_value}


async def step_load(srv: KmServer, km: AsyncClient, http: httpx.AsyncClient,
                    args: argparse.Namespace) -> dict[str, Any]:
    S, R = args.sessions, args.runs
    print(f"\n[1] load: {S} sessions x {R} runs, all sessions at once ...", flush=True)
    procs = {"manager": srv.manager_pid, "gateway": srv.gateway_pid}
    t0 = time.monotonic()
    sessions, create_errors = await create_sessions(km, S)
    create_s = time.monotonic() - t0
    print(f"  {len(sessions)} sessions created in {create_s:.1f} s"
          + (f"; {len(create_errors)} failed: {create_errors[:3]}" if create_errors else ""), flush=True)
    tally = Tally()
    tokens: dict[str, int] = {}
    states: list[SessionState] = []
    sessions, clients = own_clients(srv, sessions)
    for idx, s in enumerate(sessions):
        token = secrets.token_hex(8)
        r = await s.run(init_code(token))
        if r.status != "ok" or r.result != "'ready'":
            raise RuntimeError(f"session {idx}: the init cell answered {r.status} {r.result!r}")
        tokens[token] = idx
        states.append(SessionState(idx, s, token, last_count=r.execution_count))
    await srv.wait_pool_full()  # no kernel starts in the background during the measurement
    before = await settled_rss(procs)
    groups = {"manager": [srv.manager_pid], "gateway": [srv.gateway_pid],
              "kernels": descendants(srv.gateway_pid)}
    metrics0 = await runs_total(http)
    lat = Stats("load")
    run_ids: set[str] = set()
    values: set[str] = set()
    nonce_owner: dict[str, int] = {}

    async def drive(st: SessionState) -> None:
        sid = st.session.id
        for i in range(R):
            nonce = secrets.token_hex(6)
            nonce_owner[nonce] = st.idx
            st.nonces.append(nonce)
            tally.sent += 1
            where = f"session {st.idx} run {i}"
            t = time.perf_counter_ns()
            try:
                r = await st.session.run(run_code(st.idx, i, nonce), timeout_seconds=args.run_timeout)
            except Exception as e:
                kind = f"{type(e).__name__}: {e}"[:160]
                tally.errors[kind] = tally.errors.get(kind, 0) + 1
                tally.flag("lost", f"{where}: {kind}")
                continue
            ms = ms_since(t)
            if r.status != "ok":
                kind = f"status {r.status}" + (f" ({r.error.ename}: {r.error.evalue})" if r.error else "")
                tally.errors[kind[:160]] = tally.errors.get(kind[:160], 0) + 1
                tally.flag("lost", f"{where}: {kind}")
                continue
            lat.samples.append(ms)
            problems = 0
            if r.run_id in run_ids:
                tally.flag("duplicated", f"{where}: run_id {r.run_id} seen before")
                problems += 1
            run_ids.add(r.run_id)
            if r.session_id != sid:
                tally.flag("wrong_session", f"{where}: reply names session {r.session_id}")
                problems += 1
            try:
                value = ast.literal_eval(r.result or "")
                tok, ridx, ri, rnonce, rn = str(value).split("|")
                n = int(rn)
            except (ValueError, SyntaxError):
                tally.flag("mismatched", f"{where}: unreadable result {r.result!r}")
                continue
            if value in values:
                tally.flag("duplicated", f"{where}: value {value!r} seen before")
                problems += 1
            values.add(value)
            if tok != st.token:
                tally.flag("wrong_session", f"{where}: the value comes from session "
                           f"{tokens.get(tok, '?')}'s kernel: {value!r}")
                problems += 1
            elif (ridx, ri, rnonce) != (str(st.idx), str(i), nonce):
                owner = nonce_owner.get(rnonce)
                kind = "wrong_session" if owner is not None and owner != st.idx else "mismatched"
                tally.flag(kind, f"{where}: the value answers another request: {value!r}")
                problems += 1
            elif n != st.last_n + 1:
                tally.flag("out_of_order", f"{where}: counter {n} after {st.last_n}")
                problems += 1
            if tok == st.token:
                st.last_n = n
            if r.stdout != nonce + "\n":
                tally.flag("stdout_wrong", f"{where}: stdout {r.stdout[:80]!r}, expected the nonce")
                problems += 1
            if st.last_count is not None and r.execution_count != st.last_count + 1:
                tally.flag("out_of_order", f"{where}: execution_count {r.execution_count} "
                           f"after {st.last_count}")
                problems += 1
            st.last_count = r.execution_count
            if not problems:
                tally.ok += 1
        st.finished_at = time.monotonic()

    ticks0 = _proc_ticks(groups)
    with RssSampler(procs, args.sample_interval) as sampler:
        start = time.monotonic()
        progress = asyncio.create_task(_progress(tally, S * R, start))
        try:
            await asyncio.gather(*(drive(st) for st in states))
        finally:
            progress.cancel()
        wall = time.monotonic() - start
    ticks1 = _proc_ticks(groups)
    after = await settled_rss(procs)
    metrics1 = await runs_total(http)
    cpu = {g: (ticks1[g] - ticks0[g]) * 1000 / CLK_TCK / max(lat.n, 1) for g in ticks0}

    # Each kernel's counter: how many of the runs it executed (exactly R if none was lost or repeated).
    counters: dict[int, int | None] = {}
    for st in states:
        with contextlib.suppress(Exception):
            r = await st.session.run("_load_n")
            counters[st.idx] = int(r.result) if r.status == "ok" and r.result else None
    bad_counters = {i: c for i, c in counters.items() if c != R}
    for i, c in bad_counters.items():
        tally.flag("lost" if (c or 0) < R else "duplicated",
                   f"session {i}: its kernel's counter is {c} after {R} runs")
    metric_runs = {k: metrics1.get(k, 0) - metrics0.get(k, 0) for k in set(metrics0) | set(metrics1)}
    store = check_store(srv.srv.data_dir / "sessions.sqlite3", states, tally)  # type: ignore[union-attr]
    if store["missing"]:
        tally.flag("lost", f"store: {store['missing']} run(s) sent but not recorded")
    finish = sorted(st.finished_at - start for st in states)

    print("  deleting the sessions ...", flush=True)
    deleting, deleted = await delete_all(srv, sessions, clients, procs)
    return {
        "sessions": len(states), "runs": R, "create_errors": create_errors, "create_s": create_s,
        "tally": tally, "lat": lat, "wall": wall, "cpu": cpu, "finish": finish,
        "mem": {name: {"before": before[name], "peak": sampler.peak(name), "hwm": sampler.hwm.get(name),
                       "after": after[name], "deleting": deleting[name], "deleted": deleted[name]}
                for name in procs},
        "samples": len(sampler.samples["manager"]),
        "metric_runs": metric_runs, "store": store, "counters_ok": len(counters) - len(bad_counters),
    }


async def _progress(tally: Tally, total: int, start: float) -> None:
    while True:
        await asyncio.sleep(10)
        done = tally.sent
        print(f"  {done}/{total} sent, {tally.ok} checked ok, {time.monotonic() - start:.0f} s", flush=True)


# -- 2. flood --------------------------------------------------------------------------------------------


@dataclass
class FloodReply:
    kind: str  # loop | huge
    printed: int  # bytes the cell printed (stdout + stderr)
    kept: int  # bytes of stdout + stderr in the reply
    ok: bool
    problem: str = ""


def check_flood(r: Any, kind: str, tag: str, printed_out: int, printed_err: int, cap: int,
                fill: str) -> FloodReply:
    out, err = r.stdout, r.stderr
    kept = len(out.encode()) + len(err.encode())
    problems = []
    if r.status != "ok":
        problems.append(f"status {r.status}")
    if r.result != repr(tag):
        problems.append(f"result {r.result!r} (expected {tag!r})")
    if not r.truncated:
        problems.append("not marked truncated")
    for name, text, printed in (("stdout", out, printed_out), ("stderr", err, printed_err)):
        size = len(text.encode())
        if size > cap:
            problems.append(f"{name} {size} bytes > cap {cap}")
        if printed and size < min(cap, printed) - 2 * len(LINE):
            problems.append(f"{name} {size} bytes: less than the cap kept")
        if text.strip(fill + "\n"):
            problems.append(f"{name} holds other text: {text.strip(fill + chr(10))[:60]!r}")
    return FloodReply(kind, printed_out + printed_err, kept, not problems, "; ".join(problems))


async def step_flood(srv: KmServer, km: AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    F, lines = args.flood_sessions, args.flood_mib * 1024
    huge = args.huge_mib * 1024 * 1024
    cap = MAX_OUTPUT_BYTES
    lines_err = -(-lines // 16)
    loop_bytes = (lines + lines_err) * 1024
    print(f"\n[2] flood: {F} sessions x {args.flood_mib} MiB printed in a loop + 1 x {args.huge_mib} MiB "
          f"in one print (cap {cap} bytes per stream): each alone, then {args.flood_rounds} rounds "
          "all at once ...", flush=True)
    procs = {"manager": srv.manager_pid, "gateway": srv.gateway_pid}
    sessions, errors = await create_sessions(km, F + 1)
    if errors:
        raise RuntimeError(f"flood: creating the sessions failed: {errors[:3]}")
    sessions, clients = own_clients(srv, sessions)
    loopers, big = sessions[:F], sessions[F]
    for s in sessions:  # warm: the first run of a session pays for its preamble's first use
        await s.run("1+1")
    await srv.wait_pool_full()
    baseline = await settled_rss(procs, 2.0)
    replies: list[FloodReply] = []
    phases: list[dict[str, Any]] = []
    errs = 0

    async def loop_one(s: AsyncSession, tag: str) -> FloodReply:
        r = await s.run(flood_code(lines, tag), timeout_seconds=args.run_timeout)
        return check_flood(r, "loop", tag, lines * 1024, lines_err * 1024, cap, "x")

    async def huge_one(tag: str) -> FloodReply:
        r = await big.run(huge_code(huge, tag), timeout_seconds=args.run_timeout)
        return check_flood(r, "huge", tag, huge + 1, 0, cap, "y")

    plan = [("loops alone", True, False), ("single print alone", False, True)]
    plan += [(f"all at once, round {i + 1}", True, True) for i in range(args.flood_rounds)]
    with RssSampler(procs, 0.05) as sampler:
        for name, loops, single in plan:
            before = {k: rss_kb(pid) for k, pid in procs.items()}
            hwm_ok = all([reset_hwm(pid) for pid in procs.values()])
            mark = {k: len(xs) for k, xs in sampler.samples.items()}
            t0 = time.monotonic()
            jobs = [loop_one(s, f"loop-{len(phases)}-{j}-{secrets.token_hex(4)}")
                    for j, s in enumerate(loopers)] if loops else []
            if single:
                jobs.append(huge_one(f"huge-{len(phases)}-{secrets.token_hex(4)}"))
            got = await asyncio.gather(*jobs, return_exceptions=True)
            wall = time.monotonic() - t0
            hwm = {k: hwm_kb(pid) if hwm_ok else None for k, pid in procs.items()}
            for g in got:
                if isinstance(g, BaseException):
                    errs += 1
                    replies.append(FloodReply("?", 0, 0, False, f"{type(g).__name__}: {g}"[:200]))
                else:
                    replies.append(g)
            settled = await settled_rss(procs)
            peaks = {k: max([*xs[mark[k]:], hwm[k] or 0]) for k, xs in sampler.samples.items()}
            printed = (F * loop_bytes if loops else 0) + (huge + 1 if single else 0)
            kept = sum(g.kept for g in got if isinstance(g, FloodReply))
            phases.append({"name": name, "wall": wall, "printed": printed, "before": before,
                           "peak": peaks, "settled": settled, "kept": kept})
            print(f"  {name}: {printed / 2**20:.0f} MiB printed in {wall:.1f} s; manager "
                  f"{mb(before['manager'])} -> peak {mb(peaks['manager'])} -> {mb(settled['manager'])} MB; "
                  f"gateway {mb(before['gateway'])} -> peak {mb(peaks['gateway'])} -> "
                  f"{mb(settled['gateway'])} MB", flush=True)
    answered = 0
    for s in sessions:
        with contextlib.suppress(Exception):
            r = await s.run("1+1")
            answered += r.status == "ok" and r.result == "2"
    pre = {k: rss_kb(pid) for k, pid in procs.items()}
    deleting, deleted = await delete_all(srv, sessions, clients, procs)
    bad = [x for x in replies if not x.ok]
    return {
        "sessions": F, "lines": lines, "huge": huge, "cap": cap, "phases": phases, "replies": replies,
        "bad": bad, "errors": errs, "answered": answered, "total_sessions": len(sessions),
        "mem": {name: {"baseline": baseline[name],
                       "peak": max(max(p["peak"][name] for p in phases), sampler.peak(name)),
                       "deleted_before": pre[name], "deleting": deleting[name], "deleted": deleted[name]}
                for name in procs},
        "kept": sum(x.kept for x in replies), "hwm": all(p["peak"] for p in phases),
    }


# -- report ----------------------------------------------------------------------------------------------


def lat_row(label: str, s: Stats) -> str:
    return (f"| {label} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} | {s.pct(99):.2f} | {max(s.samples):.2f} "
            f"| {s.mean:.2f} |")


def summary_line(res: dict[str, Any]) -> str:
    ld, fl = res["load"], res["flood"]
    t: Tally = ld["tally"]
    s = ld["lat"]
    lost = t.count("lost")
    m, f = ld["mem"]["manager"], fl["mem"]["manager"]
    fpeak = f["peak"]
    return (f"SUMMARY load {ld['sessions']}x{ld['runs']}: ok={t.ok}/{t.sent} lost={lost} "
            f"dup={t.count('duplicated')} wrong_session={t.count('wrong_session')} "
            f"other={t.count('mismatched') + t.count('out_of_order') + t.count('stdout_wrong')} "
            f"p50={s.median:.1f}ms p95={s.pct(95):.1f}ms p99={s.pct(99):.1f}ms max={max(s.samples):.1f}ms "
            f"{s.n / ld['wall']:.0f} runs/s; manager RSS {mb(m['before'])}->{mb(max(m['peak'], m['hwm'] or 0))}"
            f"->{mb(m['after'])} MB; flood: manager {mb(f['baseline'])}->{mb(fpeak)}->{mb(f['deleted'])} MB, "
            f"bad replies {len(fl['bad'])}; cpu_ms_per_run manager={ld['cpu']['manager']:.2f} "
            f"gateway={ld['cpu']['gateway']:.2f}")


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    ld, fl, fo = res["load"], res["flood"], res["floor"]
    t: Tally = ld["tally"]
    s: Stats = ld["lat"]
    S, R = ld["sessions"], ld["runs"]
    clean = t.clean and t.ok == S * R and not ld["create_errors"]
    counts = " | ".join(str(t.count(k)) for k in ANOMALIES)
    errors = "".join(f"\n- {n} x `{k}`" for k, n in sorted(t.errors.items(), key=lambda kv: -kv[1]))
    examples = "".join(f"\n- {k}: `{v[0]}`" for k, v in t.found.items() if v)
    st = ld["store"]
    mr = ld["metric_runs"]
    rate = s.n / ld["wall"]
    cpu = ld["cpu"]
    fin = ld["finish"]

    def mem_rows(mem: dict[str, dict[str, Any]], keys: list[str]) -> str:
        return "\n".join(f"| {name} | " + " | ".join(mb(v[k]) for k in keys) + " |" for name, v in mem.items())

    m = fl["mem"]
    phases = fl["phases"]
    phase_rows = "\n".join(
        f"| {ph['name']} | {ph['printed'] / 2**20:.0f} | {ph['wall']:.1f} | "
        + " | ".join(f"{mb(ph['before'][k])} / **{mb(ph['peak'][k])}** / {mb(ph['settled'][k])}"
                     for k in ("manager", "gateway")) + " |"
        for ph in phases)
    printed = sum(ph["printed"] for ph in phases)
    mgr = m["manager"]
    single = next(ph for ph in phases if ph["name"] == "single print alone")
    loops = next(ph for ph in phases if ph["name"] == "loops alone")
    rounds = [ph for ph in phases if ph["name"].startswith("all at once")]

    def rise(ph: dict[str, Any], k: str = "manager") -> float:
        return (ph["peak"][k] - ph["before"][k]) / 1024

    per_round = [(b["settled"]["manager"] - a["settled"]["manager"]) / 1024
                 for a, b in zip(rounds, rounds[1:], strict=False)]
    chunk = (fl["lines"] + fl["lines"] // 16) / 1024 / max(loops["wall"] / 0.2, 1)
    kept_round = sum(ph["kept"] for ph in rounds) / max(len(rounds), 1) / 2**20
    bad = "".join(f"\n- {x.kind}: {x.problem}" for x in fl["bad"][:10])
    info = res["machine"]
    machine = (f"{info['nproc']} CPUs ({info['cpu']}), {info['memory']}, {info['kernel']}; sandbox: "
               f"{info['sandbox']}; load average at the start {info['load average (1, 5, 15 min) at the start']}, "
               f"at the end {info['load average (1, 5, 15 min) at the end']}")
    return f"""## Load: {S} sessions x {R} executions at once; output floods

Generated by `{' '.join(['bench/load.py', *sys.argv[1:]])}` on {info['date']}; wall time
{res['wall']:.0f} s. Latency in ms, memory in MB (MiB) of resident set size (RSS).
Machine: {machine}.

`{summary_line(res)}`

### Correctness: every reply checked

| sessions x runs | replies correct | lost | duplicated | wrong session | mismatched | out of order | stdout wrong |
|---|---|---|---|---|---|---|---|
| {S} x {R} = {S * R} | **{t.ok}** | {counts} |

- none lost, duplicated or delivered to the wrong session: {verdict(clean, 'yes', 'NO')}{errors}{examples}
- each kernel's own counter after the load (`_load_n`, incremented once per run): {ld['counters_ok']} of
  {S} sessions read exactly {R}.
- the session store (SQLite) holds {st['recorded']} of the {S * R} runs, {st['missing']} missing,
  {st['recorded_twice']} recorded twice, {st['wrong_session']} under another session,
  {st['value_differs']} with another value than the one returned.
- `/metrics`: `kernelmode_runs_total{{source="api"}}` grew by
  {', '.join(f'{int(v)} {k}' for k, v in sorted(mr.items()) if v) or 'nothing'} during the load.
- sessions created: {S} ({len(ld['create_errors'])} failed) in {ld['create_s']:.1f} s, {CONCURRENCY} at a time.

Each run is the cell `_load_n += 1; print(nonce); _load_token + '|idx|i|nonce|' + str(_load_n)`:
its value joins what only the request knows (session index, run index, a fresh random nonce)
with what only the session's kernel knows (a random token set by the session's first cell, and
its counter). A reply counts as correct when its status is `ok`, its `run_id` and value were
never seen before, its `session_id` is the session asked, the value carries that session's
token, this request's index and nonce and the counter one above the session's previous reply,
stdout is exactly the nonce, and `execution_count` is one above the previous reply's. A value
carrying another session's token (or another session's nonce) would count as delivered to the
wrong session; an exception or a status other than `ok` as lost.

### Latency and throughput

| | N | p50 | p95 | p99 | max | mean |
|---|---|---|---|---|---|---|
{lat_row(f'**under load**: {S} sessions at once, REST (kernelmode AsyncClient)', s)}
{lat_row('unloaded: one session, REST (AsyncClient), one run at a time', fo['rest'])}
{lat_row('unloaded: direct ipykernel (jupyter_client, no sandbox, no gateway)', fo['direct'])}

- throughput: **{rate:.0f} runs/s** ({s.n} runs in {ld['wall']:.1f} s, all sessions at once); the
  sessions finished between {fin[0]:.1f} s and {fin[-1]:.1f} s.
- CPU per run (ms): client {cpu['client']:.2f}, manager {cpu['manager']:.2f}, gateway
  {cpu['gateway']:.2f}, kernels {cpu['kernels']:.2f} (from /proc/<pid>/stat over the load); total
  {sum(cpu.values()):.2f} ms on {info['nproc']} CPUs: this machine tops out near
  {int(info['nproc']) * 1000 / max(sum(cpu.values()), 1e-9):.0f} runs/s whatever the concurrency.
- unloaded, the REST round trip is {fo['rest'].median / fo['direct'].median:.2f}x the direct one
  (median); under load a run waits for the CPUs: by Little's law its latency is about
  sessions / throughput = {S / rate * 1000:.0f} ms (measured mean {s.mean:.0f} ms).

### Manager and gateway memory during the load

| process | before | peak (sampled) | peak (VmHWM) | after the load | peak while deleting the sessions | after deleting them |
|---|---|---|---|---|---|---|
{mem_rows(ld['mem'], ['before', 'peak', 'hwm', 'after', 'deleting', 'deleted'])}

RSS read from `/proc/<pid>/statm` every {args.sample_interval:g} s by a thread ({ld['samples']}
samples); VmHWM is the kernel's record of the peak, reset (`/proc/<pid>/clear_refs`) when the
load starts. "before" and "after" are medians of 5 samples over 1 s with nothing running, the
{S} sessions alive and idle ({args.pool_note}).

### Output flood

{fl['sessions']} sessions each run a loop printing {fl['lines']} lines of 1 KiB
({fl['lines'] // 1024} MiB to stdout, and every 16th line to stderr too), and one more session
prints one string of {fl['huge'] // 2**20} MiB in a single `print`: first the loops alone, then
the single print alone, then everything at once for {len(rounds)} rounds; {printed / 2**20:.0f} MiB
printed in all. The cap (`max_output_bytes`) is {fl['cap']} bytes per stream and run.

| phase | MiB printed | s | manager: before / **peak** / settled | gateway: before / **peak** / settled |
|---|---|---|---|---|
{phase_rows}
| **overall** | {printed / 2**20:.0f} | | baseline {mb(mgr['baseline'])}, peak **{mb(mgr['peak'])}** | baseline {mb(m['gateway']['baseline'])}, peak **{mb(m['gateway']['peak'])}** |
| deleting the {fl['total_sessions']} sessions | | | {mb(mgr['deleted_before'])} / **{mb(mgr['deleting'])}** / {mb(mgr['deleted'])} | {mb(m['gateway']['deleted_before'])} / **{mb(m['gateway']['deleting'])}** / {mb(m['gateway']['deleted'])} |

- loops alone: the manager rose **{rise(loops):.0f} MB** at the peak (the gateway
  {rise(loops, 'gateway'):.0f} MB) while {loops['printed'] / 2**20:.0f} MiB went through it, then
  settled at {mb(loops['settled']['manager'])} MB: output beyond the cap is dropped as it
  arrives and does not accumulate. The peak is transient and comes from the size of single
  messages: ipykernel sends whatever a
  cell printed during its 0.2 s flush interval as one stream message (here about
  {chunk:.1f} MiB: {fl['lines'] // 1024} MiB per session in {loops['wall']:.1f} s), which the gateway
  and the manager each take in and decode whole before the cap applies.
- the single print: the manager rose **{rise(single):.0f} MB** at the peak for one message of
  {fl['huge'] // 2**20} MiB ({rise(single) / (fl['huge'] / 2**20):.1f}x its size), the gateway
  {rise(single, 'gateway'):.0f} MB. One `print` is one iopub message, which the manager receives
  and decodes whole (websocket `max_size` 256 MiB) before the cap applies: the transient cost
  grows with the largest message, not with `max_output_bytes`.
- all at once: manager peaks {', '.join(mb(ph['peak']['manager']) for ph in rounds)} MB; settled
  {', '.join(mb(ph['settled']['manager']) for ph in rounds)} MB after each round
  ({', '.join(f'{x:+.0f}' for x in per_round) or '-'} MB from round to round, against
  ~{kept_round:.0f} MiB of capped output kept per round). Finished runs stay readable by id
  (`GET /v1/runs/{{id}}`) for `run_retention_seconds` (1 h by default, up to 10,000 runs), each
  with its capped output held twice (the event list and the RunResult): the settled RSS carries
  that until the runs expire (the allocator's reuse of freed memory blurs the steps).
- deleting the sessions: the manager peaked at {mb(mgr['deleting'])} MB
  ({(mgr['deleting'] - mgr['deleted_before']) / 1024:+.0f} MB) and settled at {mb(mgr['deleted'])} MB:
  deleting a session builds its notebook — every run with its output — in the manager, to keep
  it as an artifact, so the cost grows with the session's history (up to runs x the caps);
  the freed memory stays in the allocator's heap for reuse.
- the gateway settled at {mb(m['gateway']['deleted'])} MB after it all, against a baseline of
  {mb(m['gateway']['baseline'])} MB.
- replies: {len(fl['replies']) - len(fl['bad'])} of {len(fl['replies'])} correct (status `ok`, the cell's
  own value intact, `truncated` set, each stream cut at the cap and holding only the printed
  text); {fl['errors']} failed with an exception{bad}; {fl['answered']} of {fl['total_sessions']} sessions
  answered `1+1` afterwards.

RSS sampled every 0.05 s by a thread, and each phase's peak includes the kernel's VmHWM (reset
at the start of the phase{'' if fl['hwm'] else '; not available here'}); "before": just before the
phase; "settled": 1 s after its last reply; baseline: median over 2 s with the
{fl['total_sessions']} sessions created and idle.
"""


# -- main ------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kmload-", dir="/tmp"))
    srv = KmServer("load", {
        "KERNELMODE_SESSIONS__MAX_SESSIONS": str(args.sessions + args.flood_sessions + 10),
        "KERNELMODE_SESSIONS__MAX_OUTPUT_BYTES": str(MAX_OUTPUT_BYTES),
    })
    res: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        stack.push_async_callback(srv.stop)
        try:
            print("starting kernelmode serve ...", flush=True)
            srv.start()
            await srv.wait_pool_full()
            args.pool_note = f"warm pool of {srv.pool_size} kept full"
            assert srv.srv is not None
            transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None,
                                                                     max_keepalive_connections=None))
            km = await stack.enter_async_context(
                AsyncClient(srv.srv.url, srv.srv.token, timeout=60, retries=0, transport=transport))
            http = await stack.enter_async_context(httpx.AsyncClient(
                base_url=srv.srv.url, headers={"Authorization": f"Bearer {srv.srv.token}"}, timeout=30))
            res["floor"] = await step_floor(srv, km, tmp, args)
            res["load"] = await step_load(srv, km, http, args)
            res["flood"] = await step_flood(srv, km, args)
            res["machine"] = server_machine_info(srv.ready, load_start)
        except Exception:
            srv.keep_logs = True
            raise
    res["wall"] = time.monotonic() - started
    text = report(res, args)
    print()
    print(text)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SECTION, text)
        print("wrote the Load section of bench/RESULTS.md")
    print(summary_line(res), flush=True)
    t: Tally = res["load"]["tally"]
    return 0 if t.clean and not res["flood"]["bad"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="10 sessions x 20 runs, a smaller flood (3 x 8 MiB + 16 MiB, 2 rounds)")
    p.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS.md")
    p.add_argument("--sessions", type=int, default=None, help="sessions at once (default 50)")
    p.add_argument("--runs", type=int, default=None, help="runs per session (default 200)")
    p.add_argument("--flood-sessions", type=int, default=None, help="looping flood sessions (default 10)")
    p.add_argument("--flood-mib", type=int, default=None, help="MiB each looping session prints (default 32)")
    p.add_argument("--huge-mib", type=int, default=None, help="MiB of the single print (default 64)")
    p.add_argument("--flood-rounds", type=int, default=None, help="flood rounds (default 3)")
    args = p.parse_args()
    q = args.quick
    for name, full, quick in (("sessions", 50, 10), ("runs", 200, 20), ("flood_sessions", 10, 3),
                              ("flood_mib", 32, 8), ("huge_mib", 64, 16), ("flood_rounds", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.floor = 30 if q else 100
    args.sample_interval = 0.1
    args.run_timeout = 300
    args.pool_note = ""
    require_kernel_venv(p)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
