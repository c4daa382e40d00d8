"""Failure detection and recovery: kernel death, gateway death, manager crash + adoption, reaping.

Run:  .venv/bin/python bench/recovery.py [--quick] [--no-write] [--poll-intervals 0.5,2]

Real `kernelmode serve` processes (tests.support.server.start_server, bubblewrap sandbox, default warm
pool of 2) are started, one per step, each on its own data dir, and broken on purpose. Each
measurement is repeated N times (10; --quick 3) and reported as median / p90 / max:

  1. kernel   in a live session, POST execute `import os; os._exit(3)` and, separately,
              `import os, signal; os.kill(os.getpid(), signal.SIGKILL)`: time from the POST
              until its response (status kernel_died) arrives, the cause it reports, when the
              manager heard of the death (its audit event `kernel_died`), and the next execute
              (a restarted kernel, state_lost). Against the gateway's poll interval
              (gateway.poll_interval_seconds; requirement: detected within it plus 2 s), for
              each interval given (default 0.5 and 2 s; --quick 0.5).
  2. gateway  SIGKILL of the Kernel Gateway process: until GET /v1/sessions/{id} says "dead",
              until /readyz is 200 again with checks.gateway.restarts one higher, and until the
              next execute in that session (issued once /readyz is back) returns with a fresh
              kernel (state_lost true, the old variable gone).
  3. manager  K sessions (10; --quick 3), each holding a variable with a new value per round;
              SIGKILL of `serve` (the gateway and kernels live on), then a new `serve` on the same
              data dir with the same environment: until it prints its serving line, until /readyz
              is 200, and until all K sessions have answered a run that reads their variable
              (values checked); how many sessions were adopted (audit `session_adopted`) and
              whether the gateway was adopted (same pid) rather than replaced.
  4. reaping  a session with ttl_seconds=10 and sessions.reap_interval_seconds=0.5: time from
              its last activity (the end of its last run) until GET /v1/sessions/{id} is 404,
              and until the reaper's "expired" log line appears.

The REST client is bench/harness.py's keep-alive HTTP/1.1 client (Http). Everything started is stopped at the
end, also on failure or Ctrl-C/SIGTERM: each `serve` with SIGTERM, then whatever is left that
mentions its data dir (a gateway by process group), mounts under the data dir are detached
(`umount -l`) and the data dir removed. Results go to bench/RECOVERY.md (unless --no-write); the
very last line printed is a one-line SUMMARY.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness import (
    BENCH,
    REPO,
    Http,
    Stats,
    loadavg,
    ms_since,
    require_kernel_venv,
    run_stoppable,
    server_machine_info,
    verdict,
)
from servers import KmServer

from kernelmode.config import GatewaySettings, SessionSettings
from tests.support.procfs import machine_busy

KILLS = {
    "exit": "import os; os._exit(3)",
    "sigkill": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
}
EXPECTED_CAUSE = {  # what the cause must contain (bwrap reports a signal N as exit code 128+N too)
    "exit": {"kind": "exit", "exit_code": 3},
    "sigkill": {"kind": "signal", "signal": 9},
}
DEFAULT_POLL = float(GatewaySettings.model_fields["poll_interval_seconds"].default)
DETECT_SLACK = 2.0  # requirement: a death is detected within the poll interval plus 2 s
TTL = 10  # s, the smallest a session may ask for
REAP_INTERVAL = 0.5
POLL = 0.01  # s between polls of GET /v1/sessions/{id} and /readyz
SETTLE = 0.3  # s of quiet before a sample (pool full, nothing starting)


def other_work() -> list[str]:
    """Other test or benchmark runs on the machine (they share its 2 cores with this one)."""
    out = []
    for pat in ("pytest", "bench/load.py"):
        p = subprocess.run(["pgrep", "-af", pat], capture_output=True, text=True, check=False)
        for line in p.stdout.splitlines():
            pid, _, cmd = line.partition(" ")
            if int(pid) != os.getpid() and "pgrep" not in cmd:
                out.append(f"{pid} {cmd[:120]}")
    return out


class LoadWatch:
    """Every few seconds: which other test or benchmark runs are on the machine, and how busy
    its CPUs are (/proc/stat, all cores, this benchmark's own servers included); per step."""

    EVERY = 5.0

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def mark(self, name: str) -> None:
        self._end_step()
        self.steps.append({"name": name, "t0": time.monotonic(), "cpu0": machine_busy(), "samples": 0,
                           "busy_samples": 0, "seen": Counter()})

    def _end_step(self) -> None:
        if self.steps and "wall" not in self.steps[-1]:
            st = self.steps[-1]
            b1, t1 = machine_busy()
            b0, t0 = st["cpu0"]
            st["wall"] = time.monotonic() - st["t0"]
            st["cpu"] = 100.0 * (b1 - b0) / max(1, t1 - t0)

    async def _loop(self) -> None:
        while True:
            found = await asyncio.to_thread(other_work)
            if self.steps and "wall" not in self.steps[-1]:
                st = self.steps[-1]
                st["samples"] += 1
                st["busy_samples"] += bool(found)
                for x in found:
                    st["seen"][x.split(" ", 1)[1]] += 1
            await asyncio.sleep(self.EVERY)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="load-watch")

    async def stop(self) -> None:
        self._end_step()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def contended(self) -> bool:
        return any(st["busy_samples"] for st in self.steps)


