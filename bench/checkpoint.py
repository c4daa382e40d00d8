"""Checkpoints, restores and hibernation: time, size, and how many hibernated sessions one machine keeps.

Run:  .venv/bin/python bench/checkpoint.py [--quick] [--no-write] [--repeat N] [--real N] [--clones N]

Real `kernelmode serve` processes (bubblewrap, no warm pool) on their own data dirs:

  1. size/time  A namespace of a 100 MB pandas DataFrame, a fitted model-like object (a class of
                the notebook holding numpy coefficients and 200 small "trees") and 1,000 small
                variables. Timed N times (5; --quick 2): a plain ``pickle.dumps`` of the same
                objects inside the kernel (the floor), ``POST /checkpoint`` as the client sees
                it (serialise in the kernel, move the file into the store, record), its bytes;
                then the restore: the kernel is killed (os._exit) and the next run timed (a fresh
                kernel + the restore + ``1``), against the same for a session without a
                checkpoint (a fresh kernel + ``1``), and ``pickle.loads`` in the kernel.
  2. resume     A session holding a 10 MB frame hibernates (hibernate_after_seconds=1); its next
                run is timed (start a kernel, restore, run) against a session with the same
                namespace whose kernel died (cold kernel start + restore + run).
  3. count      --real sessions (20; --quick 5) made for real and hibernated: kernel processes
                left (0 expected), manager RSS, disk per session. Then --clones records
                (10,000; --quick 1,000) are added to the store as copies of one real hibernated
                session (its checkpoint and workspace copied too; a quick mode: starting 10,000
                kernels to hibernate them takes hours here), the server restarted on that store:
                its RSS, GET /v1/sessions time, and one clone woken with its variables.

Results go to bench/RESULTS.md under "Checkpoints and hibernation" (unless --no-write).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from harness import BENCH, Stats, loadavg, machine_info, ms_since, run_stoppable, write_section
from servers import KmServer

from tests.support.procfs import cmdline, processes_mentioning, rss_kb

NAMESPACE = """
import numpy as np, pandas as pd
frame = pd.DataFrame({f"c{i}": np.random.default_rng(i).random(1_310_720) for i in range(10)})  # 100 MiB
class Model:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.coef_ = rng.random((200, 100)); self.intercept_ = rng.random(100)
        self.trees_ = [{"feature": rng.integers(0, 100, 63), "threshold": rng.random(63)} for _ in range(200)]
        self.params = {"alpha": 0.1, "max_depth": 6}
    def predict(self, X):
        return X @ self.coef_ + self.intercept_
model = Model()
for i in range(1000):
    globals()[f"v{i}"] = {"i": i, "name": f"item{i}", "score": i * 0.5}
