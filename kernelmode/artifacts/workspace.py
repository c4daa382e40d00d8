"""A session's workspace (``/mnt/data`` in its kernel): client paths, entries, errors, and the
host-side view.

Clients' files and harvests go through the kernel's own channels (artifacts/channel.py and the
file agent kernel/files.py, which walks and opens with the same rules as below). The host-side
``Workspace`` stays only for what needs the manager's own disk: checkpoints (the workspace tar,
the kernel's snapshot file) and seeding a fork's workspace.

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

import contextlib
import errno
import mimetypes
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from ..errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from ..sandbox.spec import WORKSPACE_MOUNT

MAX_PATH_LENGTH = 1024
NAME_MAX = 255  # bytes in one path component (Linux file systems)
# Bounds of one walk: a listing or harvest costs at most this much, whatever the kernel made.
SCAN_MAX_ENTRIES = 10_000  # directory entries read (files, folders and anything else)
SCAN_MAX_DEPTH = 64  # folders below the workspace; deeper ones are not looked into


# Where a kernel writes a checkpoint and reads one back (sessions/checkpoints.py moves it out
# at once); listings, harvests and checkpoints of the workspace leave it out.
CHECKPOINT_DIR = ".kernelmode-checkpoint"


class FileNotFound(NotFound):
    code = "file_not_found"


class FileExists(Conflict):
    code = "file_exists"


class WorkspaceFull(PayloadTooLarge):
    code = "workspace_full"


class WorkspaceChanged(Conflict):
    """Kernel code removed or replaced the upload's folder while it was written."""

    code = "workspace_changed"


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


class Workspace:
    def __init__(self, root: Path, owner: tuple[int, int] | None = None) -> None:
        self.root = root
        self.owner = owner  # (uid, gid) of the kernel, when the service runs as root

    # -- safe traversal ------------------------------------------------------------------------------
    def _open_dir(self, parts: tuple[str, ...], create: bool) -> int:
        """An fd of the directory ``root/parts``, reached without following any link."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for part in parts:
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o700, dir_fd=fd)
                    if self.owner:
                        os.chown(part, *self.owner, dir_fd=fd, follow_symlinks=False)
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open_file(self, rel: PurePosixPath) -> tuple[int, os.stat_result]:
        """Open a regular, singly-linked file for reading; FileNotFound otherwise."""
        try:
            dfd = self._open_dir(rel.parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError, OSError) as e:
            raise FileNotFound(f"no file {WORKSPACE_MOUNT}/{rel}") from e
        try:
            fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as e:  # missing, a link (ELOOP), a fifo...
            raise FileNotFound(f"no file {WORKSPACE_MOUNT}/{rel}") from e
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise FileNotFound(f"no regular file {WORKSPACE_MOUNT}/{rel}")
        return fd, st

    def write(self, rel: PurePosixPath, chunks: Iterator[bytes] | bytes, overwrite: bool) -> str:
        """Write a file atomically (temp file + rename); returns its path in the kernel."""
        try:
            dfd = self._open_dir(rel.parts[:-1], create=True)
        except OSError as e:  # a parent is a file, or a link the kernel planted (ELOOP)
            raise FileExists(f"a parent of {WORKSPACE_MOUNT}/{rel} is not a directory") from e
        try:
            try:
                existing = os.stat(rel.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None:
                if not overwrite:
                    raise FileExists(f"{WORKSPACE_MOUNT}/{rel} exists (add ?overwrite=true to replace it)")
                if stat.S_ISDIR(existing.st_mode):
                    raise FileExists(f"{WORKSPACE_MOUNT}/{rel} is a directory")
            tmp = f".upload-{os.urandom(8).hex()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
                        f.write(chunk)  # ENOSPC on a full workspace volume
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                if e.errno == errno.ENOSPC:
                    raise WorkspaceFull(f"the workspace is full: {WORKSPACE_MOUNT}/{rel} does not fit") from e
                raise
            try:
                if self.owner:
                    os.chown(tmp, *self.owner, dir_fd=dfd, follow_symlinks=False)
                # rename replaces a link planted at the name; it never writes through it
                os.rename(tmp, rel.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        except OSError as e:  # the folder was removed, or the name made a folder, meanwhile
            raise WorkspaceChanged(f"{WORKSPACE_MOUNT}/{rel} changed while it was uploaded "
                                   f"({errno.errorcode.get(e.errno or 0, 'error')}); try again") from e
        finally:
            os.close(dfd)
        return f"{WORKSPACE_MOUNT}/{rel}"

    # -- listing ---------------------------------------------------------------------------------------
    def scan(self, max_entries: int = SCAN_MAX_ENTRIES, max_depth: int = SCAN_MAX_DEPTH) -> Listing:
        """Regular, singly-linked files (no links followed), by relative path.

        Depth first, holding one fd per folder on the current path only (at most ``max_depth``).
        An entry that vanishes, turns into something else or cannot be read between being listed
        and being looked at is skipped: kernel code may change the tree while this runs."""
        listing = Listing()
        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return listing
        stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = []
        deep = False

        def enter(fd: int, prefix: str) -> None:
            try:
                stack.append((fd, os.scandir(fd), prefix))
            except OSError:
                os.close(fd)

        enter(root, "")
        seen = 0
        try:
            while stack:
                fd, it, prefix = stack[-1]
                try:
                    entry = next(it, None)
                except OSError:  # the folder broke under us (removed, I/O error): done with it
                    entry = None
                if entry is None:
                    stack.pop()
                    it.close()  # type: ignore[attr-defined]
                    os.close(fd)
                    continue
                seen += 1
                if seen > max_entries:
                    listing.full = True
                    listing.stopped = f"stopped after {max_entries} entries: the rest of the workspace was not looked at"
                    break
                name = entry.name
                if name.startswith(".upload-"):  # an upload being written (Workspace.write)
                    continue
                if name == CHECKPOINT_DIR and not prefix:  # checkpoints in transit: not the user's files
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:  # gone already
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if len(stack) > max_depth:
                        deep = True
                        continue
                    try:  # it may have been swapped for a link or file since the stat: nofollow
                        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    except OSError:
                        continue
                    enter(sub, f"{prefix}{name}/")
                elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    rel = f"{prefix}{name}"
                    listing[rel] = FileEntry(rel, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        finally:
            for fd, it, _ in stack:
                it.close()  # type: ignore[attr-defined]
                os.close(fd)
        if deep:
            note = f"folders deeper than {max_depth} levels were not looked into"
            listing.stopped = f"{listing.stopped}; {note}" if listing.stopped else note
        return listing


class Listing(dict[str, FileEntry]):
    """The files a walk found, by relative path, and why it did not see everything (if so)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: str | None = None  # "stopped after N entries...", for clients
        self.full = False  # stopped at the entry bound
        self.started_ns = time.time_ns()  # a file changed after this has a later ctime
