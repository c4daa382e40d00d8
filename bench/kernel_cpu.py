"""The kernel's CPU per run (issue 18, K): ours against a bare ipykernel's, one cause at a time.

Run:  .venv/bin/python bench/kernel_cpu.py [--samples N] [--quick] [--before REF] [--no-write]
                                           [--only PATH,PATH...]

Every path runs the warm `1+1` and is timed and accounted in the same run, interleaved
round-robin in batches (harness ``interleave``); the CPU of a kernel's process tree (every
thread of every process, /proc/<pid>/task/*/schedstat; utime+stime ticks as a cross-check) over
its own batches is divided by its runs. The jupyter_client paths send exactly what the manager
sends per run (``execute_content``: allow_stdin, stop_on_error off, store_history):

  bare            ipykernel (kernel-venv, unsandboxed, ipc), ipykernel's 0.5 ms reply sleep on
  bare_nosleep    the same, ``Kernel._execute_sleep = 0`` (what the preamble sets)
  bare_memhist    bare_nosleep with IPython's history database in memory (no saving thread)
  preamble_before bare + the preamble and file agent of the --before code (workspace empty)
  preamble        bare + this checkout's preamble and file agent, with the kernel command line
                  of this checkout's kernelspec (kernelmode/gateway_ext/config/kernelspec.json)
  bwrap           preamble + the real BwrapProvisioner (seccomp, cgroups, own uid), no gateway
  bwrap_noseccomp as bwrap, without the seccomp filter (measurement only, never a default)
  bwrap_nocgroup  as bwrap, cgroups off (rlimits instead)
  rest            POST /v1/sessions/warm/execute on a real `kernelmode serve` (this checkout)
  rest_before     the same on the --before code (default: the merge base with main)

Writes the "kernel-cpu" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

from direct_kernels import stock_history_arg, stop_kernel
from harness import (
    CODE,
    EXPECTED,
    MSG_TIMEOUT,
    REPO,
    Stats,
    add_sampling_args,
    interleave,
    loadavg,
    machine_info,
    ms_since,
    run_stoppable,
    sampling_args,
    write_section,
)
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from servers import CpuMeter, KmServer, export, kernel_pid

from kernelmode.gateway.exchange import execute_content
from kernelmode.models import Limits
from kernelmode.protocol import MARKER, PING
from kernelmode.sandbox import seccomp
from kernelmode.sandbox.bwrap import BwrapProvisioner
from kernelmode.sandbox.kernelspec import kernel_env_paths
from kernelmode.sandbox.spec import WORKSPACE_MOUNT, KernelParams
from kernelmode.sessions.boot import boot_code
from tests.support.procfs import descendants, ptable, stat

# bwrap binds the kernel environment read-only: the real folder, not a worktree's symlink.
KPY = Path(os.path.realpath(REPO / ".kernel-venv")) / "bin" / "python"
NOSECCOMP = "kmbench-bwrap-noseccomp"
ALL_PATHS = ("bare", "bare_nosleep", "bare_memhist", "preamble_before", "preamble", "bwrap",
             "bwrap_noseccomp", "bwrap_nocgroup", "rest", "rest_before")
KERNELSPEC = REPO / "kernelmode" / "gateway_ext" / "config" / "kernelspec.json"  # kernelmode's kernel command


class NoSeccompBwrap(BwrapProvisioner):
    """The bwrap provisioner without its seccomp filter: a measurement, never a default."""

    def wrap_command(self, cmd: list[str], env: dict[str, str], kdir: Path) -> tuple[list[str], dict[str, str], Path]:
        argv, launch_env, cwd = super().wrap_command(cmd, env, kdir)
        i = argv.index("--seccomp")
        del argv[i:i + 2]
        spec = json.loads(argv[3])  # [python, -I, launcher.py, SPEC, --, bwrap, ...]
        spec.pop("seccomp")
        argv[3] = json.dumps(spec)
        return argv, launch_env, cwd


class JcKernel:
    """One kernel driven with jupyter_client the way the manager drives a session's kernel."""

    def __init__(self, tmp: Path, name: str, *, provisioner: str | None = None, cgroups: bool = True,
                 sleep: bool = True, boot: Callable[..., str] | None = None, ours: bool = False,
                 memhist: bool = False) -> None:
        self.dir = tmp / name
        self.name = name
        self.provisioner = provisioner
        self.cgroups = cgroups
        self.sleep = sleep
        self.boot = boot  # a preamble's boot_code, run as the manager runs it
        self.ours = ours  # the kernel command line of this checkout's kernelspec
        self.memhist = memhist
        self._home: Path | None = None  # a bare kernel's HOME (on tmpfs), removed at the end
        self.km: AsyncKernelManager | None = None
        self.kc: Any = None

    async def start(self) -> None:
        spec_dir = self.dir / "kernels" / "k"
        spec_dir.mkdir(parents=True)
        runtime = self.dir / "runtime"
        runtime.mkdir(mode=0o755)
        ws = self.dir / "ws"
        ws.mkdir()
        argv = [str(KPY), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        if self.ours:
            argv = [a.replace("{kernel_python}", str(KPY)) for a in json.loads(KERNELSPEC.read_text())["argv"]]
        if self.memhist:
            argv.append("--HistoryManager.hist_file=:memory:")
        spec: dict[str, Any] = {"display_name": self.name, "language": "python", "argv": argv,
                                "interrupt_mode": "message", "metadata": {}}
        env: dict[str, str] = {}
        if self.provisioner is not None:
            spec["metadata"] = {
                "kernel_provisioner": {"provisioner_name": self.provisioner, "config": {
                    "runtime_dir": str(runtime), "state_dir": str(self.dir / "state"),
                    "default_limits": Limits().model_dump_json(),
                    "cgroups_mode": "auto" if self.cgroups else "off"}},
                "kernelmode": {"ro_paths": kernel_env_paths(KPY)}}
            env = KernelParams(ws, Limits(), self.name).to_env()
        else:  # like direct_kernels.DirectKernel: HOME (IPython's history) on tmpfs, as the sandbox's /tmp
            home = Path(tempfile.mkdtemp(prefix="kmbench-home-", dir="/dev/shm"))
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(home),
                   "IPYTHONDIR": str(home / ".ipython"), "JUPYTER_RUNTIME_DIR": str(runtime)}
            self._home = home
            if not self.ours and not self.memhist:  # stock, whatever the kernel venv's config says
                argv.append(stock_history_arg(home / ".ipython"))
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        ksm = KernelSpecManager(kernel_dirs=[str(self.dir / "kernels")], ensure_native_kernel=False)
        self.km = AsyncKernelManager(kernel_name="k", kernel_spec_manager=ksm, transport="ipc",
                                     connection_file=str(runtime / "kernel.json"))
        self.km.ip = str(runtime / "k")
        log = (self.dir / "kernel.log").open("wb")
        try:
            await self.km.start_kernel(env=env, stdout=log, stderr=log, cwd=str(ws))
        finally:
            log.close()
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=120)
        if self.boot is not None:
            root = WORKSPACE_MOUNT if self.provisioner else str(ws)
            await self.run(self.boot([], {"root": root, "max_changes": 100}), silent=True)
        elif not self.sleep:
            await self.run("get_ipython().kernel._execute_sleep = 0", silent=True)

    def pids(self) -> list[int]:
        """The kernel's process tree: the launched process (bwrap's, for a sandbox) and below."""
        assert self.km is not None and self.km.provisioner is not None
        top = int(self.km.provisioner.pid)  # type: ignore[attr-defined]
        return [top, *descendants(top)]

    async def run(self, code: str, silent: bool = False) -> str | None:
        """One execute_request as the manager sends it; the text result. Tool calls over stdin
        (the preamble's ping) are answered as the manager's broker answers a ping."""
        kc = self.kc
        content = execute_content(code, silent)
        msg = kc.session.msg("execute_request", content)
        kc.shell_channel.send(msg)
        msg_id = msg["header"]["msg_id"]
        answering = asyncio.create_task(self._answer_stdin()) if silent else None
        try:
            while True:
                reply = await kc.get_shell_msg(timeout=MSG_TIMEOUT)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
        finally:
            if answering is not None:
                answering.cancel()
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{self.name}: {reply['content']}")
        result = None
        while True:
            m = await kc.get_iopub_msg(timeout=MSG_TIMEOUT)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "execute_result":
                result = m["content"]["data"].get("text/plain")
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return result

    async def _answer_stdin(self) -> None:
        while True:
            m = await self.kc.get_stdin_msg(timeout=MSG_TIMEOUT)
            prompt = m["content"].get("prompt", "")
            if prompt.startswith(MARKER):
                req = json.loads(prompt[len(MARKER):])
                ok = req.get("tool") == PING
                self.kc.input(json.dumps({"id": req["id"], "ok": ok, "result": "pong" if ok else None,
                                          "error": None if ok else "no tools here"}))

    async def roundtrip(self) -> float:
        t0 = time.perf_counter_ns()
        result = await self.run(CODE)
        if result != EXPECTED:
            raise RuntimeError(f"{self.name} answered {result!r}")
        return ms_since(t0)

    async def stop(self) -> None:
        await stop_kernel(self.km, self.kc, self._home)


