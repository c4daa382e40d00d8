"""Several managers on one PostgreSQL store (issue 31, Measured): what a run costs through 1, 2
and 3 managers behind a round-robin balancer against one SQLite manager, and how long a session
takes to answer again after its owner is SIGKILLed.

Run:  .venv/bin/python bench/managers.py [--part throughput|failover|both] [--sessions K]
      [--runs M] [--rounds R] [--lease S] [--kills N] [--default-kills N] [--no-write]

Every manager is a real `kernelmode serve` (bwrap kernels, no warm pool, the reaper as deployed)
driving an external Kernel Gateway this script starts (tests/support/managers.py's layout: one
gateway, shared token and artifact store, a data dir each); the PostgreSQL server is a
throwaway cluster (tests/support/postgres.py), a database per group. Every request goes through
the round-robin balancer stand-in (tests/support/round_robin.py), the one-manager groups too, so
each path pays the same extra hop.

  throughput  groups sqlite-1 (SQLite store), pg-1, pg-2, pg-3 (one PostgreSQL database each),
              all started first and kept; per round each group in turn (the order rotated every
              round) runs K sessions at once, each M runs of `x += 1; x` (every value checked).
              Runs/s, and CPU per run of the managers, of the gateway and of the PostgreSQL server
              (/proc/<pid>/task/*/schedstat before and after each group's turn). At the end every
              acknowledged run must be in the store exactly once.
  failover    3 managers on PostgreSQL with store.lease_seconds = --lease (and once more with the
              default 10 s, --default-kills times): create a session through the balancer, set a
              variable, SIGKILL the session's owner, then ask through the balancer for the
              variable until it answers (a 503 waits its Retry-After, as kernelmode.client does;
              a 502 is the balancer reaching the dead manager, asked again at once); the time
              from the kill to the first correct answer, and when the store showed the lease
              expired and taken by another manager; the killed manager is restarted; each
              acknowledged run must be in the store exactly once.

Results go to the "managers" section of bench/RESULTS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from harness import BENCH, Http, Stats, loadavg, require_kernel_venv, run_stoppable, write_section
from managers_failover import FailoverSeries, failover_report, run_series
from servers import AS_DEPLOYED, git

from tests.support.managers import Managers, start_managers
from tests.support.postgres import PgCluster
from tests.support.procfs import cpu_ns, descendants
from tests.support.round_robin import RoundRobin
from tests.support.run_ledger import by_value, stored_runs, tally

SECTION = "managers"
BASE_ENV = {**AS_DEPLOYED, "KERNELMODE_SESSIONS__POOL_SIZE": "0"}
GROUPS = ("sqlite-1", "pg-1", "pg-2", "pg-3")  # store and number of managers
IDLE_S = 5.0  # seconds over which the groups' idle CPU is measured
INCREMENT = json.dumps({"code": "x += 1; x"}).encode()


# -- groups of managers ----------------------------------------------------------------------------


@contextlib.contextmanager
def managers(n: int, store_url: str | None, env_extra: dict[str, str]) -> Iterator[Managers]:
    """``n`` managers on a gateway of their own (tests/support/managers.py), on ``store_url``
    (None: SQLite in the manager's data dir), with the deployed defaults and no warm pool."""
    with start_managers(n, store_url, {**BASE_ENV, **env_extra}) as ms:
        yield ms


def postmaster_pid(pg: PgCluster) -> int:
    return int((pg.data / "postmaster.pid").read_text().split()[0])


def pg_cpu_ns(pg: PgCluster) -> int:
    """The PostgreSQL server's CPU: the postmaster and its backends."""
    root = postmaster_pid(pg)
    return sum(cpu_ns(p) for p in (root, *descendants(root)))


def runs_in_store(store_url: str | None, ms: Managers, sid: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(run_id, code, result record) of every run the store holds for ``sid``."""
    if store_url:
        return stored_runs(store_url, sid)
    db = sqlite3.connect(ms.data_dir(0) / "sessions.sqlite3", timeout=30)
    try:
        rows = db.execute("SELECT run_id, code, result FROM runs WHERE session_id=?", (sid,)).fetchall()
    finally:
        db.close()
    return [(str(r), str(code), json.loads(res)) for r, code, res in rows]


@dataclass
class Group:
    name: str
    n: int
    ms: Managers
    lb: RoundRobin
    store_url: str | None
    pg: PgCluster
    counters: dict[str, int] = field(default_factory=dict)  # session -> x
    acked: dict[str, list[str]] = field(default_factory=dict)  # session -> acknowledged run ids
    errors: list[str] = field(default_factory=list)
    rate: Stats = field(default_factory=lambda: Stats("runs/s"))
    cpu: dict[str, Stats] = field(default_factory=lambda: {k: Stats(k) for k in ("managers", "gateway", "postgres",
                                                                                 "client")})
    runs: int = 0

    def cpu_now(self) -> dict[str, int]:
        return {"managers": sum(cpu_ns(s.proc.pid) for s in self.ms.servers), "gateway": cpu_ns(self.ms.gateway.proc.pid),
                "postgres": pg_cpu_ns(self.pg), "client": time.process_time_ns()}

    async def setup(self, sessions: int) -> None:
        """``sessions`` sessions created through the balancer, x = 0 in each, a warm-up run."""
        http = Http(self.lb.url, self.ms.token)
        try:
            for _ in range(sessions):  # one after the other: the balancer spreads the owners
                status, body = await http.json("POST", "/v1/sessions", {})
                if status != 201:
                    raise RuntimeError(f"{self.name}: create answered {status} {body}")
                self.counters[body["session_id"]], self.acked[body["session_id"]] = 0, []
            for sid in self.counters:
                for code in ("x = 0", "x"):
                    status, body = await http.json("POST", f"/v1/sessions/{sid}/execute", {"code": code})
                    if status != 200 or body.get("status") != "ok":
                        raise RuntimeError(f"{self.name}: {code!r} answered {status} {body}")
                    self.acked[sid].append(body["run_id"])
        finally:
            await http.close()

    async def _client(self, sid: str, runs: int) -> None:
        http = Http(self.lb.url, self.ms.token)
        try:
            for _ in range(runs):
                want = self.counters[sid] + 1
                status, data = await http.request("POST", f"/v1/sessions/{sid}/execute", INCREMENT)
                body = json.loads(data) if data else {}
                if status != 200 or body.get("status") != "ok" or body.get("result") != str(want):
                    self.errors.append(f"{sid}: {status} {str(body)[:300]}")
                    return  # x is unknown now: this client stops
                self.counters[sid] = want
                self.acked[sid].append(body["run_id"])
        finally:
            await http.close()

    async def turn(self, runs: int) -> None:
        """One round's turn: every session ``runs`` times at once; rate and CPU recorded."""
        before, t0 = self.cpu_now(), time.perf_counter()
        done0 = sum(map(len, self.acked.values()))
        await asyncio.gather(*(self._client(sid, runs) for sid in self.counters))
        wall = time.perf_counter() - t0
        after = self.cpu_now()
        done = sum(map(len, self.acked.values())) - done0
        self.runs += done
        self.rate.samples.append(done / wall)
        for k, s in self.cpu.items():
            s.samples.append((after[k] - before[k]) / 1e6 / max(done, 1))

    def owners(self) -> str:
        """How many of the sessions each manager holds (from the leases)."""
        if not self.store_url or self.n == 1:
            return str(len(self.counters))
        import psycopg

        with psycopg.connect(self.store_url, autocommit=True) as conn:
            rows = conn.execute("SELECT m.url, COUNT(*) FROM leases l JOIN managers m USING (manager_id) "
                                "WHERE l.expires_at > now() GROUP BY m.url").fetchall()
        held = dict(rows)
        return "+".join(str(held.get(s.url, 0)) for s in self.ms.servers)

    def check_store(self) -> dict[str, int]:
        """Each acknowledged run in the store exactly once: lost, extra (stored, never
        acknowledged), duplicated (a value of x stored twice: a run executed twice)."""
        out: Counter[str] = Counter(acked=0, lost=0, extra=0, duplicated=0)
        for sid, acked in self.acked.items():
            out.update(tally(runs_in_store(self.store_url, self.ms, sid), acked, by_value))
        return dict(out)


# -- the two parts ---------------------------------------------------------------------------------


async def throughput(args: argparse.Namespace, pg: PgCluster, stack: contextlib.ExitStack) -> dict[str, Any]:
    groups: list[Group] = []
    for name in args.groups:
        print(f"starting {name} ...", flush=True)
        n = int(name[-1])
        url = pg.create_database(name.replace("-", "_")) if name.startswith("pg") else None
        ms = await asyncio.to_thread(stack.enter_context, managers(n, url, {}))
        lb = stack.enter_context(RoundRobin([s.url for s in ms.servers]))
        g = Group(name, n, ms, lb, url, pg)
        try:
            await g.setup(args.sessions)
        except RuntimeError as e:  # measured what exists: the block says what failed
            g.errors.append(f"setup: {e}"[:400])
        groups.append(g)
    # what the groups' managers spend idle (heartbeats, reapers), all over the same seconds
    idle0 = {g.name: g.cpu_now()["managers"] for g in groups}
    await asyncio.sleep(IDLE_S)
    idle = {g.name: (g.cpu_now()["managers"] - idle0[g.name]) / 1e6 / IDLE_S for g in groups}
    t0 = time.monotonic()
    running = [g for g in groups if not g.errors]
    for rnd in range(args.rounds):
        k = rnd % max(len(running), 1)
        for g in running[k:] + running[:k]:
            await g.turn(args.runs)
            print(f"  round {rnd + 1}/{args.rounds} {g.name}: {g.rate.samples[-1]:.1f} runs/s, managers "
                  f"{g.cpu['managers'].samples[-1]:.1f} ms/run", flush=True)
    wall = time.monotonic() - t0
    checks = {g.name: await asyncio.to_thread(g.check_store) for g in groups}
    owners = {g.name: await asyncio.to_thread(g.owners) for g in groups}
    return {"groups": groups, "checks": checks, "owners": owners, "idle": idle, "wall": wall}


def readings(groups: list[Group]) -> list[str]:
    """What the table says, in figures: PostgreSQL's price per run and forwarding's."""
    by = {g.name: g for g in groups if g.rate.n}
    out = []
    lite, one = by.get("sqlite-1"), by.get("pg-1")
    if lite and one:
        out.append(f"- PostgreSQL instead of SQLite (pg-1 against sqlite-1): "
                   f"{one.cpu['managers'].median - lite.cpu['managers'].median:+.1f} ms of manager CPU and "
                   f"{one.cpu['postgres'].median - lite.cpu['postgres'].median:+.1f} ms of the PostgreSQL server's "
                   f"per run; {one.rate.median / lite.rate.median:.2f}x the runs/s.")
    for name in ("pg-2", "pg-3"):
        g = by.get(name)
        if g and one:
            share = (g.n - 1) / g.n
            extra = g.cpu["managers"].median - one.cpu["managers"].median
            out.append(f"- {name}: {share:.0%} of requests forwarded; {extra:+.1f} ms of manager CPU per run "
                       f"against pg-1, so about **{extra / share:.1f} ms per forwarded request** (both managers' "
                       f"share of the hop); {g.rate.median / one.rate.median:.2f}x pg-1's runs/s on these 2 cores.")
    return out


def throughput_report(res: dict[str, Any], args: argparse.Namespace) -> str:
    groups: list[Group] = res["groups"]
    base = groups[0]

    def row(g: Group) -> str:
        ck = res["checks"][g.name]
        if not g.rate.n:
            return f"| {g.name} | {res['owners'][g.name]} | not measured: setup failed (below) |" + " |" * 10
        c = {k: s.median for k, s in g.cpu.items()}
        return (f"| {g.name} | {res['owners'][g.name]} | {' / '.join(f'{x:.1f}' for x in g.rate.samples)} | **{g.rate.median:.1f}** | "
                f"{g.rate.median / base.rate.median:.2f}x | **{c['managers']:.1f}** | "
                f"{c['managers'] / base.cpu['managers'].median:.2f}x | {c['gateway']:.1f} | {c['postgres']:.1f} | "
                f"{c['client']:.1f} | {res['idle'][g.name]:.1f} | {ck['acked']} / {ck['lost']} / {ck['duplicated']} / {ck['extra']} | "
                f"{len(g.errors)} |")

    errs = "".join(f"\n- {g.name}: `{e}`" for g in groups for e in g.errors[:3])
    errs = "\n" + "\n".join(readings(groups)) + errs
    return f"""### Throughput: one SQLite manager against 1, 2 and 3 managers on PostgreSQL

{args.sessions} sessions at once per group, each {args.runs} runs of `x += 1; x` per turn, {args.rounds} rounds
(the groups' order rotated every round; {res['wall']:.0f} s in all). Every request through the
round-robin balancer stand-in, so with N managers N-1 of every N requests reach a manager that
does not own the session and are forwarded to the owner. CPU in ms per run, medians over the
rounds (managers: all of the group's `serve` processes together; postgres: the whole server,
the other groups' idle heartbeats included; client: this script, with the balancer's thread;
managers idle: the group's managers' CPU per second over {IDLE_S:g} s with nothing running, the
floor that heartbeats and reapers cost whatever the load).

| group | sessions per manager | runs/s per round | runs/s median | vs sqlite-1 | managers CPU ms/run | vs sqlite-1 | gateway ms/run | postgres ms/run | client+balancer ms/run | managers idle ms/s | acked / lost / duplicated / unacked in store | failed runs |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(row(g) for g in groups)}
{errs}"""


async def run(args: argparse.Namespace) -> int:
    load_start, started = loadavg(), time.monotonic()
    commit = git("rev-parse", "--short", "HEAD")
    parts: list[str] = []
    summary: dict[str, Any] = {}
    ok = True
    pg = await asyncio.to_thread(PgCluster)
    try:
        if args.part in ("throughput", "both"):
            with contextlib.ExitStack() as stack:
                res = await throughput(args, pg, stack)
                print("stopping the throughput groups ...", flush=True)
                await asyncio.to_thread(stack.close)
            parts.append(throughput_report(res, args))
            summary["throughput"] = {g.name: round(g.rate.median, 1) for g in res["groups"] if g.rate.n}
            summary["manager_cpu_ms"] = {g.name: round(g.cpu["managers"].median, 1) for g in res["groups"] if g.rate.n}
            ok &= all(not g.errors for g in res["groups"]) and all(
                c["lost"] == 0 and c["duplicated"] == 0 for c in res["checks"].values())
        if args.part in ("failover", "both"):
            series: list[FailoverSeries] = []
            for lease, kills in ((args.lease, args.kills), (10.0, args.default_kills)):
                if kills <= 0:
                    continue
                print(f"failover, lease {lease:g} s, {kills} kills ...", flush=True)
                url = pg.create_database(f"failover_{int(lease)}")
                env = {"KERNELMODE_STORE__LEASE_SECONDS": f"{lease:g}"}
                with managers(3, url, env) as ms, RoundRobin([s.url for s in ms.servers]) as lb:
                    s = await run_series(ms, lb, url, lease, kills, args.give_up,
                                         lambda sid, ms=ms, url=url: runs_in_store(url, ms, sid))
                series.append(s)
            parts.append(failover_report(series))
            summary["failover_s"] = {f"lease {s.lease:g}": s.summary() for s in series}
            ok &= all(s.clean for s in series)
    finally:
        await asyncio.to_thread(pg.stop)
    body = f"""## Several managers on one PostgreSQL store (issue 31; bench/managers.py)

Generated by `{' '.join(['bench/managers.py', *sys.argv[1:]])}` at commit {commit} on
{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall time {time.monotonic() - started:.0f} s.
Machine: a **shared 2-core** one (other engineers' tests run on it); load average (1, 5, 15 min)
{load_start} at the start, {loadavg()} at the end. Real `kernelmode serve` processes (bwrap
kernels, no warm pool), an external Kernel Gateway per group, a throwaway PostgreSQL cluster
(fsync off, unix socket) and the round-robin balancer stand-in, all on this machine.

What 2 cores can and cannot show: three managers, a gateway, PostgreSQL, six kernels and the
client share two cores, so more managers cannot serve more runs per second here: the managers
compete for the same CPUs as everything else. What the figures do show is the price of a run
through PostgreSQL against SQLite, the price of forwarding (N-1 of N requests take one more
manager hop), and that nothing is lost or run twice on the way. Scale-out needs managers on
separate hosts (or cores), which this machine does not have. Absolute runs/s move with the
other engineers' load (the load averages above): compare the groups within one run, and the CPU
per run, which moves less.

{(chr(10) * 2).join(parts)}
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SECTION, body)
    print("SUMMARY " + json.dumps(summary))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("throughput", "failover", "both"), default="both")
    p.add_argument("--sessions", type=int, default=6, help="sessions at once per group (K, default 6)")
    p.add_argument("--runs", type=int, default=50, help="runs per session per turn (M, default 50)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", default=",".join(GROUPS), help=f"throughput groups (default {','.join(GROUPS)})")
    p.add_argument("--lease", type=float, default=3.0, help="store.lease_seconds of the failover series (3)")
    p.add_argument("--kills", type=int, default=20, help="kills with --lease (20)")
    p.add_argument("--default-kills", type=int, default=10, help="kills with the default lease, 10 s (10)")
    p.add_argument("--give-up", type=int, default=2,
                   help="stop a failover series after this many kills in a row never answered (2)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    args.groups = args.groups.split(",")
    if not set(args.groups) <= set(GROUPS) or args.groups[0] != "sqlite-1":
        p.error(f"--groups: sqlite-1 first, then any of {', '.join(GROUPS[1:])}")
    if min(args.sessions, args.runs, args.rounds) < 1 or args.lease < 1:
        p.error("--sessions, --runs, --rounds must be >= 1 and --lease >= 1")
    require_kernel_venv(p)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
