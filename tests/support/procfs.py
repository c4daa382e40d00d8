"""Small /proc readers shared by the benchmarks and the load test (Linux only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


def status_field(pid: int, key: str) -> str | None:
    """The first value of ``key:`` in /proc/<pid>/status (e.g. ``VmHWM``, ``Uid``); None when gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return line.split()[1]
    return None


def rss_kb(pid: int) -> int:
    """Resident set size (kB) from /proc/<pid>/statm; 0 when the process is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except (OSError, IndexError, ValueError):
        return 0


def hwm_kb(pid: int) -> int | None:
    """The kernel's record of the process's peak RSS (VmHWM, kB) since start or the last reset."""
    value = status_field(pid, "VmHWM")
    return int(value) if value is not None else None


def reset_hwm(pid: int) -> bool:
    """Reset VmHWM to the current RSS (``5`` > /proc/<pid>/clear_refs, Linux >= 4.0)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, start time in ticks since boot, utime+stime ticks) of a process, None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()
    return int(f[1]), int(f[19]), int(f[11]) + int(f[12])


def ptable() -> dict[int, int]:
    """pid -> ppid of every process."""
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = stat(int(d))
            if st is not None:
                out[int(d)] = st[0]
    return out


def descendants(root: int, table: dict[int, int] | None = None) -> list[int]:
    """Every process below ``root`` (children, their children, ...)."""
    table = ptable() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def cmdline(pid: int) -> list[str]:
    """The argument list of a process ([] when gone)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def processes_mentioning(text: str) -> list[int]:
    """Host pids (not this one) whose command line or cwd mention ``text`` (a data dir, a kernel id)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if text in line or text in cwd:
            pids.append(int(entry.name))
    return pids


def uid_of(pid: int) -> int | None:
    uid = status_field(pid, "Uid")
    return int(uid) if uid is not None else None


def mem_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in kB from /proc/<pid>/smaps_rollup; (0, 0) when the process is gone."""
    rss = pss = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def tree_mem(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in kB of some processes together."""
    rss = pss = 0
    for pid in pids:
        r, p = mem_kb(pid)
        rss, pss = rss + r, pss + p
    return rss, pss


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of some processes together, in CLK_TCK ticks."""
    return sum(st[2] for st in map(stat, pids) if st is not None)


def cpu_ns(pid: int) -> int:
    """On-CPU time of every thread of ``pid`` (ns, /proc/<pid>/task/*/schedstat)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return sum(f) - idle, sum(f)


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def unmount_under(root: Path) -> None:
    """Detach every mount below ``root`` (a killed manager cannot detach its workspace volumes)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4]
        if mount_point.startswith(f"{root}/"):
            subprocess.run(["umount", "-l", mount_point], check=False, capture_output=True)
