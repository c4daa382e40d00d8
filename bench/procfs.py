"""Small /proc readers shared by the benchmarks and the load test (Linux only)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


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