def iso_ts(s: str) -> float:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


# -- servers ---------------------------------------------------------------------------------------


class Managed(KmServer):
    """`kernelmode serve` on its own data dir; after a crash, a successor on the same data dir."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        super().__init__(name, {"KERNELMODE_SESSIONS__REAP_INTERVAL_SECONDS": str(REAP_INTERVAL), **env},
                         data_dir=Path(tempfile.mkdtemp(prefix="kmrec-", dir="/tmp")))

    async def wait_pool_full(self, settle: float = SETTLE, timeout: float = 120, strict: bool = True,
                             need_ok: bool = True) -> bool:
        """Until /readyz is 200 and the warm pool full (nothing starting), then a short settle."""
        return await super().wait_pool_full(settle, timeout, strict, need_ok)

    def log(self) -> str:
        assert self.srv is not None
        return self.srv.log()

    def audit(self, event: str, **match: Any) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith('{"ts"'):
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                        out.append(e)
        return out

    async def audit_after(self, event: str, t_wall: float, timeout: float = 2.0, **match: Any) -> float | None:
        """ms from ``t_wall`` to the first audit event ``event`` (matching) logged after it."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.audit(event, **match):
                ts = iso_ts(e["ts"])
                if ts >= t_wall - 0.002:  # the log's timestamps have ms resolution
                    return (ts - t_wall) * 1000
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)

    async def run(self, sid: str, code: str, conn: Http | None = None) -> dict[str, Any]:
        status, body = await (conn or self.ctl).json(  # type: ignore[union-attr]
            "POST", f"/v1/sessions/{sid}/execute", {"code": code, "timeout_seconds": 60})
        if status != 200:
            raise RuntimeError(f"{self.name}: execute in {sid}: {status} {body}"[:1000])
        return body

    async def run_ok(self, sid: str, code: str, conn: Http | None = None) -> dict[str, Any]:
        body = await self.run(sid, code, conn)
        if body.get("status") != "ok":
            raise RuntimeError(f"{self.name}: {code!r} in {sid}: {body}"[:1000])
        return body

    def kill_manager(self) -> None:
        """SIGKILL of `serve` (not its gateway, which lives on for adoption)."""
        assert self.srv is not None
        self.srv.proc.kill()
        self.srv.proc.wait(10)