"""
SMALL = ("import numpy as np, pandas as pd\n"
         "frame = pd.DataFrame({'a': np.arange(1_310_720, dtype='float64')})  # 10 MiB\nlabel = 'kept'")
PLAIN = ("import pickle, time\n_objs = [frame, model] + [globals()[f'v{i}'] for i in range(1000)]\n"
         "_t = time.perf_counter(); _b = pickle.dumps(_objs); _d = time.perf_counter() - _t\n"
         "_t = time.perf_counter(); pickle.loads(_b); _l = time.perf_counter() - _t\n"
         "print(_d * 1000, _l * 1000, len(_b)); del _b, _objs")


async def _run(km: KmServer, sid: str, code: str, timeout: float = 300) -> dict[str, Any]:
    assert km.ctl is not None
    status, body = await km.ctl.json("POST", f"/v1/sessions/{sid}/execute", {"code": code, "timeout_seconds": timeout})
    if status != 200:
        raise RuntimeError(f"execute: {status} {body}")
    return body


async def _timed_run(km: KmServer, sid: str, code: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter_ns()
    body = await _run(km, sid, code)
    return ms_since(t0), body


async def size_and_time(km: KmServer, repeat: int) -> dict[str, Any]:
    assert km.ctl is not None
    names = ["plain pickle.dumps (kernel)", "checkpoint (client)", "checkpoint (server duration_ms)",
             "checkpoint: serialise + write in the kernel (serialize_ms)",
             "plain pickle.loads (kernel)", "next run after death, restored", "next run after death, no checkpoint"]
    st = {n: Stats(n) for n in names}
    sizes: dict[str, int] = {}
    sid = (await km.create({"limits": {"memory_mb": 3072}}))["session_id"]
    bare = (await km.create({}))["session_id"]
    for _ in range(repeat):
        await _run(km, sid, NAMESPACE)
        out = (await _run(km, sid, PLAIN))["stdout"].split()
        st[names[0]].samples.append(float(out[0]))
        st[names[4]].samples.append(float(out[1]))
        sizes["plain pickle"] = int(out[2])
        t0 = time.perf_counter_ns()
        status, ck = await km.ctl.json("POST", f"/v1/sessions/{sid}/checkpoint")
        st[names[1]].samples.append(ms_since(t0))
        if status != 200:
            raise RuntimeError(f"checkpoint: {status} {ck}")
        st[names[2]].samples.append(ck["duration_ms"])
        st[names[3]].samples.append(ck["serialize_ms"])
        sizes["checkpoint"] = ck["bytes"]
        await _run(km, sid, "import os\nos._exit(1)", 60)
        ms, body = await _timed_run(km, sid, "int(frame.shape[0]) + len(model.trees_) + v999['i']")
        if body.get("result") != str(1_310_720 + 200 + 999) or body.get("state_lost"):
            raise RuntimeError(f"restore went wrong: {body}")
        st[names[5]].samples.append(ms)
        await _run(km, bare, "import os\nos._exit(1)", 60)
        ms, _ = await _timed_run(km, bare, "1")
        st[names[6]].samples.append(ms)
    await km.delete(sid)
    await km.delete(bare)
    return {"stats": st, "sizes": sizes}


async def resume(km: KmServer, repeat: int) -> dict[str, Stats]:
    st = {"hibernated: next run (wake, kernel start, restore)": Stats("resume"),
          "kernel died: next run (kernel start, restore)": Stats("cold")}
    assert km.ctl is not None
    for _ in range(repeat):
        sleepy = (await km.create({}))["session_id"]
        dying = (await km.create({}))["session_id"]
        for sid in (sleepy, dying):
            await _run(km, sid, SMALL)
        await km.ctl.json("POST", f"/v1/sessions/{dying}/checkpoint")
        await _run(km, dying, "import os\nos._exit(1)", 60)
        deadline = time.monotonic() + 120
        while (await km.ctl.json("GET", f"/v1/sessions/{sleepy}"))[1]["status"] != "hibernated":
            if time.monotonic() > deadline:
                raise RuntimeError("the session never hibernated")
            await asyncio.sleep(0.2)
        for key, sid in zip(st, (sleepy, dying), strict=True):
            ms, body = await _timed_run(km, sid, "label")
            if body.get("result") != "'kept'":
                raise RuntimeError(f"not restored: {body}")
            st[key].samples.append(ms)
        await km.delete(sleepy)
        await km.delete(dying)
    return st


def _disk(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _clone(data_dir: Path, source: str, n: int) -> None:
    """``n`` copies of hibernated session ``source``: store rows, checkpoint objects, workspace."""
    db = sqlite3.connect(str(data_dir / "sessions.sqlite3"))
    info_json, kernel_id, workspace = db.execute(
        "SELECT info, kernel_id, workspace FROM sessions WHERE session_id=?", (source,)).fetchone()
    ck_id, ck_info = db.execute("SELECT checkpoint_id, info FROM checkpoints WHERE session_id=? ORDER BY created DESC LIMIT 1", (source,)).fetchone()
    ws, store = Path(workspace), data_dir / "artifacts" / ".checkpoints"
    for i in range(n):
        sid, new_ck, new_kernel = f"clone-{i}", uuid.uuid4().hex, str(uuid.uuid4())
        new_ws = ws.with_name(new_kernel)
        # The folder only: a quota volume's image is not copied (a 1 GB sparse file each); the
        # clone's workspace is a plain folder, which the wake takes as it is.
        shutil.copytree(ws, new_ws, symlinks=True)
        shutil.copytree(store / ck_id, store / new_ck)
        info = json.loads(info_json) | {"session_id": sid, "kernel_id": new_kernel}
        # The record alone, as an older kernelmode writes it: the store's triggers and its open
        # fill the indexed columns (tenant, status, created_us).
        db.execute("INSERT INTO sessions (session_id, kernel_id, workspace, info) VALUES (?, ?, ?, ?)",
                   (sid, new_kernel, str(new_ws), json.dumps(info)))
        db.execute("INSERT INTO owners VALUES (?, ?)", (sid, info.get("tenant") or "admin"))
        db.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                   (new_ck, sid, info.get("tenant") or "admin", time.time(),
                    json.dumps(json.loads(ck_info) | {"checkpoint_id": new_ck, "session_id": sid})))
    db.commit()
    db.close()


async def count(km: KmServer, real: int, clones: int) -> dict[str, Any]:
    assert km.ctl is not None
    sids = [(await km.create({}))["session_id"] for _ in range(real)]
    for sid in sids:
        await _run(km, sid, "data = list(range(1000))")
    deadline = time.monotonic() + 600
    while True:
        statuses = [(await km.ctl.json("GET", f"/v1/sessions/{s}"))[1]["status"] for s in sids]
        if all(x == "hibernated" for x in statuses):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("not all sessions hibernated")
        await asyncio.sleep(0.5)
    assert km.data_dir is not None
    kernels = len([p for p in processes_mentioning(str(km.data_dir)) if "ipykernel" in " ".join(cmdline(p))])
    out: dict[str, Any] = {"real": real, "kernel processes": kernels,
                           "manager RSS (MB), real hibernated": rss_kb(km.manager_pid) / 1024,
                           "disk per hibernated session (kB)": _disk(km.data_dir) / real / 1024}
    assert km.srv is not None
    await asyncio.to_thread(km.srv.stop)  # the data dir stays: the successor starts on it
    await asyncio.to_thread(_clone, km.data_dir, sids[0], clones)
    km.start()
    assert km.ctl is not None
    t0 = time.perf_counter_ns()
    status, listing = await km.ctl.json("GET", "/v1/sessions")  # the first page (100)
    out["GET /v1/sessions, first page (ms)"] = ms_since(t0)
    listed, cursor = listing["sessions"], listing["next_cursor"]
    t0 = time.perf_counter_ns()
    while cursor:  # the rest, 1,000 a page (a cursor is base64url: safe in a query string)
        status, listing = await km.ctl.json("GET", f"/v1/sessions?limit=1000&cursor={cursor}")
        listed, cursor = listed + listing["sessions"], listing["next_cursor"]
    out["GET /v1/sessions, every further page (ms)"] = ms_since(t0)
    out["hibernated listed"] = sum(1 for s in listed if s["status"] == "hibernated")
    out[f"manager RSS (MB), {clones + real} hibernated"] = rss_kb(km.manager_pid) / 1024
    body = await _run(km, f"clone-{clones - 1}", "len(data)")
    out["a clone wakes with its variables"] = body.get("result") == "1000" and not body.get("state_lost")
    if not out["a clone wakes with its variables"]:
        print("clone answer:", json.dumps(body)[:2000], file=sys.stderr)
    return out


def _table(stats: dict[str, Stats]) -> str:
    rows = ["| measurement | median ms | min | max | n |", "|---|---|---|---|---|"]
    for name, s in stats.items():
        rows.append(f"| {name} | {s.median:.0f} | {min(s.samples):.0f} | {max(s.samples):.0f} | {s.n} |")
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> int:
    repeat = args.repeat or (2 if args.quick else 5)
    real, clones = args.real or (5 if args.quick else 20), args.clones or (1000 if args.quick else 10_000)
    load0 = loadavg()
    env = {"KERNELMODE_SESSIONS__POOL_SIZE": "0", "KERNELMODE_SESSIONS__MAX_SESSIONS": "200"}
    km = KmServer("checkpoint", env)
    try:
        km.start()
        part1 = await size_and_time(km, repeat) if not args.count_only else None
    finally:
        await km.stop()
    hib = KmServer("hibernate", {**env, "KERNELMODE_SESSIONS__HIBERNATE_AFTER_SECONDS": "1"})
    try:
        hib.start()
        part2 = await resume(hib, repeat) if not args.count_only else None
        part3 = await count(hib, real, clones)
    finally:
        await hib.stop()
    if part1 is None or part2 is None:
        print(json.dumps(part3, indent=1))
        return 0
    st = part1["stats"]
    ratio = st["checkpoint (client)"].median / st["plain pickle.dumps (kernel)"].median
    ratio_srv = st["checkpoint (server duration_ms)"].median / st["plain pickle.dumps (kernel)"].median
    ratio_kernel = (st["checkpoint: serialise + write in the kernel (serialize_ms)"].median
                    / st["plain pickle.dumps (kernel)"].median)
    restore_ms = (st["next run after death, restored"].median - st["next run after death, no checkpoint"].median)
    r_keys = list(part2)
    body = "\n".join([
        "## Checkpoints and hibernation (bench/checkpoint.py)",
        "",
        f"One run, {'quick mode, ' if args.quick else ''}{repeat} repetitions, on a shared 2-core machine that "
        f"other engineers' test suites were loading (load average {load0} at the start, {loadavg()} at the end): "
        "absolute times are noisy; the ratios measured in the same run are what count.",
        "",
        "### Size and time: 100 MiB DataFrame + model-like object + 1,000 small variables",
        "",
        _table(st),
        "",
        f"- Sizes: checkpoint {part1['sizes']['checkpoint'] / 2**20:.1f} MiB, plain pickle "
        f"{part1['sizes']['plain pickle'] / 2**20:.1f} MiB.",
        f"- Checkpoint vs plain pickle.dumps: x{ratio:.2f} as the client sees it (file write, move into "
        f"the store, record), x{ratio_srv:.2f} by the server's duration_ms; the kernel's part alone "
        f"(serialise and write the file): x{ratio_kernel:.2f} (goal: within x1.5).",
        f"- Restore (median next run with restore minus without): {restore_ms:.0f} ms.",
        "- Where the time goes: the kernel's part is the serialisation proper; the rest of a checkpoint is "
        "moving the file (100 MiB) from the workspace volume into the store, one copy on the same disk, "
        "and a restore streams it back and loads it (CRC-32 checked per part). The end-to-end x1.5 goal "
        "depends on that copy's disk speed; on this loaded machine it is not met.",
        "",
        "### Resume of a hibernated session (10 MiB frame)",
        "",
        _table(part2),
        "",
        f"- Goal: resume <= cold kernel start + restore: {part2[r_keys[0]].median:.0f} ms vs "
        f"{part2[r_keys[1]].median:.0f} ms.",
        "",
        "### Hibernated sessions kept",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in part3.items()],
        "",
        "- `GET /v1/sessions` reads every stored session: with ten thousand, a listing takes the time "
        "above (the store has no paging yet).",
        f"- {real} sessions were made and hibernated for real; {clones} more are copies of one of them made in "
        "the store (quick mode for the large count: starting that many kernels takes hours here). A hibernated "
        "session holds no process: a store row, its workspace files and its checkpoint.",
        "",
        "| machine | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine_info("bwrap sandbox").items()],
    ])
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", "bench/checkpoint.py", body)
    print(f"SUMMARY checkpoint x{ratio:.2f} of pickle.dumps; resume {part2[r_keys[0]].median:.0f} ms vs "
          f"{part2[r_keys[1]].median:.0f} ms; {part3.get('hibernated listed')} hibernated, "
          f"{part3['kernel processes']} kernel processes")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--repeat", type=int)
    p.add_argument("--real", type=int)
    p.add_argument("--clones", type=int)
    p.add_argument("--count-only", action="store_true", help="only part 3 (nothing written)")
    raise SystemExit(run_stoppable(main, p.parse_args()))
