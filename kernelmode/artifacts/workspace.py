"""A session's workspace (``/mnt/data`` in its kernel) as the manager sees it on the host.

Kernel code controls everything in here, so nothing is trusted: paths are validated as text,
then every component is opened without following links (``O_NOFOLLOW`` on each directory
from the workspace root down), and a file with more than one hard link is never served (a
kernel could link a file of its own directory, like its connection file, into the workspace).
"""

from __future__ import annotations

import contextlib
import errno
import mimetypes
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from ..errors import Conflict, NotFound, PayloadTooLarge, ValidationError
from ..sandbox.spec import WORKSPACE_MOUNT

MAX_PATH_LENGTH = 1024
NAME_MAX = 255  # bytes in one path component (Linux file systems)


class FileNotFound(NotFound):
    code = "file_not_found"


class FileExists(Conflict):
    code = "file_exists"


class WorkspaceFull(PayloadTooLarge):
    code = "workspace_full"


def mime_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


def clean_path(rel: str) -> PurePosixPath:
    """Validate a workspace-relative path given by a client: relative, no '..', no NUL, no '\\'."""
    if rel.startswith(WORKSPACE_MOUNT + "/"):
        rel = rel[len(WORKSPACE_MOUNT) + 1 :]
    if not rel or len(rel) > MAX_PATH_LENGTH:
        raise ValidationError("the file path is empty or too long")
    if "\x00" in rel or "\\" in rel:
        raise ValidationError("the file path may not contain NUL or backslashes")
    if rel.startswith("/"):
        raise ValidationError("the file path must be relative to /mnt/data")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValidationError("the file path may not contain '..', '.' or empty parts")
    try:
        too_long = any(len(p.encode()) > NAME_MAX for p in parts)
    except UnicodeEncodeError as e:  # a lone surrogate (JSON "\ud800"): no file system name
        raise ValidationError("the file path is not valid Unicode") from e
    if too_long:  # the file system would refuse it (ENAMETOOLONG)
        raise ValidationError(f"a file or folder name in the path is longer than {NAME_MAX} bytes")
    return PurePosixPath(*parts)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the workspace
    size: int
    mtime_ns: int
    inode: int

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    def info(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": f"{WORKSPACE_MOUNT}/{self.path}",
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
        finally:
            os.close(dfd)
        return f"{WORKSPACE_MOUNT}/{rel}"

    # -- listing ---------------------------------------------------------------------------------------
    def scan(self, limit: int = 100_000) -> dict[str, FileEntry]:
        """Regular, singly-linked files (no links followed), by relative path."""
        out: dict[str, FileEntry] = {}

        def walk(dfd: int, prefix: str) -> None:
            with os.scandir(dfd) as it:
                for entry in it:
                    if len(out) >= limit:
                        return
                    if entry.name.startswith(".upload-"):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    rel = f"{prefix}{entry.name}"
                    if stat.S_ISDIR(st.st_mode):
                        try:
                            sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                        except OSError:
                            continue
                        try:
                            walk(sub, rel + "/")
                        finally:
                            os.close(sub)
                    elif stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                        out[rel] = FileEntry(rel, st.st_size, st.st_mtime_ns, st.st_ino)

        try:
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return out
        try:
            walk(root, "")
        finally:
            os.close(root)
        return out

    def usage(self) -> tuple[int, int]:
        files = self.scan()
        return sum(f.size for f in files.values()), len(files)


def temp_copy(ws: Workspace, rel: PurePosixPath, dest_dir: Path, max_bytes: int) -> tuple[Path, int, str]:
    """Copy a workspace file (safely opened) to a private temp file: (path, size, sha256).

    Stores then read the copy, so a kernel changing the file meanwhile cannot swap what is
    stored for what was checked."""
    import hashlib

    fd, st = ws.open_file(rel)
    if st.st_size > max_bytes:
        os.close(fd)
        raise PayloadTooLarge(f"{WORKSPACE_MOUNT}/{rel} is {st.st_size} bytes, over {max_bytes}")
    h = hashlib.sha256()
    size = 0
    out = tempfile.NamedTemporaryFile(dir=dest_dir, delete=False)  # noqa: SIM115
    try:
        with os.fdopen(fd, "rb") as src, out:
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"{WORKSPACE_MOUNT}/{rel} grew over {max_bytes} bytes")
                h.update(chunk)
                out.write(chunk)
    except BaseException:
        Path(out.name).unlink(missing_ok=True)
        raise
    return Path(out.name), size, h.hexdigest()
