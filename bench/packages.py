"""What installing a package into a session costs (issue 16), on a real `kernelmode serve` with a
real index on loopback (tests/support/package_index.py: wheels built here, no network).

Run:  .venv/bin/python bench/packages.py [--samples N] [--quick] [--sandbox bwrap|docker] [--no-write]

Measured in one run, interleaved sample by sample so that machine noise hits all alike:

  json      warm round trip of `import json` in a session (REST execute): the unit of the goal;
  cached    POST /v1/sessions/{id}/packages {"packages": ["kmtest-app"]} into a fresh session
            when the wheels are in the cache (2 small wheels: a package and its dependency);
  cached_m  the same for kmtest-many: one wheel of 400 modules (1.6 MB unpacked);
  import    then `import kmtest_app` in that session (the first import from the layer);
  unpack_m  unpacking kmtest-many's wheel into a layer, in this process (the unpack part alone);
  first     the install of a package never asked for before, with one dependency (the server
            runs pip download against the index, then checks and unpacks);
  pip       `pip download` of another such package alone, same target flags (reference).

Goals: cached <= 3x json + unpack time; first about what pip download costs.
Results go to a section of bench/RESULTS.md (unless --no-write); the last line is a SUMMARY.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import BENCH, Stats, machine_info, ms_since, small_bench_main, verdict, write_section
from servers import KmServer

from kernelmode.packages.layer import PackageLayer
from tests.support.package_index import build_all, build_wheel, serve_index, write_simple_index

SECTION = "packages"


def build_index(tmp: Path, fresh: int) -> Path:
    """The test index, plus kmtest-many and ``fresh`` packages kmtest-fresh-N (each needs
    kmtest-lib), so that every first install is of a package never seen before."""
    dist = tmp / "dist"
    files = build_all(dist, tmp / "canary")
    files += [build_wheel(dist, f"kmtest-fresh-{i}", "1.0", {f"kmtest_fresh_{i}.py": b"X = 1\n"}, ["kmtest-lib"])
              for i in range(fresh)]
    files.append(build_wheel(dist, "kmtest-many", "1.0", {
        f"kmtest_many/m{i:03d}.py": (f"# module {i}\n" + "def f(x):\n    return x * 2\n" * 100).encode()
        for i in range(400)} | {"kmtest_many/__init__.py": b""}))
    write_simple_index(files, tmp / "index")
    return dist / "kmtest_many-1.0-py3-none-any.whl"


async def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-pkg-"))
    many_wheel = build_index(tmp, 2 * (args.warmup + args.samples))
    cache = tmp / "cache"
    (tmp / "links").mkdir()
    stats = {k: Stats(k) for k in ("json", "cached", "cached_m", "import", "unpack_m", "first", "pip")}
    with serve_index(tmp / "index") as index:
        env = {"KERNELMODE_PACKAGES__INDEX_URL": index.url, "KERNELMODE_PACKAGES__CACHE_DIR": str(cache),
               "KERNELMODE_SESSIONS__POOL_SIZE": "2", "PIP_NO_CACHE_DIR": "1", "PIP_CONFIG_FILE": "/dev/null",
               "PIP_FIND_LINKS": str(tmp / "links"), "PIP_EXTRA_INDEX_URL": ""}
        km = KmServer("packages", env, backend=args.sandbox)
        km.start()
        assert km.srv is not None
        http = km.srv.client(timeout=300)
        made: list[str] = []

        def session() -> str:
            r = http.post("/v1/sessions", json={})
            r.raise_for_status()
            made.append(r.json()["session_id"])
            return made[-1]

        def timed(method: str, path: str, body: dict) -> tuple[float, dict]:
            t0 = time.perf_counter_ns()
            r = http.request(method, path, json=body)
            took = ms_since(t0)
            if r.status_code != 200:
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
            return took, r.json()

        try:
            probe = session()
            timed("POST", f"/v1/sessions/{probe}/packages", {"packages": ["kmtest-app", "kmtest-many"]})  # warm the cache
            target_argv = None
            for i in range(args.warmup + args.samples):
                keep = i >= args.warmup
                took, _ = timed("POST", f"/v1/sessions/{probe}/execute", {"code": "import json"})
                if keep:
                    stats["json"].samples.append(took)
                sid = session()
                took, res = timed("POST", f"/v1/sessions/{sid}/packages", {"packages": ["kmtest-app"]})
                assert len(res["installed"]) == 2, res
                if keep:
                    stats["cached"].samples.append(took)
                took, res = timed("POST", f"/v1/sessions/{sid}/execute", {"code": "import kmtest_app"})
                assert res["status"] == "ok", res
                if keep:
                    stats["import"].samples.append(took)
                took, res = timed("POST", f"/v1/sessions/{sid}/packages", {"packages": ["kmtest-many"]})
                if keep:
                    stats["cached_m"].samples.append(took)
                layer = PackageLayer(tmp / f"layer-{i}")
                layer.create()
                t0 = time.perf_counter_ns()
                layer.unpack(many_wheel, 1 << 30)
                if keep:
                    stats["unpack_m"].samples.append(ms_since(t0))
                layer.destroy()
                http.delete(f"/v1/sessions/{sid}")
                made.remove(sid)
                # First install: a package never asked for, so the server runs pip against the index.
                sid = session()
                took, res = timed("POST", f"/v1/sessions/{sid}/packages", {"packages": [f"kmtest-fresh-{2 * i}"]})
                assert len(res["installed"]) == 2, res
                if keep:
                    stats["first"].samples.append(took)
                http.delete(f"/v1/sessions/{sid}")
                made.remove(sid)
                if target_argv is None:
                    from kernelmode.config import Settings
                    from kernelmode.packages.target import probe as probe_target
                    settings = Settings()
                    target_argv = (await probe_target(settings, args.sandbox)).pip_args()
                dest = tmp / f"dl-{i}"
                t0 = time.perf_counter_ns()
                await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "pip", "download", "-q", "--dest", str(dest), "--no-input",
                                "--disable-pip-version-check", "--progress-bar", "off", *target_argv,
                                "--index-url", index.url, f"kmtest-fresh-{2 * i + 1}"], check=True, env={**env, "PATH": "/usr/bin:/bin"})
                if keep:
                    stats["pip"].samples.append(ms_since(t0))
                shutil.rmtree(dest, ignore_errors=True)
        finally:
            for sid in made:
                http.delete(f"/v1/sessions/{sid}")
            http.close()
            await km.stop(timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)
    report(args, stats)
    return 0


def report(args: argparse.Namespace, s: dict[str, Stats]) -> None:
    m = {k: v.median for k, v in s.items()}
    goal_small = 3 * m["json"]
    goal_many = 3 * m["json"] + m["unpack_m"]
    rows = "\n".join(f"| {k} | {v.n} | {v.median:.1f} | {v.pct(90):.1f} |" for k, v in s.items())
    info = machine_info(args.sandbox)
    body = f"""## Packages on demand: install into a session (bench/packages.py, {args.sandbox})