async def poll_until(check: Callable[[], Awaitable[bool]], t0: int, timeout: float, what: str) -> float:
    """ms from ``t0`` (perf_counter_ns) until ``check()`` is true, polling every POLL s."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return ms_since(t0)
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(POLL)


def stats(*names: str) -> dict[str, Stats]:
    return {n: Stats(n) for n in names}


# -- 1. kernel death ---------------------------------------------------------------------------------


async def step_kernel_death(m: Managed, poll: float, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n[1] kernel death, gateway poll interval {poll:g} s: {args.n} samples per way of dying",
          flush=True)
    st = stats(*(f"{k}{s}" for k in KILLS for s in ("", "_notified", "_next")))
    causes: dict[str, Counter[str]] = {k: Counter() for k in KILLS}
    kinds = list(KILLS)
    for rnd in range(args.n):
        for kind in kinds[rnd % 2:] + kinds[:rnd % 2]:
            await m.wait_pool_full()
            sid = (await m.create({}))["session_id"]
            await m.run_ok(sid, "x = 1")
            # A random phase against the gateway's poll timer (and everything else periodic).
            await asyncio.sleep(random.uniform(0, poll))
            t_wall = time.time()
            t0 = time.perf_counter_ns()
            body = await m.run(sid, KILLS[kind])
            st[kind].samples.append(ms_since(t0))
            if body.get("status") != "kernel_died" or body.get("state_lost") is not True:
                raise RuntimeError(f"{kind}: expected kernel_died, got {body}"[:1000])
            cause = body.get("cause")
            causes[kind][json.dumps(cause, sort_keys=True)] += 1
            notified = await m.audit_after("kernel_died", t_wall, session_id=sid)
            if notified is not None:
                st[f"{kind}_notified"].samples.append(notified)
            t1 = time.perf_counter_ns()
            nxt = await m.run_ok(sid, "'x' in globals()")
            st[f"{kind}_next"].samples.append(ms_since(t1))
            if nxt.get("result") != "False" or nxt.get("state_lost") is not True:
                raise RuntimeError(f"{kind}: the run after the death answered {nxt}"[:1000])
            await m.delete(sid)
        print(f"  round {rnd + 1}/{args.n}: " + ", ".join(
            f"{k} {st[k].samples[-1]:.0f} ms ({json.loads(max(causes[k], key=causes[k].get) or 'null')})"
            for k in kinds), flush=True)
    return {"poll": poll, "stats": st, "causes": causes}


# -- 2. gateway death --------------------------------------------------------------------------------


async def step_gateway(m: Managed, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n[2] gateway death (SIGKILL): {args.n} samples", flush=True)
    st = stats("dead", "ready", "exec_total", "exec", "audit_died", "audit_restarted", "pool_full")
    checks: Counter[str] = Counter()
    watch, probe = m.http(), m.http()
    for rnd in range(args.n):
        await m.wait_pool_full()
        restarts = int(m.ready["gateway"]["restarts"])
        sid = (await m.create({}))["session_id"]
        await m.run_ok(sid, "x = 1")
        gw = m.gateway_pid

        async def is_dead(sid: str = sid) -> bool:
            status, info = await watch.json("GET", f"/v1/sessions/{sid}")
            return status == 200 and info.get("status") == "dead"

        async def is_back(restarts: int = restarts) -> bool:
            status, checks_ = await m.ready_check(probe)
            return status == 200 and int(checks_["gateway"]["restarts"]) == restarts + 1

        t_wall = time.time()
        t0 = time.perf_counter_ns()
        os.kill(gw, signal.SIGKILL)
        dead, ready = await asyncio.gather(poll_until(is_dead, t0, 60, "the session marked dead"),
                                           poll_until(is_back, t0, 120, "/readyz with one more restart"))
        t1 = time.perf_counter_ns()
        body = await m.run_ok(sid, "'x' in globals()")
        st["exec"].samples.append(ms_since(t1))
        st["exec_total"].samples.append(ms_since(t0))
        st["dead"].samples.append(dead)
        st["ready"].samples.append(ready)
        checks["fresh kernel (x gone, state_lost true)"] += (
            body.get("result") == "False" and body.get("state_lost") is True)
        new_gw = m.gateway_pid
        checks["a new gateway process"] += new_gw != gw
        for key, event in (("audit_died", "gateway_died"), ("audit_restarted", "gateway_restarted")):
            ms = await m.audit_after(event, t_wall)
            if ms is not None:
                st[key].samples.append(ms)
        await m.delete(sid)
        await m.wait_pool_full()
        st["pool_full"].samples.append(ms_since(t0) - SETTLE * 1000)
        print(f"  round {rnd + 1}/{args.n}: dead {dead:.0f} ms, /readyz back {ready:.0f} ms, "
              f"next execute answered {st['exec_total'].samples[-1]:.0f} ms after the kill", flush=True)
    return {"stats": st, "checks": checks}


# -- 3. manager crash and adoption ---------------------------------------------------------------------


async def step_manager(m: Managed, args: argparse.Namespace) -> dict[str, Any]:
    k = args.k
    print(f"\n[3] manager crash (SIGKILL of serve) and adoption: {k} sessions, {args.n} samples", flush=True)
    st = stats("kill_to_serving", "serving", "adopted_audit", "adopted_to_serving", "old_pool_delete", "ready", "all_answered", "first_exec",
               "pool_full", "import")
    rows: list[dict[str, Any]] = []
    sids = [f"keep{i}" for i in range(k)]
    for sid in sids:
        await m.create({"session_id": sid})
    for rnd in range(args.n):
        values = {sid: f"{rnd}-{i}-{secrets.token_hex(4)}" for i, sid in enumerate(sids)}
        conns = [m.http() for _ in sids]
        await asyncio.gather(*(m.run_ok(sid, f"v = {values[sid]!r}", c) for sid, c in zip(sids, conns, strict=True)))
        # Reference, outside the measured interval: a new interpreter importing the server's code.
        t_imp = time.perf_counter_ns()
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", "import kernelmode.cli, kernelmode.server"],
                                check=True, cwd=str(REPO))
        st["import"].samples.append(ms_since(t_imp))
        await m.wait_pool_full()
        gw = m.gateway_pid
        assert m.data_dir is not None
        gw_log = m.data_dir / "gateway" / "gateway.log"
        gw_log_at = gw_log.stat().st_size
        await m.drop_connections()
        t_kill = time.perf_counter_ns()
        m.kill_manager()
        t0_wall = time.time()
        t0 = time.perf_counter_ns()
        serving = m.start()  # blocking until the serving line, as intended
        st["serving"].samples.append(serving * 1000)
        st["kill_to_serving"].samples.append(ms_since(t_kill))
        probe = m.http()
        conns = [m.http() for _ in sids]

        async def read_back(sid: str, conn: Http) -> tuple[str, float, dict[str, Any]]:
            t = time.perf_counter_ns()
            body = await m.run(sid, "v", conn)
            return sid, ms_since(t), body

        async def is_ready(probe: Http = probe) -> bool:
            return (await m.ready_check(probe))[0] == 200

        ready_task = asyncio.create_task(poll_until(is_ready, t0, 60, "/readyz"))
        answers = await asyncio.gather(*(read_back(sid, c) for sid, c in zip(sids, conns, strict=True)))
        st["all_answered"].samples.append(ms_since(t0))
        st["ready"].samples.append(await ready_task)
        ok = 0
        for sid, ms, body in answers:
            st["first_exec"].samples.append(ms)
            ok += body.get("status") == "ok" and body.get("result") == repr(values[sid]) \
                and body.get("state_lost") is False
        adopted_events = [e for e in m.audit("session_adopted") if e.get("session_id") in sids]
        adopted = {e["session_id"] for e in adopted_events}
        if adopted_events:
            last_adopted = max(iso_ts(e["ts"]) - t0_wall for e in adopted_events) * 1000
            st["adopted_audit"].samples.append(last_adopted)
            st["adopted_to_serving"].samples.append(serving * 1000 - last_adopted)
        same_gw = m.gateway_pid == gw
        _, listing = await m.ctl.json("GET", "/v1/sessions")  # type: ignore[union-attr]
        lost = sum(1 for s in listing["sessions"] if s["session_id"] in sids and s["status"] == "lost")
        # The gateway's access log: how long the new manager's DELETEs of the old pool's kernels took.
        deletes = [float(x.group(1)) for x in re.finditer(
            rb"\d{3} DELETE /api/kernels/\S+ \([^)]*\) ([\d.]+)ms", gw_log.read_bytes()[gw_log_at:])]
        if deletes:
            st["old_pool_delete"].samples.append(sum(deletes))
        rows.append({"adopted": len(adopted), "deletes": len(deletes), "values_ok": ok, "same_gateway": same_gw, "lost": lost})
        await m.wait_pool_full()
        st["pool_full"].samples.append(ms_since(t0) - SETTLE * 1000)
        print(f"  round {rnd + 1}/{args.n}: serving line {serving * 1000:.0f} ms, all {k} answered "
              f"{st['all_answered'].samples[-1]:.0f} ms after the start; adopted {len(adopted)}/{k}, "
              f"values {ok}/{k}, gateway {'adopted' if same_gw else 'REPLACED'}", flush=True)
        if ok != k:
            bad = [(sid, body) for sid, _, body in answers if body.get("result") != repr(values[sid])]
            print(f"  values not read back: {bad[:3]}"[:1000], flush=True)
    return {"k": k, "stats": st, "rows": rows}


# -- 4. idle reaping ---------------------------------------------------------------------------------


async def step_reap(m: Managed, args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n[4] idle reaping: ttl_seconds={TTL}, reap interval {REAP_INTERVAL:g} s, {args.n} samples",
          flush=True)
    st = stats("gone", "gone_client", "expired_line", "closed_audit")
    assert m.srv is not None
    for rnd in range(args.n):
        await m.wait_pool_full()
        # The previous sample ended at a reaper pass: a random phase against its timer.
        await asyncio.sleep(random.uniform(0, 2 * REAP_INTERVAL))
        sid = (await m.create({"ttl_seconds": TTL}))["session_id"]
        await m.run_ok(sid, "1 + 1")
        t_answer = time.time()
        status, info = await m.ctl.json("GET", f"/v1/sessions/{sid}")  # type: ignore[union-attr]
        last = iso_ts(info["last_activity"])
        marker = f"session {sid} expired".encode()
        log_at = m.srv.log_path.stat().st_size
        line_seen: float | None = None
        await asyncio.sleep(max(0.0, last + TTL - 0.5 - time.time()))
        while True:
            status, _ = await m.ctl.json("GET", f"/v1/sessions/{sid}")  # type: ignore[union-attr]
            now = time.time()
            if line_seen is None:
                with open(m.srv.log_path, "rb") as f:  # noqa: ASYNC230 (a small read, 100 times a second)
                    f.seek(log_at)
                    if marker in f.read():
                        line_seen = now
            if status == 404:
                break
            if status != 200:
                raise RuntimeError(f"GET {sid}: {status}")
            if now > last + TTL + 30:
                raise RuntimeError(f"session {sid} not reaped {TTL + 30} s after its last activity")
            await asyncio.sleep(POLL)
        st["gone"].samples.append(now - last)
        st["gone_client"].samples.append(now - t_answer)
        if line_seen is not None:
            st["expired_line"].samples.append(line_seen - last)
        closed = await m.audit_after("session_closed", last, session_id=sid, reason="expired")
        if closed is not None:
            st["closed_audit"].samples.append(closed / 1000)
        print(f"  round {rnd + 1}/{args.n}: 404 {now - last:.2f} s after the last activity "
              f"(expired line {(line_seen or float('nan')) - last:.2f} s)", flush=True)
    return {"stats": st}


# -- report ------------------------------------------------------------------------------------------


def row(label: str, s: Stats, unit_ms: bool = True, bound: str = "", verdict: str = "") -> str:
    if not s.samples:
        return f"| {label} | - | - | - | 0 | {bound} | {verdict} |"
    d = 0 if unit_ms else 2
    return (f"| {label} | {s.median:.{d}f} | {s.pct(90):.{d}f} | {max(s.samples):.{d}f} | {s.n} | "
            f"{bound} | {verdict} |")


def cause_text(c: Counter[str]) -> str:
    return ", ".join(f"{n} x `{k}`" for k, n in c.most_common())


def cause_matches(causes: Counter[str], expected: dict[str, Any]) -> bool:
    return bool(causes) and all(
        (c := json.loads(text)) is not None and all(c.get(key) == v for key, v in expected.items())
        for text in causes)


def death_ok(d: dict[str, Any]) -> bool:
    bound = (d["poll"] + DETECT_SLACK) * 1000
    return all(s.samples and max(s.samples) <= bound for k, s in d["stats"].items() if k in KILLS)


def summary_line(res: dict[str, Any]) -> str:
    parts = ["SUMMARY recovery"]
    for d in res["death"]:
        parts.append(f"kernel_died(poll {d['poll']:g}s) exit={d['stats']['exit'].median:.0f}ms "
                     f"sigkill={d['stats']['sigkill'].median:.0f}ms "
                     f"max={max(max(d['stats'][k].samples) for k in KILLS):.0f}ms "
                     f"(bound {(d['poll'] + DETECT_SLACK) * 1000:.0f}ms {'ok' if death_ok(d) else 'EXCEEDED'})")
    g = res["gateway"]["stats"]
    parts.append(f"gateway dead={g['dead'].median:.0f}ms readyz={g['ready'].median:.0f}ms "
                 f"next_exec={g['exec_total'].median:.0f}ms")
    a = res["manager"]
    s = a["stats"]
    adopted = min(r["adopted"] for r in a["rows"])
    values = min(r["values_ok"] for r in a["rows"])
    parts.append(f"restart serving={s['serving'].median:.0f}ms all_{a['k']}_answered="
                 f"{s['all_answered'].median:.0f}ms adopted>={adopted}/{a['k']} values>={values}/{a['k']}")
    r = res["reap"]["stats"]
    parts.append(f"reap 404={r['gone'].median:.2f}s (ttl {TTL}s + interval {REAP_INTERVAL:g}s)")
    return " | ".join(parts)


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    head = "| what | median | p90 | max | N | bound / expected | |\n|---|---|---|---|---|---|---|"
    t1 = []
    for d in res["death"]:
        poll = d["poll"]
        bound = (poll + DETECT_SLACK) * 1000
        t1.append(f"| **gateway poll interval {poll:g} s**{' (the default)' if poll == DEFAULT_POLL else ''} "
                  "| | | | | | |")
        for kind in KILLS:
            s = d["stats"][kind]
            ok = bool(s.samples) and max(s.samples) <= bound
            t1.append(row(f"&nbsp;&nbsp;`{KILLS[kind]}`: POST until the kernel_died response", s,
                          bound=f"<= {bound:.0f} (poll + 2 s)", verdict=verdict(ok)))
            t1.append(row("&nbsp;&nbsp;&nbsp;&nbsp;of which: until the manager heard of it (audit `kernel_died`)",
                          d["stats"][f"{kind}_notified"], bound=f"~ U(0, {poll * 1000:.0f}) + kernel exit"))
            t1.append(row("&nbsp;&nbsp;&nbsp;&nbsp;then the next execute (restarted kernel, state_lost)",
                          d["stats"][f"{kind}_next"]))
    causes = "\n".join(
        f"- poll {d['poll']:g} s, `{KILLS[k]}`: {cause_text(d['causes'][k])} "
        f"(must contain `{json.dumps(EXPECTED_CAUSE[k], sort_keys=True)}`: "
        f"{verdict(cause_matches(d['causes'][k], EXPECTED_CAUSE[k]))})"
        for d in res["death"] for k in KILLS)
    g = res["gateway"]["stats"]
    gchecks = res["gateway"]["checks"]
    t2 = "\n".join([
        row("SIGKILL until GET /v1/sessions/{id} says `dead`", g["dead"]),
        row("&nbsp;&nbsp;the manager's audit `gateway_died`", g["audit_died"]),
        row("SIGKILL until the manager's audit `gateway_restarted`", g["audit_restarted"]),
        row("SIGKILL until /readyz is 200 with `checks.gateway.restarts` + 1", g["ready"]),
        row("SIGKILL until the next execute in the session answered (sent once /readyz is back)",
            g["exec_total"]),
        row("&nbsp;&nbsp;that execute alone (a fresh kernel started for the session)", g["exec"]),
        row("SIGKILL until the warm pool is full again", g["pool_full"]),
    ])
    a = res["manager"]
    s = a["stats"]
    k = a["k"]
    rows_ = a["rows"]
    adopted_ok = all(r["adopted"] == k for r in rows_)
    values_ok = all(r["values_ok"] == k for r in rows_)
    gw_ok = all(r["same_gateway"] for r in rows_)
    t3 = "\n".join([
        row("new `serve` started until it prints its serving line", s["serving"]),
        row("&nbsp;&nbsp;of which: until the last `session_adopted` audit line", s["adopted_audit"]),
        row("&nbsp;&nbsp;then until the serving line (the old pool's kernels shut down, their "
            "workspaces removed, HTTP bound)", s["adopted_to_serving"]),
        row("&nbsp;&nbsp;&nbsp;&nbsp;of which: the gateway's DELETE /api/kernels of the old pool's kernels "
            "(sum of the durations in its access log)", s["old_pool_delete"]),
        row("&nbsp;&nbsp;reference (not in the interval): `python -c 'import kernelmode.cli, "
            "kernelmode.server'`", s["import"]),
        row("SIGKILL of the old `serve` until the new one's serving line", s["kill_to_serving"]),
        row("new `serve` started until /readyz is 200", s["ready"]),
        row(f"new `serve` started until all {k} sessions answered a run reading their variable",
            s["all_answered"]),
        row("&nbsp;&nbsp;each of those runs (sent concurrently right after the serving line)", s["first_exec"]),
        row("new `serve` started until its warm pool is full", s["pool_full"]),
        row("for comparison: a fresh `serve` on an empty data dir (starts its own gateway) until "
            "its serving line", res["fresh_starts"]),
    ])
    per_round = ", ".join(f"{r['adopted']}/{k}" for r in rows_)
    r = res["reap"]["stats"]
    t4 = "\n".join([
        row("last activity (the session's `last_activity`) until GET is 404", r["gone"], unit_ms=False,
            bound=f"{TTL} .. {TTL + REAP_INTERVAL:g} + delete",
            verdict=verdict(bool(r["gone"].samples) and max(r["gone"].samples) <= TTL + REAP_INTERVAL + 1)),
        row("&nbsp;&nbsp;the client's receipt of the last run's answer until 404", r["gone_client"], unit_ms=False),
        row("&nbsp;&nbsp;last activity until the reaper's `session ... expired` log line was seen",
            r["expired_line"], unit_ms=False, bound=f"{TTL} .. {TTL + REAP_INTERVAL:g}"),
        row("&nbsp;&nbsp;last activity until the audit `session_closed` (reason expired)",
            r["closed_audit"], unit_ms=False),
    ])
    machine = "\n".join(f"| {key} | {val} |" for key, val in res["machine"].items())
    busy_start, busy_end = res["busy_start"], res["busy_end"]

    def busy_text(xs: list[str]) -> str:
        return "none" if not xs else "; ".join(f"`{x}`" for x in xs)

    watch: LoadWatch = res["watch"]
    busy = ""
    if busy_start or busy_end or watch.contended or res.get("waited_out"):
        busy = ("\n\n**Other work ran on the machine during this run** (other test and benchmark runs "
                f"sharing its {os.cpu_count()} cores, so the latencies include CPU contention; see the "
                "load table at the end): at the start " + busy_text(busy_start)
                + "; at the end " + busy_text(busy_end) + "."
                + (f" The benchmark waited {res['waited']:.0f} s for the machine to be free of them, then "
                   "ran anyway." if res.get("waited_out") else
                   f" The benchmark waited {res['waited']:.0f} s until none ran, then started; others "
                   "started meanwhile." if res.get("waited", 0) > 0 else ""))
    load_rows = "\n".join(
        f"| {st['name']} | {st.get('wall', 0):.0f} | {st.get('cpu', float('nan')):.0f} % | "
        f"{st['busy_samples']}/{st['samples']} | "
        + ("; ".join(f"`{c[:90]}`" for c in st["seen"]) or "none") + " |"
        for st in watch.steps)
    return f"""# Recovery: failure detection and recovery times

