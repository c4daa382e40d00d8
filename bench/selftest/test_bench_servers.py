"""bench/servers.py without a server: CPU per path over interleaved batches (real processes,
/proc) and another checkout's code exported from git, as the A/B benchmarks use them."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from harness import BENCH, Stats, interleave
from servers import CpuMeter, KmServer, before_checkout, git, is_checkout


@pytest.fixture
def busy_and_idle() -> Iterator[tuple[int, int]]:
    """A process that spins and one that sleeps, stopped at the end."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "600"])
    try:
        yield busy.pid, idle.pid
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_cpu_meter_counts_each_paths_processes_over_its_own_batches(busy_and_idle: tuple[int, int]) -> None:
    busy, idle = busy_and_idle
    stats = {p: Stats(p) for p in ("spin", "rest")}
    cpu = CpuMeter(stats, client=True)
    cpu.watch("spin", worker=busy)
    cpu.watch("rest", worker=[idle])

    async def one() -> float:
        await asyncio.sleep(0.01)
        return 1.0

    asyncio.run(interleave({"spin": one, "rest": one}, stats, samples=6, batch=2, warmup=1,
                           around=cpu.around))
    assert cpu.runs == {"spin": 6, "rest": 6}  # the warm-up runs are not accounted
    assert cpu.measured("spin", "worker") and cpu.per_run("spin", "worker") > 0
    assert cpu.ns["rest"]["worker"] < cpu.ns["spin"]["worker"]  # a sleeping process barely runs
    assert set(cpu.ns["spin"]) == set(cpu.ns["rest"]) == {"worker", CpuMeter.CLIENT}
    assert not cpu.measured("rest", "manager") and cpu.per_run("rest", "manager") == 0


def test_another_refs_code_is_exported_to_run_a_server_from() -> None:
    if subprocess.run(["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the A/B benchmarks export the before code with git")
    tmp, before, after = before_checkout("HEAD", "kmtest-export-")
    try:
        assert before == after == git("rev-parse", "--short", "HEAD")
        assert is_checkout(tmp / "before") and not is_checkout(tmp)
        assert (tmp / "before" / "kernelmode" / "cli.py").read_bytes() == \
            subprocess.run(["git", "-C", str(BENCH), "show", "HEAD:kernelmode/cli.py"], check=True,
                           capture_output=True).stdout
        km = KmServer("before", {}, checkout=tmp / "before")
        assert km.env["PYTHONPATH"] == str(tmp / "before")  # its code, not this checkout's
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