{info['date']}, sandbox **{args.sandbox}**, {s['json'].n} samples per path interleaved; a local index
on loopback (tests/support/package_index.py). The machine is shared by five engineers (2 cores, load
varies): compare the figures of one run with each other, not across runs.

| path | n | median ms | p90 ms |
|---|---|---|---|
{rows}

- cached install of a package and its dependency: **{m['cached']:.0f} ms** = {m['cached'] / m['json']:.1f}x a
  warm `import json` round trip ({m['json']:.0f} ms); goal <= 3x json: {verdict(m['cached'] <= goal_small)}.
- cached install of a 400-module wheel: {m['cached_m']:.0f} ms; goal <= 3x json + its unpack time
  ({m['unpack_m']:.0f} ms) = {goal_many:.0f} ms: {verdict(m['cached_m'] <= goal_many)}.
- the first import from the layer: {m['import']:.0f} ms (a round trip with the import in it).
- first install of a package never asked for (one dependency): {m["first"]:.0f} ms; `pip download` alone: {m["pip"]:.0f} ms
  ({m['first'] / m['pip']:.2f}x: pip's start-up and resolution are most of it; the rest is the
  manager's checks, hashing and unpacking).

Machine: {', '.join(f'{k}: {v}' for k, v in info.items() if k != 'date')}.
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", f"{SECTION}-{args.sandbox}", body)
    print(f"SUMMARY cached={m['cached']:.1f}ms json={m['json']:.1f}ms first={m['first']:.1f}ms pip={m['pip']:.1f}ms")


def main() -> int:
    return small_bench_main(__doc__, run, samples=20, warmup=2, quick_samples=5)


if __name__ == "__main__":
    sys.exit(main())
