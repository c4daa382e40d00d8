"""A checkpoint's workspace files, moved through the kernel's channels (artifacts/channel.py).

Out: a tar made here from the agent's bounded, link-free walk, each file pulled into scratch
first. What is READ from the kernel is bounded by the session's disk limit, whatever sizes the
kernel claims (a sparse file counts at its full length; an agent replaced by kernel code may
lie): a file that does not fit what is left is skipped, with a reason, and a file that brings
more than it was allowed fails the transfer. In: the tar's regular files, each path cleaned.
"""

from __future__ import annotations

import asyncio
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import Any

from ..artifacts.base import ArtifactStore
from ..artifacts.channel import FileChannel, receive_file
from ..artifacts.workspace import clean_path
from ..errors import (
    CheckpointFailed,
    FileExists,
    FileNotFound,
    FileTransferFailed,
    KernelmodeError,
    PayloadTooLarge,
)
from ..models import SkippedFile


async def copy_in(store: ArtifactStore, key: str, channel: FileChannel, rel: PurePosixPath) -> None:
    """Stream a stored checkpoint into the workspace (never whole in the manager's memory)."""
    with store.reader(key) as f:
        await channel.write(rel, _blocks(f, 1 << 21), None, overwrite=True)


async def _blocks(f: Any, size: int, limit: int | None = None) -> AsyncIterator[bytes]:
    """Blocks of at most ``size`` bytes read (in a thread) from a file object, ``limit`` in all."""
    left = limit
    while left is None or left > 0:
        block = await asyncio.to_thread(f.read, size if left is None else min(size, left))
        if not block:
            return
        if left is not None:
            left -= len(block)
        yield block


async def archive(channel: FileChannel, dest: Path, scratch: Path, budget: int) -> tuple[int, int, list[SkippedFile]]:
    """Tar the workspace's regular files (the agent's bounded walk), each pulled through the
    channel into scratch first, at most ``budget`` bytes read in all: (files, bytes of the tar,
    the files left out). Smallest first, so a huge (or sparse) file costs only itself."""
    listing = await channel.scan()
    if not listing:
        return 0, 0, []
    count, rel, left = 0, "", budget
    skipped: list[SkippedFile] = []

    def skip(entry: Any, size: str) -> None:
        skipped.append(SkippedFile(path=entry.shown_path, reason=(
            f"{size}: over the {left} bytes left of the checkpoint's {budget}-byte workspace budget "
            "(limits.disk_mb; sparse files count at their full length)")))

    try:
        with tarfile.open(dest, "w") as tar:
            for rel, entry in sorted(listing.items(), key=lambda item: (item[1].size, item[0])):
                if entry.size > left:
                    skip(entry, f"{entry.size} bytes")
                    continue
                try:
                    # The bound is passed on: the channel refuses a larger announced size and
                    # more bytes than announced, so no more than ``left`` is ever read.
                    tmp, size, _ = await receive_file(channel, rel, left, scratch)
                except FileNotFound:
                    continue  # gone since the walk
                except PayloadTooLarge:  # grew since the walk (or the walk lied)
                    skip(entry, "larger when read than when listed")
                    continue
                except FileTransferFailed as e:  # changed while it was read (or a lying kernel)
                    raise CheckpointFailed(f"the workspace could not be saved ({rel!r}: {e.message}); "
                                           "try again") from e
                try:
                    left -= size
                    member = tarfile.TarInfo(rel)
                    member.size, member.mtime, member.mode = size, entry.mtime_ns // 10**9, 0o600
                    with tmp.open("rb") as f:
                        await asyncio.to_thread(tar.addfile, member, f)
                    count += 1
                finally:
                    tmp.unlink(missing_ok=True)
        return count, dest.stat().st_size, skipped  # noqa: ASYNC240 (a local temp file)
    except OSError as e:  # the scratch disk is full
        dest.unlink(missing_ok=True)  # noqa: ASYNC240
        raise CheckpointFailed(f"the workspace could not be saved ({rel!r}: {e}); try again") from e
    except BaseException:
        dest.unlink(missing_ok=True)  # noqa: ASYNC240 (no half-written tar left behind)
        raise


async def unpack(src: Path, channel: FileChannel, overwrite: bool = True) -> None:
    """Write a checkpoint's files into a workspace: regular files only, each path cleaned."""
    with tarfile.open(src, "r") as tar:
        for member in tar:
            if not member.isreg() or not stat.S_ISREG(member.mode | stat.S_IFREG):
                continue
            try:
                rel = clean_path(member.name)
            except KernelmodeError:
                continue
            f = tar.extractfile(member)
            if f is not None:
                try:
                    await channel.write(rel, _blocks(f, 1 << 21, member.size), member.size, overwrite=overwrite)
                except FileExists:
                    if overwrite:
                        raise
