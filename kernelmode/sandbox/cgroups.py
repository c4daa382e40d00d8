"""Per-kernel cgroups for memory and process caps (v2 unified, or v1 memory+pids hierarchies).

Used by the bwrap provisioner inside the gateway process. When no writable hierarchy exists
(not root, or a read-only cgroupfs), :func:`detect` returns None and the sandbox falls back to
rlimits (RLIMIT_AS, RLIMIT_NPROC), which the docs describe as the weaker option.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "kernelmode"


@dataclass
class KernelCgroup:
    """The cgroup directories of one kernel; ``procs_files`` are where its launcher joins."""

    version: str
    dirs: list[Path] = field(default_factory=list)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """How many processes the kernel's memory cap has killed."""
        for d in self.dirs:
            name = "memory.events" if self.version == "v2" else "memory.oom_control"
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def memory_bytes(self) -> int | None:
        """What the kernel's processes use now (None when the cgroup is not there)."""
        name = "memory.current" if self.version == "v2" else "memory.usage_in_bytes"
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                return int((d / name).read_text())
        return None

    def _pids(self) -> set[int]:
        pids: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(f).read_text().split())
        return pids

    def destroy(self, timeout: float = 2.0) -> None:
        """Kill whatever is left inside and remove the directories."""
        deadline = time.monotonic() + timeout
        while (pids := self._pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def detect() -> str | None:
    """'v2', 'v1' or None: which hierarchy can hold per-kernel memory and pids caps."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        if {"memory", "pids"} <= set(controllers) and _writable(CGROUP_ROOT):
            return "v2"
        return None
    if _writable(CGROUP_ROOT / "memory") and _writable(CGROUP_ROOT / "pids"):
        return "v1"
    return None


def create(kernel_id: str, memory_mb: int, pids: int, version: str) -> KernelCgroup:
    """Create the kernel's cgroup(s) with its caps; raise OSError when the machine refuses."""
    memory = memory_mb * 1024 * 1024
    if version == "v2":
        parent = CGROUP_ROOT / PARENT
        if not parent.exists():
            parent.mkdir()
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory +pids")
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        d = parent / kernel_id
        d.mkdir(exist_ok=True)
        (d / "memory.max").write_text(str(memory))
        with contextlib.suppress(OSError):
            (d / "memory.swap.max").write_text("0")
        (d / "pids.max").write_text(str(pids))
        return KernelCgroup("v2", [d])
    mem = CGROUP_ROOT / "memory" / PARENT / kernel_id
    pid = CGROUP_ROOT / "pids" / PARENT / kernel_id
    mem.mkdir(parents=True, exist_ok=True)
    pid.mkdir(parents=True, exist_ok=True)
    (mem / "memory.limit_in_bytes").write_text(str(memory))
    # Without a swap cap the kernel would page out instead of hitting its limit.
    with contextlib.suppress(OSError):
        (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
    with contextlib.suppress(OSError):
        (mem / "memory.swappiness").write_text("0")
    (pid / "pids.max").write_text(str(pids))
    return KernelCgroup("v1", [mem, pid])


def existing(kernel_id: str, version: str) -> KernelCgroup:
    """The cgroup of a kernel created earlier (its dirs may be gone)."""
    if version == "v2":
        return KernelCgroup("v2", [CGROUP_ROOT / PARENT / kernel_id])
    return KernelCgroup(
        "v1", [CGROUP_ROOT / "memory" / PARENT / kernel_id, CGROUP_ROOT / "pids" / PARENT / kernel_id]
    )


def sweep_stale(version: str, min_age: float = 600.0) -> int:
    """Remove kernel cgroups left empty by a killed server (rmdir refuses one with processes).

    Only those older than ``min_age``: another server may have just made one for a kernel that
    is about to join it.
    """
    parents = [CGROUP_ROOT / PARENT] if version == "v2" else [
        CGROUP_ROOT / "memory" / PARENT, CGROUP_ROOT / "pids" / PARENT]
    cutoff = time.time() - min_age
    n = 0
    for parent in parents:
        with contextlib.suppress(OSError):
            for d in parent.iterdir():
                with contextlib.suppress(OSError):
                    if d.is_dir() and d.stat().st_mtime < cutoff and not (d / "cgroup.procs").read_text().strip():
                        d.rmdir()
                        n += 1
    return n
