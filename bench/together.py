"""What a fork's packages cost (a fork unpacks its source's wheels from the cache into its own
layer), on a real `kernelmode serve` with a real index on loopback (tests/support/package_index.py).

Run:  .venv/bin/python bench/together.py [--samples N] [--quick] [--sandbox bwrap|docker] [--no-write]

Measured in one run, interleaved sample by sample:

  fork_plain  POST /v1/sessions {"fork_of": S} of a session with a few variables, no packages;
  fork_pkgs   the same of a session that also has kmtest-app, kmtest-lib and kmtest-many (a wheel
              of 400 modules) installed and imported: the fork copies them from the cache;
  copy        of fork_pkgs, the server's own time to unpack the wheels into the fork's layer (the
              ``duration_ms`` of its ``package_install`` audit line with ``source: fork``);
  install     POST .../packages of the same three into a fresh session, the wheels cached
              (what re-installing them in the fork by name would cost at best).

The two forks alternate which goes first (the warm pool's refill favours the first).
Results go to a section of bench/RESULTS.md (unless --no-write); the last line is a SUMMARY.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness import BENCH, Stats, machine_info, ms_since, small_bench_main, write_section
from packages import build_index
from servers import KmServer

from tests.support.package_index import serve_index

SECTION = "together"
PKGS = ["kmtest-app", "kmtest-many"]
SETUP = "import numpy as np\nrows = list(range(1000))\narr = np.arange(100_000)\ndef helper(x):\n    return x + 1\n"


async def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-together-"))
    build_index(tmp, 0)
    (tmp / "links").mkdir()
    stats = {k: Stats(k) for k in ("fork_plain", "fork_pkgs", "copy", "install")}
    with serve_index(tmp / "index") as index:
        env = {"KERNELMODE_PACKAGES__INDEX_URL": index.url, "KERNELMODE_PACKAGES__CACHE_DIR": str(tmp / "cache"),
               "KERNELMODE_SESSIONS__POOL_SIZE": "2", "PIP_NO_CACHE_DIR": "1", "PIP_CONFIG_FILE": "/dev/null",
               "PIP_FIND_LINKS": str(tmp / "links"), "PIP_EXTRA_INDEX_URL": ""}
        km = KmServer("together", env, backend=args.sandbox)
        km.start()
        assert km.srv is not None
        http = km.srv.client(timeout=300)
        made: list[str] = []

        def timed(method: str, path: str, body: dict, want: int = 200) -> tuple[float, dict]:
            t0 = time.perf_counter_ns()
            r = http.request(method, path, json=body)
            took = ms_since(t0)
            if r.status_code != want:
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
            return took, r.json()

        def session(**body: object) -> tuple[float, str]:
            took, info = timed("POST", "/v1/sessions", body, 201)
            made.append(info["session_id"])
            return took, made[-1]

        def done(sid: str) -> None:
            http.delete(f"/v1/sessions/{sid}")
            made.remove(sid)

        try:
            _, plain = session()
            _, rich = session()
            timed("POST", f"/v1/sessions/{plain}/execute", {"code": SETUP})
            timed("POST", f"/v1/sessions/{rich}/packages", {"packages": PKGS})
            timed("POST", f"/v1/sessions/{rich}/execute", {"code": SETUP + "import kmtest_app, kmtest_many"})
            for i in range(args.warmup + args.samples):
                keep = i >= args.warmup
                for source in ((plain, rich) if i % 2 else (rich, plain)):
                    took, fork = session(fork_of=source)
                    if keep:
                        stats["fork_pkgs" if source == rich else "fork_plain"].samples.append(took)
                    if source == rich:
                        _, res = timed("POST", f"/v1/sessions/{fork}/execute", {"code": "kmtest_app.answer()"})
                        assert res["status"] == "ok" and res["result"] == "42", res
                    done(fork)
                _, sid = session()
                took, res = timed("POST", f"/v1/sessions/{sid}/packages", {"packages": PKGS})
                assert len(res["installed"]) == 3, res
                if keep:
                    stats["install"].samples.append(took)
                done(sid)
            copies = [e["duration_ms"] for e in _audit(km.srv.log())
                      if e.get("event") == "package_install" and e.get("source") == "fork" and e.get("ok")]
            stats["copy"].samples.extend(copies[args.warmup:])
        finally:
            for sid in list(made):
                http.delete(f"/v1/sessions/{sid}")
            http.close()
            await km.stop(timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)
    report(args, stats)
    return 0


def _audit(log: str) -> list[dict]:
    """The JSON objects of the server's log lines (audit events among them)."""
    out = []
    for line in log.splitlines():
        start = line.find("{")
        if start >= 0:
            try:
                out.append(json.loads(line[start:]))
            except ValueError:
                continue
    return out


def report(args: argparse.Namespace, s: dict[str, Stats]) -> None:
    m = {k: v.median for k, v in s.items()}
    rows = "\n".join(f"| {k} | {v.n} | {v.median:.1f} | {v.pct(90):.1f} |" for k, v in s.items())
    info = machine_info(args.sandbox)
    body = f"""## Forks with packages (bench/together.py, {args.sandbox})

{info['date']}, sandbox **{args.sandbox}**, {s['fork_plain'].n} samples per path interleaved; a local
index on loopback. The machine is shared by five engineers (2 cores, load varies): compare the
figures of one run with each other, not across runs.

| path | n | median ms | p90 ms |
|---|---|---|---|
{rows}

- a fork of a session with 3 packages (one of 400 modules): {m['fork_pkgs']:.0f} ms, against
  {m['fork_plain']:.0f} ms without packages (difference {m['fork_pkgs'] - m['fork_plain']:.0f} ms, with the
  larger namespace's checkpoint and restore in it); the server's own copy of the cached wheels
  into the fork's layer: {m['copy']:.0f} ms (no pip, no index), vs {m['install']:.0f} ms for a cached
  install of the same packages by name into a fresh session (request round trip included).

Machine: {', '.join(f'{k}: {v}' for k, v in info.items() if k != 'date')}.
"""
    print(body)
    if not args.no_write:
        write_section(BENCH / "RESULTS.md", f"{SECTION}-{args.sandbox}", body)
    print(f"SUMMARY fork_plain={m['fork_plain']:.1f}ms fork_pkgs={m['fork_pkgs']:.1f}ms install={m['install']:.1f}ms")


def main() -> int:
    return small_bench_main(__doc__, run, samples=10, warmup=1, quick_samples=4)


if __name__ == "__main__":
    sys.exit(main())
