"""Workspace volumes: each workspace its own small ext4 filesystem (a sparse image, loop-mounted),
so that a full workspace is "No space left on device" inside the kernel, not a full host disk.

Needs root, loop devices and mkfs.ext4; ``auto`` mode proves all three once at start-up and
otherwise falls back to plain directories (then only RLIMIT_FSIZE bounds a single file), saying
so in the log and in /readyz. An image costs ~0.7 MB on disk until files are written; creating
and mounting one takes ~30 ms.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import KernelUnavailable
from .remove import remove_tree

log = logging.getLogger("kernelmode.artifacts")
_TIMEOUT = 30


def _run(*argv: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{argv[0]} failed: {e}") from e
    if proc.returncode != 0:
        raise KernelUnavailable(f"{' '.join(argv[:2])} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")


def _mounts_under(root: Path) -> list[Path]:
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point.startswith(str(root) + "/"):
                found.append(Path(mount_point))
    return found


def detach_all(root: Path, keep: set[Path] | frozenset[Path] = frozenset()) -> None:
    """Lazily unmount every volume under ``root`` (what a killed manager left mounted) but those
    in ``keep`` (workspaces of adopted kernels)."""
    for mount_point in sorted((m for m in _mounts_under(root) if m not in keep), reverse=True):
        with contextlib.suppress(KernelUnavailable):
            _run("umount", "-l", str(mount_point))


class WorkspaceVolumes:
    def __init__(self, root: Path, mode: str) -> None:
        self.root = root
        self.enabled = False
        self.mode = mode
        # Why the last workspace could not be made (None once one is): /readyz reports it.
        self.error: str | None = None

    def start(self, keep: set[Path] | frozenset[Path] = frozenset()) -> str:
        """Unmount what a previous run left mounted (but ``keep``); decide whether volumes work here."""
        detach_all(self.root, keep)
        if self.mode == "off":
            return "off"
        missing = [t for t in ("mkfs.ext4", "mount", "umount") if shutil.which(t) is None]
        if os.getuid() != 0 or missing or not os.path.exists("/dev/loop-control"):
            why = "not root" if os.getuid() != 0 else f"missing {', '.join(missing) or '/dev/loop-control'}"
            log.warning("workspace quota off (%s): only single files are capped (RLIMIT_FSIZE)", why)
            return f"off ({why})"
        probe = self.root / ".volume-check"
        try:
            self.enabled = True
            self.create(probe, 16)
            self.destroy(probe)
        except KernelUnavailable as e:
            self.enabled = False
            remove_tree(probe)
            probe.with_suffix(".img").unlink(missing_ok=True)
            log.warning("workspace quota off (loop mount failed: %s)", e)
            return f"off (loop mount failed: {e})"
        return "ext4 loop volume per workspace (size = limits.disk_mb)"

    def create(self, path: Path, size_mb: int) -> None:
        path.mkdir(mode=0o700)
        if not self.enabled:
            return
        image = path.with_name(path.name + ".img")
        try:
            with open(image, "wb") as f:
                f.truncate(size_mb * 1024 * 1024)  # sparse: disk is used as files are written
            os.chmod(image, 0o600)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
                 "-E", "lazy_itable_init=1,root_owner=0:0", str(image))
            _run("mount", "-o", "loop,nosuid,nodev", str(image), str(path))
            (path / "lost+found").rmdir()
            os.chmod(path, 0o700)
        except BaseException as e:
            if isinstance(e, (KernelUnavailable, OSError)):
                self.error = str(e)
            self.destroy(path)
            raise
        self.error = None

    def sweep(self, keep: set[Path]) -> None:
        """At shutdown: detach every volume; remove those of no session (a pool kernel whose
        start was cancelled midway may have left one)."""
        for mount_point in sorted(_mounts_under(self.root), reverse=True):
            if mount_point in keep:
                self.unmount(mount_point)
            else:
                with contextlib.suppress(KernelUnavailable):
                    self.destroy(mount_point)

    def unmount(self, path: Path) -> None:
        """Detach a volume, keeping its image (the files of a session that becomes lost)."""
        if os.path.ismount(path):
            with contextlib.suppress(KernelUnavailable):
                _run("umount", "-l", str(path))

    def attach(self, path: Path) -> None:
        """Mount a kept volume again (a hibernated session wakes); nothing when it is mounted
        or there is no image (quota off)."""
        image = path.with_name(path.name + ".img")
        if self.enabled and image.exists() and not os.path.ismount(path):
            _run("mount", "-o", "loop,nosuid,nodev", str(image), str(path))

    def destroy(self, path: Path) -> None:
        if os.path.ismount(path):
            try:
                _run("umount", str(path))
            except KernelUnavailable:
                _run("umount", "-l", str(path))  # still busy: detach now, free when idle
        remove_tree(path)  # iterative: kernel code may have made the tree thousands deep
        path.with_name(path.name + ".img").unlink(missing_ok=True)
