"""A cluster kernel's CPU per run with and without the kernel environment's IPython config.

Run (as root, after `make setup` and `make setup-cluster`):
  .venv/bin/python bench/cluster_history.py [--samples N] [--quick] [--no-write]

Enterprise Gateway's launcher passes no IPython options, so a remote kernel's history setting
comes only from its kernel environment's ``etc/ipython/ipython_kernel_config.json`` (written by
`kernelmode setup`): ``HistoryManager.hist_file = ":memory:"``. In one run: the rig of
tests/cluster (two node namespaces, EG 3.3.0 launching setpriv + bwrap kernels over SSH) with two
kernelspecs, ``lean`` (the kernel venv, with that file) and ``sqlite`` (a hard-linked copy of the
same venv without it: IPython's default, a sqlite history written by a thread after every cell),
and one `serve` (pool_size 1) per kernelspec. `1+1` runs on each one's live session, interleaved
round-robin in batches (harness ``interleave``); the CPU of each kernel's processes (every
thread, /proc/<pid>/task/*/schedstat) over its own batches is divided by its runs.

Writes the "cluster-history" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from harness import (
    BENCH,
    Stats,
    add_sampling_args,
    interleave,
    loadavg,
    run_stoppable,
    sampling_args,
    write_section,
)
from serve_pair import POOL, clients_with_warm_session, execute

from tests.support.cluster import eg as eg_mod
from tests.support.cluster import rig as rig_mod
from tests.support.procfs import cmdline, cpu_ns, descendants, processes_mentioning, unmount_under
from tests.support.server import Server, start_server

SECTION = "cluster-history"
CONFIG = Path("etc") / "ipython" / "ipython_kernel_config.json"
SQLITE_SPEC = "kernelmode-remote-sqlite"
ASK = "hm = get_ipython().history_manager\n(str(hm.hist_file), hm.save_thread is None)"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def sqlite_venv(venv: Path, dest: Path) -> Path:
    """A copy of ``venv`` (hard links where it can) without the IPython config; its python."""
    shutil.copytree(venv, dest, symlinks=True, copy_function=_link_or_copy)
    (dest / CONFIG).unlink(missing_ok=True)
    dest.chmod(0o755)
    return dest / "bin" / "python"


def add_sqlite_spec(rig: rig_mod.Rig, python: Path) -> None:
    """The rig's kernelspec with another kernel python (EG reads kernelspecs when asked)."""
    lean = json.loads((rig.root / "eg-share" / "kernels" / eg_mod.KERNEL_NAME / "kernel.json").read_text())
    lean["argv"] = [str(python) if a == eg_mod.kernel_python() else a for a in lean["argv"]]
    d = rig.root / "eg-share" / "kernels" / SQLITE_SPEC
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(json.dumps(lean, indent=1))


def kernel_pids(kernel_id: str) -> list[int]:
    """The kernel's own processes on its node: the launcher's python (the kernel runs in it)
    and what it started."""
    roots = [p for p in processes_mentioning(kernel_id)
             if (cmd := cmdline(p)) and cmd[0].endswith("/bin/python") and str(eg_mod.LAUNCHER) in cmd]
    assert roots, f"no kernel process for {kernel_id}"
    return sorted({q for p in roots for q in (p, *descendants(p))})


async def run(args: argparse.Namespace) -> int:
    why = rig_mod.missing() or eg_mod.missing()
    lean_venv = Path(eg_mod.kernel_python()).parent.parent
    if not why and not (lean_venv / CONFIG).is_file():
        why = f"{lean_venv / CONFIG} is missing: run `make setup` (kernelmode setup writes it)"
    if why:
        print(f"bench/cluster_history.py: {why}", file=sys.stderr)
        return 2
    started, load = time.monotonic(), loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-hist-", dir="/tmp"))  # hard links if the same filesystem
    os.chmod(tmp, 0o755)
    rig = rig_mod.claim()
    gw: eg_mod.EnterpriseGateway | None = None
    dirs = [Path(tempfile.mkdtemp(prefix=f"kmbench-{n}-", dir="/tmp")) for n in ("lean", "sqlite")]
    servers: dict[str, Server] = {}
    clients: dict[str, httpx.AsyncClient] = {}
    stats = {n: Stats(n) for n in ("lean", "sqlite")}
    cpu = dict.fromkeys(stats, 0)
    try:
        gw = eg_mod.start(rig)
        add_sqlite_spec(rig, sqlite_venv(lean_venv, tmp / "venv"))
        for d in dirs:
            d.chmod(0o711)
        servers["lean"] = start_server({**POOL, **gw.env()}, data_dir=dirs[0])
        servers["sqlite"] = start_server({**POOL, **gw.env(), "KERNELMODE_GATEWAY__KERNEL_NAME": SQLITE_SPEC},
                                         data_dir=dirs[1])
        clients = await clients_with_warm_session(servers)
        trees, seen = {}, {}
        for name, c in clients.items():
            r = (await c.post("/v1/sessions/warm/execute", json={"code": ASK})).json()
            seen[name] = r["result"]
            trees[name] = kernel_pids((await c.get("/v1/sessions/warm")).json()["kernel_id"])
        assert seen == {"lean": "(':memory:', True)", "sqlite": seen["sqlite"]}, seen
        assert seen["sqlite"].endswith("False)"), seen  # the history thread runs there

        @contextlib.contextmanager
        def account(name: str) -> Iterator[None]:
            before = sum(map(cpu_ns, trees[name]))
            yield
            cpu[name] += sum(map(cpu_ns, trees[name])) - before

        print(f"measuring lean, sqlite: {args.samples} samples each ...", flush=True)
        await interleave({n: execute(clients[n]) for n in stats}, stats, args.samples, args.batch, args.warmup,
                         around=account)
    finally:
        for c in clients.values():
            await c.aclose()
        for srv in servers.values():
            srv.stop()
        if gw is not None:
            gw.stop()
        rig.down()
        for d in dirs:
            unmount_under(d)
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    per_run = {n: cpu[n] / stats[n].n / 1e6 for n in stats}
    rows = "\n".join(f"| {n} | {seen[n]} | {s.n} | {per_run[n]:.2f} | {s.median:.2f} | {s.pct(95):.2f} |"
                     for n, s in stats.items())
    body = f"""## A cluster kernel's history thread (E, session 10; bench/cluster_history.py)

Generated by `bench/cluster_history.py {' '.join(sys.argv[1:])}`; wall time {time.monotonic() - started:.0f} s;
load average at the start {load}, at the end {loadavg()} (shared machine: the two paths of the
same run, interleaved, are what compare). Kernels launched by EG 3.3.0 on the rig's nodes
(setpriv + bwrap, EG's launcher, which takes no IPython options); `1+1` through `serve`.
``lean``: the kernel venv with `etc/ipython/ipython_kernel_config.json` (history in memory);
``sqlite``: the same venv without that file (IPython's default).

| kernel | (hist_file, no history thread) | runs | kernel CPU per run ms | REST median ms | p95 ms |
|---|---|---|---|---|---|
{rows}

- kernel CPU per run, sqlite - lean: **{per_run['sqlite'] - per_run['lean']:.2f} ms**; REST median
  sqlite - lean: {stats['sqlite'].median - stats['lean'].median:.2f} ms.
"""
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", SECTION, body)
    print(body)
    print(f"SUMMARY lean_cpu_ms={per_run['lean']:.3f} sqlite_cpu_ms={per_run['sqlite']:.3f} "
          f"lean_median_ms={stats['lean'].median:.2f} sqlite_median_ms={stats['sqlite'].median:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p)
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    args = p.parse_args()
    sampling_args(p, args)
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
