"""A session's workspace (``/mnt/data`` in its kernel): client paths, entries, errors, and the
host-side view.

The manager never reads or writes a workspace on its own disk: uploads, listings, downloads,
deletes, harvests and checkpoints go through the kernel's own channels (artifacts/channel.py
and the file agent kernel/file_agent.py, which walks and opens files by the rules below). The host
keeps only the workspace's volume (artifacts/volume.py: quota, mounted into the sandbox).

Kernel code controls everything in here, so nothing is trusted: paths are validated as text,
then every component is opened without following links (``O_NOFOLLOW`` on each directory
from the workspace root down), and a file with more than one hard link is never served (a
kernel could link a file of its own directory, like its connection file, into the workspace).

The walk (listings, a run's harvest, upload accounting) runs while kernel code may be changing
the tree: it is iterative, bounded in entries and depth (saying where it stopped), skips
whatever vanishes or changes type under it, and carries names that are not UTF-8 as
surrogate-escaped text, shown to clients with the bad bytes escaped (``\\xff``).
"""

from __future__ import annotations

import mimetypes
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import PurePosixPath

from ..errors import InvalidRequest
from ..sandbox.spec import WORKSPACE_MOUNT

MAX_PATH_LENGTH = 1024
NAME_MAX = 255  # bytes in one path component (Linux file systems)
# Bounds of one walk: a listing or harvest costs at most this much, whatever the kernel made.
SCAN_MAX_ENTRIES = 10_000  # directory entries read (files, folders and anything else)
SCAN_MAX_DEPTH = 64  # folders below the workspace; deeper ones are not looked into


# Where a kernel writes a checkpoint and reads one back (sessions/checkpoints.py moves it out
# at once); listings, harvests and checkpoints of the workspace leave it out.
CHECKPOINT_DIR = ".kernelmode-checkpoint"


def mime_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


def clean_path(rel: str) -> PurePosixPath:
    """Validate a workspace-relative path given by a client: relative, no '..', no NUL, no '\\'."""
    if rel.startswith(WORKSPACE_MOUNT + "/"):
        rel = rel[len(WORKSPACE_MOUNT) + 1 :]
    if not rel or len(rel) > MAX_PATH_LENGTH:
        raise InvalidRequest("the file path is empty or too long")
    if "\x00" in rel or "\\" in rel:
        raise InvalidRequest("the file path may not contain NUL or backslashes")
    if rel.startswith("/"):
        raise InvalidRequest("the file path must be relative to /mnt/data")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest("the file path may not contain '..', '.' or empty parts")
    try:
        too_long = any(len(p.encode()) > NAME_MAX for p in parts)
    except UnicodeEncodeError as e:  # a lone surrogate (JSON "\ud800"): no file system name
        raise InvalidRequest("the file path is not valid Unicode") from e
    if too_long:  # the file system would refuse it (ENAMETOOLONG)
        raise InvalidRequest(f"a file or folder name in the path is longer than {NAME_MAX} bytes")
    return PurePosixPath(*parts)


def shown(name: str) -> str:
    """A file system name as text for clients: bytes that are not UTF-8 (carried as lone
    surrogates by ``os.fsdecode``) escaped as ``\\xNN``, so JSON, SQLite and URLs take it."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the workspace, as the file system has it (surrogate-escaped)
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int = 0

    @property
    def shown_path(self) -> str:
        """The path as clients see it (see ``shown``)."""
        return shown(self.path)

    @property
    def name(self) -> str:
        return PurePosixPath(self.shown_path).name

    def info(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": f"{WORKSPACE_MOUNT}/{self.shown_path}",
            "size_bytes": self.size,
            "mime_type": mime_type(self.name),
            "modified": datetime.fromtimestamp(self.mtime_ns / 1e9, timezone.utc).isoformat(),
        }


class Listing(dict[str, FileEntry]):
    """The files a walk found, by relative path, and why it did not see everything (if so)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: str | None = None  # "stopped after N entries...", for clients
        self.full = False  # stopped at the entry bound
        self.started_ns = time.time_ns()  # a file changed after this has a later ctime
