"""The gateway <-> manager wire (issue 18, W): system calls and TCP segments per REST `1+1`,
this checkout against another, counted (not timed).

Run:  .venv/bin/python bench/wire_syscalls.py [--before REF] [--runs N]

Two `kernelmode serve` (bwrap) as in bench/fewer_messages.py (``before``: git REF exported, by
default the merge base of HEAD and main). For each side in turn, ``strace -c -f`` is attached to
its gateway and then to its manager (every thread) while N warm `1+1` runs go through REST, one
at a time; strace's counts divided by N are the system calls per run. The data segments the
manager's kernel websocket received (TCP_INFO of the gateway's side: its segments out) over the
same runs are the gateway's sends, after Linux merged what it could. Prints a table; writes no
file (the figures go to bench/RESULTS.md by hand, with the load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time

from harness import loadavg, run_stoppable
from servers import KmServer, before_checkout

SIDES = ("before", "after")
WATCHED = ("sendto", "write", "writev", "sendmsg", "recvfrom", "read", "recvmsg", "epoll_wait",
           "poll", "getsockopt")


def strace_counts(text: str) -> dict[str, int]:
    """strace -c's summary: calls by system call."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m and m.group(2) != "total":
            out[m.group(2)] = int(m.group(1))
    return out


def gateway_segs_out(gateway_pid: int) -> int:
    """Data segments sent by the gateway's established loopback connections to the manager's
    kernel websockets (``ss -tin``, the gateway's listening port's side)."""
    port = None
    for line in subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True).stdout.splitlines():
        if f"pid={gateway_pid}," in line:
            port = line.split()[3].rsplit(":", 1)[1]
            break
    text = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                          capture_output=True, text=True).stdout
    return sum(int(n) for n in re.findall(r"data_segs_out:(\d+)", text))


async def counted(km: KmServer, pid: int, runs: int) -> tuple[dict[str, int], int]:
    """strace -c of ``pid`` over ``runs`` REST `1+1`; and the gateway's segments out meanwhile."""
    conn = km.http()
    for _ in range(20):  # warm
        await conn.execute("warm")
    tracer = await asyncio.create_subprocess_exec("strace", "-c", "-f", "-p", str(pid),
                                                  stderr=asyncio.subprocess.PIPE)
    await asyncio.sleep(1.0)  # attached to every thread
    segs = gateway_segs_out(km.gateway_pid)
    for _ in range(runs):
        await conn.execute("warm")
    segs = gateway_segs_out(km.gateway_pid) - segs
    tracer.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(tracer.communicate(), 60)
    await conn.close()
    return strace_counts(err.decode()), segs


async def run(args: argparse.Namespace) -> int:
    if shutil.which("strace") is None or shutil.which("ss") is None:
        print("needs strace and ss", file=sys.stderr)
        return 2
    load_start = loadavg()
    tmp, before_commit, after_commit = before_checkout(args.before, "kmbench-wire-")
    servers = {side: KmServer(side, {"KERNELMODE_SESSIONS__POOL_SIZE": "1"},
                              checkout=tmp / "before" if side == "before" else None) for side in SIDES}
    rows: list[str] = []
    tops: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        for km in servers.values():
            stack.push_async_callback(km.stop)
            km.start()
            status, info = await km.http().json("POST", "/v1/sessions", {"session_id": "warm"})
            assert status == 201, info
        for side, km in servers.items():
            for role, pid in (("gateway", km.gateway_pid), ("manager", km.manager_pid)):
                calls, segs = await counted(km, pid, args.runs)
                per = {k: calls.get(k, 0) / args.runs for k in WATCHED}
                total = sum(calls.values()) / args.runs
                rows.append(f"| {side} | {role} | {total:.1f} | "
                            + " | ".join(f"{per[k]:.1f}" for k in WATCHED)
                            + f" | {segs / args.runs:.2f} |")
                top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
                tops.append(f"{side} {role}: " + ", ".join(f"{k} {v / args.runs:.1f}" for k, v in top))
    head = " | ".join(WATCHED)
    print(f"`bench/wire_syscalls.py --runs {args.runs}` on {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
          f"before {before_commit}, after {after_commit}; load average {load_start} -> {loadavg()}.\n")
    print(f"| side | process | syscalls/run | {head} | gateway data segments/run |")
    print("|" + "---|" * (len(WATCHED) + 4))
    print("\n".join(rows))
    print("\nThe most frequent calls per run:\n\n" + "\n".join(f"- {t}" for t in tops))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="git ref of the 'before' code (default: merge base with main)")
    p.add_argument("--runs", type=int, default=200, help="REST runs counted per side and process")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