def kernel_tree(gateway: int, kernel_id: str) -> list[int]:
    """A session's kernel with its bwrap wrappers: the gateway's child above the ipykernel."""
    table = ptable()
    pid = kernel_pid(gateway, kernel_id)
    while table.get(pid) not in (gateway, None, 0):
        pid = table[pid]
    return [pid, *descendants(pid, table)]


def ticks(pids: list[int]) -> int:
    return sum(s[2] for s in map(stat, pids) if s is not None)


def load_boot_code(checkout: Path) -> Callable[..., str]:
    """boot_code of another checkout's preamble (stdlib only; it reads files.py beside it)."""
    spec = importlib.util.spec_from_file_location("km_preamble_before",
                                                  checkout / "kernelmode" / "kernel" / "preamble.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.boot_code


def make_kernels(tmp: Path, paths: list[str], before: Path | None) -> dict[str, JcKernel]:
    ours: dict[str, Any] = {"boot": boot_code, "ours": True}
    kinds: dict[str, dict[str, Any]] = {
        "bare": {}, "bare_nosleep": {"sleep": False}, "bare_memhist": {"sleep": False, "memhist": True},
        "preamble": ours, "bwrap": {"provisioner": "kernelmode-bwrap", **ours},
        "bwrap_noseccomp": {"provisioner": NOSECCOMP, **ours},
        "bwrap_nocgroup": {"provisioner": "kernelmode-bwrap", "cgroups": False, **ours}}
    if before is not None:
        kinds["preamble_before"] = {"boot": load_boot_code(before)}
    return {p: JcKernel(tmp, p, **kinds[p]) for p in paths if p in kinds}


def prepare(args: argparse.Namespace, paths: list[str]) -> tuple[Path, str]:
    """A scratch folder (with the --before code in ``before/`` when a path needs it), and the
    no-seccomp provisioner registered; the scratch folder and the before commit."""
    tmp = Path(tempfile.mkdtemp(prefix="kmbench-kcpu-", dir="/tmp"))
    tmp.chmod(0o711)
    KernelProvisionerFactory.instance().provisioners[NOSECCOMP] = EntryPoint(
        name=NOSECCOMP, value="__main__:NoSeccompBwrap", group=KernelProvisionerFactory.GROUP_NAME)
    before_commit = ""
    if "rest_before" in paths or "preamble_before" in paths:
        (tmp / "before").mkdir()
        before_commit = export(args.before, tmp / "before")
    return tmp, before_commit


async def run(args: argparse.Namespace) -> int:
    started, load_start = time.monotonic(), loadavg()
    os.environ.setdefault("KERNELMODE_SANDBOX__KERNEL_PYTHON", str(KPY))
    paths = [p for p in ALL_PATHS if p in args.only] if args.only else list(ALL_PATHS)
    tmp, before_commit = prepare(args, paths)
    kernels = make_kernels(tmp, paths, tmp / "before" if before_commit else None)
    servers = {p: KmServer(p, {"KERNELMODE_SESSIONS__POOL_SIZE": "1"},
                           checkout=tmp / "before" if p == "rest_before" else None)
               for p in paths if p.startswith("rest")}
    stats = {p: Stats(p) for p in paths}
    cpu = CpuMeter(stats)
    tick: dict[str, int] = dict.fromkeys(paths, 0)
    syscalls: dict[str, dict[str, float]] = {}
    fns: dict[str, Callable[[], Awaitable[float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        for p, k in kernels.items():
            stack.push_async_callback(k.stop)
            print(f"starting {p} ...", flush=True)
            await k.start()
            cpu.watch(p, kernel=k.pids())
            fns[p] = k.roundtrip
        for p, km in servers.items():
            stack.push_async_callback(km.stop)
            km.start()
            conn = km.http()
            status, info = await conn.json("POST", "/v1/sessions", {"session_id": "warm"})
            if status != 201:
                raise RuntimeError(f"{p}: POST /v1/sessions: {status} {info}")
            cpu.watch(p, kernel=kernel_tree(km.gateway_pid, info["kernel_id"]), manager=km.manager_pid,
                      gateway=km.gateway_pid)
            fns[p] = functools.partial(conn.execute, "warm")

        @contextlib.contextmanager
        def account(name: str) -> Iterator[None]:
            t0 = ticks(cpu.pids[name]["kernel"])  # the kernel's CPU in ticks too (utime + stime)
            with cpu.around(name):
                yield
            tick[name] += ticks(cpu.pids[name]["kernel"]) - t0

        print(f"measuring {', '.join(paths)}: {args.samples} samples each ...", flush=True)
        await interleave(fns, stats, args.samples, args.batch, args.warmup, around=account,
                         progress=lambda r, n: print(f"  round {r}/{n}", flush=True))
        if args.strace and shutil.which("strace"):
            print(f"counting system calls: {args.strace} runs per path under strace ...", flush=True)
            for p in paths:
                syscalls[p] = await count_syscalls(cpu.pids[p]["kernel"][-1], fns[p], args.strace,
                                                   tmp / f"{p}.strace")
        for km in servers.values():
            await km.drop_connections()
    text = report(paths, stats, cpu, tick, syscalls, args, before_commit, time.monotonic() - started, load_start)
    print(text)
    if not args.no_write:
        write_section(REPO / "bench" / "RESULTS.md", "kernel-cpu", text)
    print("SUMMARY " + " ".join(f"{p}={cpu.per_run(p, 'kernel'):.3f}" for p in paths), flush=True)
    return 0


LABELS = {
    "bare": "bare ipykernel (jupyter_client, unsandboxed), 0.5 ms reply sleep on",
    "bare_nosleep": "bare, `_execute_sleep = 0`",
    "bare_memhist": "bare, no sleep, history database in memory",
    "preamble_before": "bare + the preamble and file agent (before)",
    "preamble": "bare + the preamble and file agent, kernelspec's command line (this checkout)",
    "bwrap": "preamble + bwrap sandbox (seccomp, cgroups, own uid), no gateway",
    "bwrap_noseccomp": "as bwrap, no seccomp filter (measurement only)",
    "bwrap_nocgroup": "as bwrap, cgroups off (rlimits)",
    "rest": "REST execute, `kernelmode serve` (this checkout)",
    "rest_before": "REST execute, `kernelmode serve` (before)",
}


async def count_syscalls(pid: int, fn: Callable[[], Awaitable[float]], runs: int, out: Path) -> dict[str, float]:
    """System calls per run of the ipykernel process ``pid`` (every thread), from ``strace -c``
    attached while ``runs`` runs are made (counts only: strace slows every call down)."""
    proc = await asyncio.create_subprocess_exec("strace", "-c", "-f", "-o", str(out), "-p", str(pid),
                                                stderr=asyncio.subprocess.DEVNULL)
    await asyncio.sleep(1.0)  # attached to every thread
    for _ in range(runs):
        await fn()
    await asyncio.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    await proc.wait()
    return per_run_calls(await asyncio.to_thread(out.read_text), runs)


def per_run_calls(strace_c: str, runs: int) -> dict[str, float]:
    """Calls per run by system call name, and their ``total``, from ``strace -c``'s table."""
    counts: dict[str, float] = {}
    for line in strace_c.splitlines():
        f = line.split()  # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            counts[f[-1]] = int(f[3]) / runs
    counts["total"] = sum(counts.values())
    return counts


# (what a difference measures, path with it, path without it)
CAUSES = (
    ("ipykernel's 0.5 ms sleep before each reply", "bare", "bare_nosleep"),
    ("IPython's history database in a file (its saving thread)", "bare_nosleep", "bare_memhist"),
    ("this checkout's preamble and kernel command line against the before code's", "preamble", "preamble_before"),
    ("the bwrap sandbox (seccomp, cgroups, own uid, namespaces)", "bwrap", "preamble"),
    ("the seccomp filter", "bwrap", "bwrap_noseccomp"),
    ("the cgroups (against rlimits)", "bwrap", "bwrap_nocgroup"),
    ("the path through the gateway and the manager (kernel side)", "rest", "bwrap"),
)


def report(paths: list[str], stats: dict[str, Stats], cpu: CpuMeter, tick: dict[str, int],
           syscalls: dict[str, dict[str, float]],
           args: argparse.Namespace, before_commit: str, wall: float, load_start: str) -> str:
    base = cpu.per_run(paths[0], "kernel")
    rows = []
    for p in paths:
        s = stats[p]
        k = cpu.per_run(p, "kernel")
        mg = [f"{cpu.per_run(p, r):.3f}" if r in cpu.ns[p] else "" for r in ("manager", "gateway")]
        label = LABELS[p] + (f" `{before_commit}`" if p.endswith("_before") else "")
        sc = syscalls.get(p, {})
        calls = f"{sc['total']:.0f} ({sc.get('futex', 0):.0f})" if sc else ""
        rows.append(f"| {label} | {s.n} | {s.median:.2f} | {s.pct(95):.2f} | **{k:.3f}** | {k - base:+.3f} | "
                    f"{tick[p] * 1000 / 100 / max(s.n, 1):.2f} | {calls} | {mg[0]} | {mg[1]} |")
    m = machine_info("every kernel here")
    filter_len = len(seccomp.compile_bpf()) // 8
    found = [f"- {what}: {cpu.per_run(a, 'kernel') - cpu.per_run(b, 'kernel'):+.3f} ms of kernel "
             f"CPU per run ({a} - {b})" for what, a, b in CAUSES if a in paths and b in paths]
    if "rest" in paths and "rest_before" in paths:
        d = {r: cpu.per_run("rest", r) - cpu.per_run("rest_before", r)
             for r in ("kernel", "manager", "gateway")}
        found.append(f"- REST `1+1`, this checkout against {before_commit}: median "
                     f"{stats['rest'].median - stats['rest_before'].median:+.2f} ms, CPU per run kernel "
                     f"{d['kernel']:+.3f} ms, manager {d['manager']:+.3f}, gateway {d['gateway']:+.3f}")
    return f"""## The kernel's CPU per run (issue 18, K)

Generated by `bench/kernel_cpu.py{' --quick' if args.quick else ''}` on {m['date']}: {args.samples}
samples per path, interleaved round-robin in batches of {args.batch} after {args.warmup} warm-ups;
wall {wall:.0f} s; load average {load_start} at the start, {loadavg()} at the end (a shared 2-CPU
machine: the CPU per run of each path, measured in this one run, is what counts). Warm `1+1`.
Kernel CPU: every thread of the kernel's process tree (bwrap's two processes included),
/proc schedstat; the ticks column is utime+stime (10 ms ticks) of the same tree, a cross-check.

| path | N | median ms | p95 ms | kernel CPU ms/run | vs {paths[0]} | kernel ticks ms/run | syscalls/run (futex) | manager CPU ms/run | gateway CPU ms/run |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(found)}

How to read it. Every kernel here runs the same ipykernel, and the system calls per run show
that a sandboxed kernel, and one behind the gateway, do exactly the work of a bare one: what a
kernel costs per run is ipykernel's own traffic between its threads (the shell thread, the main
thread, the IOPub thread, IPython's history thread: the futex column is mostly their hand-offs
of the GIL). The seccomp filter is {filter_len} BPF instructions, a linear chain by system call
number, but Linux (>= 5.11) caches the verdict of every call the filter allows whatever its
arguments, so the calls a run makes (futex, poll, epoll_wait, read, write, sendto, getpid...)
never run it. What this checkout changes in the kernel: an empty stdout/stderr flush returns at
once (the preamble's ``lean_flush``: ipykernel flushes both before a cell's result and before
its reply, each flush a round trip to the IOPub thread), and IPython's history database is in
memory (the kernelspec's ``--HistoryManager.hist_file=:memory:``: no saving thread writing sqlite
with a journal and fsyncs after each cell).

Python {m['python (manager, gateway, benchmark client)']}, kernel-venv python / ipykernel
{m['python / ipykernel (kernel-venv: every kernel here)']}, {m['kernel']}, {m['cpu']}.
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_sampling_args(p)
    p.add_argument("--before", default=None, help="git ref of rest_before (default: the merge base with main)")
    p.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   help=f"comma-separated paths among {', '.join(ALL_PATHS)}")
    p.add_argument("--strace", type=int, default=200, metavar="RUNS",
                   help="after the timing, count each kernel's system calls over RUNS runs (0: skip)")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = p.parse_args()
    sampling_args(p, args)
    if args.only and (bad := [x for x in args.only if x not in ALL_PATHS]):
        p.error(f"unknown paths: {bad}")
    return run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