Generated by `{' '.join(['bench/recovery.py', *sys.argv[1:]])}` on {res['machine']['date']}; wall time
{res['wall']:.0f} s. Times in ms unless marked s; each measurement repeated N times (N = {args.n}),
reported as median, p90 (linear interpolation between closest ranks) and max. Every sample is
taken on a real `kernelmode serve` (bubblewrap sandbox, Kernel Gateway, default warm pool of 2)
started by `tests.support.server.start_server`, each step on its own fresh data dir; the client is the
lean keep-alive HTTP/1.1 client of [harness.py](harness.py) (`Http`), in the same process, polling every
{POLL * 1000:.0f} ms where it waits for a state.{busy}

`{summary_line(res)}`

## 1. Kernel death: until the run's response says `kernel_died`

{head}
{chr(10).join(t1)}

Causes returned:

{causes}

Method: per sample a new session (from the warm pool, after waiting until the pool is full and
{SETTLE:g} s more), one `x = 1`, then `POST /v1/sessions/{{id}}/execute` with the code above, timed
from before the request until its response (HTTP 200, `status: kernel_died`, `state_lost: true`)
is read. The two ways of dying alternate. How it is detected: the Kernel Gateway's
`KernelRestarter` checks every `gateway.poll_interval_seconds` (env
`KERNELMODE_GATEWAY__POLL_INTERVAL_SECONDS`, which sets its `time_to_dead`) whether the kernel
process lives; on a death it restarts the kernel and tells the websocket, the manager ends the run
as `kernel_died` and reads the cause from the death record the provisioner wrote. "Until the
manager heard of it" is the timestamp of the manager's audit line `kernel_died` (ms resolution)
minus the wall-clock time the request was sent. The requirement: a death is detected within the
poll interval plus {DETECT_SLACK:g} s, checked against the **max**. Then `'x' in globals()` is run
in the same session at once (it waits for the restarted kernel) and must answer `False` with
`state_lost: true`.

