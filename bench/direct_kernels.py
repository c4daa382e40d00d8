"""The floor of every benchmark: unsandboxed ipykernels (the kernel venv's python) driven with
jupyter_client. ``DirectKernel`` / ``BareKernels`` are tuned like kernelmode's kernels
(``tuned_kernel_args``), so that a ratio against them is the cost of kernelmode's hops;
``stock=True`` gives IPython's defaults (``stock_history_arg``) for context."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import CODE, CONCURRENCY, EXPECTED, KERNEL_PYTHON, MSG_TIMEOUT, REPO, ms_since
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

# -- reference kernels: the floor ----------------------------------------------------------------


def _tmpfs_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


async def stop_kernel(km: AsyncKernelManager | None, kc: Any, home: Path | None) -> None:
    """Stop a kernel started with jupyter_client (politely, then at once) and remove its HOME."""
    if kc is not None:
        with contextlib.suppress(Exception):
            kc.stop_channels()
    if km is not None and km.has_kernel:
        try:
            await asyncio.wait_for(km.shutdown_kernel(now=False), 15)
        except Exception:
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def stock_history_arg(ipython_dir: Path) -> str:
    """IPython's default history file, stated on a bare kernel's command line: the kernel venv's
    own config (etc/ipython/ipython_kernel_config.json, from `kernelmode setup`) keeps history in
    memory, and a bare ipykernel must stay stock (the command line wins over config files)."""
    return f"--HistoryManager.hist_file={ipython_dir / 'profile_default' / 'history.sqlite'}"


def tuned_kernel_args() -> list[str]:
    """What kernelmode's kernels run with, as a bare ipykernel's command line: the IPython config
    every kernel environment gets (kernel-image/ipython_kernel_config.json: history in memory,
    no sqlite write in a thread after each cell) and no 0.5 ms pause before each execute_reply
    (ipykernel's ``_execute_sleep``, which kernelmode/kernel/preamble.py sets to 0). A direct
    kernel tuned the same way is the reference of the goal ratios: REST / direct is then the
    cost of the hops, not of the tuning."""
    config = json.loads((REPO / "kernel-image" / "ipython_kernel_config.json").read_text())
    args = [f"--{cls}.{name}={value}" for cls, traits in config.items() for name, value in traits.items()]
    return [*args, "--IPythonKernel._execute_sleep=0"]


class DirectKernel:
    """An unsandboxed ipykernel (kernel-venv python) driven with jupyter_client: tuned like
    kernelmode's kernels (``tuned_kernel_args``) unless ``stock`` (IPython's defaults)."""

    def __init__(self, tmp: Path, transport: str = "ipc", stock: bool = False) -> None:
        self.tmp = tmp
        self.transport = transport
        self.stock = stock
        self.km: AsyncKernelManager | None = None
        self.kc: Any = None
        self.log_path = tmp / "direct-kernel.log"
        self.home: Path | None = None

    async def start(self) -> None:
        # HOME (and so IPython's history database) on tmpfs when there is one, like the
        # sandbox's /tmp: on disk, the history writes of every execution cost ~0.3 ms here.
        self.home = Path(tempfile.mkdtemp(prefix="kmbench-home-", dir=_tmpfs_dir()))
        spec_dir = self.tmp / "kernels" / "kmbench-direct"
        spec_dir.mkdir(parents=True)
        tuning = [stock_history_arg(self.home / ".ipython")] if self.stock else tuned_kernel_args()
        (spec_dir / "kernel.json").write_text(json.dumps({
            "display_name": "kmbench direct (kernel-venv)",
            "language": "python",
            "argv": [str(KERNEL_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}", *tuning],
        }))
        ksm = KernelSpecManager(kernel_dirs=[str(self.tmp / "kernels")], ensure_native_kernel=False)
        runtime = self.tmp / "runtime"
        runtime.mkdir()
        self.km = AsyncKernelManager(
            kernel_name="kmbench-direct", kernel_spec_manager=ksm,
            connection_file=str(runtime / "kernel-direct.json"), transport=self.transport,
        )
        if self.transport == "ipc":  # like kernelmode's gateway; the default tcp is on loopback
            self.km.ip = str(runtime / "kernel-ipc")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "HOME": str(self.home), "IPYTHONDIR": str(self.home / ".ipython"),
               "JUPYTER_RUNTIME_DIR": str(runtime)}
        logf = self.log_path.open("wb")
        try:
            await self.km.start_kernel(env=env, stdout=logf, stderr=logf)
        finally:
            logf.close()  # the kernel has its own copy
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        assert self.km is not None
        return int(self.km.provisioner.pid)  # type: ignore[union-attr]

    async def run_cell(self, code: str) -> tuple[float, str | None, str]:
        """(ms until execute_reply and idle, text result, stdout) of one cell."""
        kc = self.kc
        t0 = time.perf_counter_ns()
        msg_id = kc.execute(code)
        result, out = None, []
        while True:
            msg = await kc.get_shell_msg(timeout=MSG_TIMEOUT)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
                break
        while True:
            msg = await kc.get_iopub_msg(timeout=MSG_TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "execute_result":
                result = msg["content"]["data"].get("text/plain")
            elif kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        return ms_since(t0), result, "".join(out)

    async def roundtrip(self) -> float:
        elapsed, result, _ = await self.run_cell(CODE)
        if result != EXPECTED:
            raise RuntimeError(f"direct kernel answered {result!r}, not {EXPECTED!r}")
        return elapsed

    async def stop(self) -> None:
        await stop_kernel(self.km, self.kc, self.home)


class BareKernels:
    """Unsandboxed ipykernels (kernel-venv python) via jupyter_client, tuned like kernelmode's
    unless ``stock`` (``DirectKernel``); all stopped at the end."""

    def __init__(self, tmp: Path, stock: bool = False) -> None:
        self.tmp = tmp
        self.stock = stock
        self.count = 0
        self.alive: list[DirectKernel] = []

    def new(self) -> DirectKernel:
        """A kernel not started yet, in a folder of its own (stopped with the others)."""
        self.count += 1
        d = self.tmp / f"bare-{self.count}"
        d.mkdir()
        dk = DirectKernel(d, "ipc", self.stock)
        self.alive.append(dk)
        return dk

    async def cold_start(self) -> tuple[float, float, float]:
        """(start until the first execute ran, start until ready, first execute) in ms."""
        dk = self.new()
        try:
            t0 = time.perf_counter_ns()
            await dk.start()
            t_ready = ms_since(t0)
            await dk.roundtrip()
            total = ms_since(t0)
        finally:
            await self.stop([dk])
        return total, t_ready, total - t_ready

    async def start_many(self, n: int) -> list[DirectKernel]:
        out: list[DirectKernel] = []
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                dk = self.new()
                await dk.start()
                await dk.roundtrip()
                out.append(dk)

        await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, n))))
        return out

    async def stop(self, kernels: list[DirectKernel] | None = None) -> None:
        kernels = list(self.alive) if kernels is None else kernels
        await asyncio.gather(*(dk.stop() for dk in kernels), return_exceptions=True)
        for dk in kernels:
            if dk in self.alive:
                self.alive.remove(dk)
            shutil.rmtree(dk.tmp, ignore_errors=True)