## 2. Gateway death (SIGKILL of the Kernel Gateway process)

{head}
{t2}

Checks: {', '.join(f'{name}: {n}/{args.n}' for name, n in gchecks.items())}.

Method: per sample, after waiting until /readyz is 200 and the pool full, a new session runs
`x = 1`; the gateway (the `serve` process's child running `kernel_gateway`) is killed with
SIGKILL; the client then polls, concurrently, `GET /v1/sessions/{{id}}` until `status` is `dead`
and `GET /readyz` until it is 200 with `checks.gateway.restarts` one more than before. Then the
same session runs `'x' in globals()`, which must answer `False` with `state_lost: true` (a fresh
kernel on the same workspace). The audit rows are the manager's audit lines' timestamps minus the
kill's wall-clock time. The session is deleted after each sample and the next waits for the
refilled pool.

## 3. Manager crash and adoption (SIGKILL of `serve`, a new `serve` on the same data dir)

{head}
{t3}

Adopted sessions per round: {per_round} ({verdict(adopted_ok)}: all {k} in every round); variables
read back intact: {verdict(values_ok)} ({', '.join(str(r['values_ok']) for r in rows_)} of {k});
gateway adopted (same pid) rather than replaced: {verdict(gw_ok)}
({sum(r['same_gateway'] for r in rows_)}/{len(rows_)}); sessions `lost`:
{sum(r['lost'] for r in rows_)}; kernels the new manager deleted through the gateway before serving
(the old pool's) per round: {', '.join(str(r['deletes']) for r in rows_)}.

Method: one data dir and {k} sessions (`keep0`..`keep{k - 1}`) for the whole step. Each round sets
`v` to a new random string in every session (concurrently), waits until the warm pool is full,
then SIGKILLs the `serve` process only (its gateway and kernels live on; the gateway's orphan
timeout is the default {GatewaySettings.model_fields['orphan_timeout_seconds'].default:g} s) and
at once starts a new `serve` on the same data dir with the same environment (a new port and API
token). "Started" is just before `subprocess.Popen`; the serving line is the `kernelmode serving
on ...` line on its stdout (the new manager adopts the gateway, reconnects to every session's
kernel and shuts down the old manager's pool kernels before it prints it). Right after the serving
line the client reads `v` in all {k} sessions concurrently (one connection each) while it polls
/readyz; each answer must be the value set before the kill with `state_lost: false`. Adopted
sessions are counted from the new manager's audit lines `session_adopted`; "until the last
`session_adopted`" is the latest of their timestamps minus the wall-clock start. The reference row
is a new interpreter importing `kernelmode.cli` and `kernelmode.server` (run before each kill,
outside the timed interval): the part of a start that is Python startup and imports. The next round kills
this `serve` in turn, so from the second round on the gateway being adopted is one a previous
successor had adopted. The fresh-start row counts every start of a new `serve` on an empty data
dir in this run (one per step and poll interval).

## 4. Idle reaping

| what | median s | p90 s | max s | N | expected s | |
|---|---|---|---|---|---|---|
{t4}

Method: the server runs with `KERNELMODE_SESSIONS__REAP_INTERVAL_SECONDS={REAP_INTERVAL:g}` (default
{SessionSettings.model_fields['reap_interval_seconds'].default:g} s); per sample a session is created
with `ttl_seconds: {TTL}` (the smallest allowed), runs `1 + 1` (its last activity, which sets
`expires_at = last_activity + ttl`), and is then left alone: from {TTL - 0.5:g} s after its
`last_activity` (read back with GET, which does not count as activity) the client polls GET until
it is 404, and watches the server's log for the reaper's line `session <id> expired after ...`.
Times are wall-clock differences on the same host against the server's `last_activity`
timestamp. A session is reaped at the first reaper pass after it expires (within
`reap_interval_seconds`), then deleted (its history kept as a notebook artifact, its kernel shut
down, its workspace removed): GET is 404 once the delete has finished. The verdict checks the
max against ttl + interval + 1 s.

## Machine

| | |
|---|---|
{machine}

Load per step: the machine's CPU use over the step (all {os.cpu_count()} cores; this benchmark's own
servers and kernels included), and the other test or benchmark runs (`pgrep -af pytest`,
`pgrep -af bench/load.py`) seen by a check every {LoadWatch.EVERY:g} s:

| step | wall s | CPU busy | checks that saw other runs | other runs seen |
|---|---|---|---|---|
{load_rows}
"""


# -- main --------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    load_start = loadavg()
    res: dict[str, Any] = {"busy_start": other_work(), "death": [], "fresh_starts": Stats("fresh"),
                           "waited": args.waited, "waited_out": args.waited_out}
    servers: list[Managed] = []
    watch = LoadWatch()
    res["watch"] = watch

    def new_server(name: str, env: dict[str, str]) -> Managed:
        m = Managed(name, env)
        servers.append(m)
        print(f"starting kernelmode serve ({name}) ...", flush=True)
        res["fresh_starts"].samples.append(m.start() * 1000)
        return m

    async def done(m: Managed) -> None:
        await m.stop(timeout=120)

    async with contextlib.AsyncExitStack() as stack:
        async def done_all() -> None:
            for m in servers:
                await done(m)

        stack.push_async_callback(done_all)
        stack.push_async_callback(watch.stop)
        watch.start()
        try:
            for poll in args.poll_intervals:
                watch.mark(f"1. kernel death, poll {poll:g} s")
                m = new_server(f"death poll={poll:g}", {"KERNELMODE_GATEWAY__POLL_INTERVAL_SECONDS": str(poll)})
                res["death"].append(await step_kernel_death(m, poll, args))
                await m.wait_pool_full()
                res["ready"] = dict(m.ready)
                await done(m)
            watch.mark("2. gateway death")
            m = new_server("gateway", {})
            res["gateway"] = await step_gateway(m, args)
            await done(m)
            watch.mark("3. manager crash + adoption")
            m = new_server("manager", {"KERNELMODE_SESSIONS__MAX_SESSIONS": str(args.k + 10)})
            res["manager"] = await step_manager(m, args)
            await done(m)
            watch.mark("4. idle reaping")
            m = new_server("reap", {})
            res["reap"] = await step_reap(m, args)
            await done(m)
        except Exception:
            for m in servers:
                m.keep_logs = True
            raise
    res["busy_end"] = other_work()
    res["machine"] = server_machine_info(res.get("ready", {}), load_start, kernels="the sandboxed kernels")
    res["machine"]["other test or benchmark runs (start / end)"] = (
        f"{len(res['busy_start'])} / {len(res['busy_end'])} processes")
    res["wall"] = time.monotonic() - started
    text = report(res, args)
    print()
    print(text)
    if not args.no_write:
        (BENCH / "RECOVERY.md").write_text(text)
        print("wrote bench/RECOVERY.md")
    print(f"wall time {res['wall']:.0f} s")
    print(summary_line(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=3 samples, K=3 sessions, poll interval 0.5 s only")
    p.add_argument("--no-write", action="store_true", help="do not write bench/RECOVERY.md")
    p.add_argument("--poll-intervals", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help=f"gateway poll intervals for step 1 (default {DEFAULT_POLL:g},2; --quick {DEFAULT_POLL:g})")
    p.add_argument("--wait-for-idle", type=float, default=0, metavar="SECONDS",
                   help="first wait up to this long (polling every 30 s) until no pytest or "
                        "bench/load.py runs on the machine; run anyway after that (said in the .md)")
    args = p.parse_args()
    args.n = 3 if args.quick else 10
    args.k = 3 if args.quick else 10
    args.poll_intervals = args.poll_intervals or ([DEFAULT_POLL] if args.quick else [DEFAULT_POLL, 2.0])
    require_kernel_venv(p)
    args.waited, args.waited_out = 0.0, False
    if args.wait_for_idle > 0:
        t0 = time.monotonic()
        while (busy := other_work()) and time.monotonic() - t0 < args.wait_for_idle:
            print(f"waiting for other work to finish: {busy}", flush=True)
            time.sleep(30)
        args.waited = time.monotonic() - t0
        args.waited_out = bool(other_work())
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
