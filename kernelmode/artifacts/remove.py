"""Remove a directory tree iteratively, through file descriptors, never following a link.

``shutil.rmtree`` recurses once per level on Python 3.11, so a workspace that kernel code made
1,500 folders deep raises RecursionError there. Here only two directories are open at any time:
the top, and one of its children, whose sub-folders are moved up into the top (under fresh
names) before it is removed; the tree flattens until nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _clear(dir_fd: int) -> list[str]:
    """Unlink every non-directory in the open directory; the names of its sub-directories."""
    folders = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            try:
                is_dir = stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode)
            except OSError:
                continue  # gone meanwhile
            if is_dir:
                folders.append(entry.name)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=dir_fd)
    return folders


def remove_tree(path: Path) -> None:
    """Remove ``path`` and all under it, as far as possible (errors are skipped, like
    ``shutil.rmtree(ignore_errors=True)``); a link is removed, never followed."""
    try:
        top = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError:  # a link or a file, not a folder
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    stuck: set[str] = set()  # folders that could not be emptied or removed: left in place
    try:
        while folders := [name for name in _clear(top) if name not in stuck]:
            for name in folders:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=top)
                except OSError:
                    stuck.add(name)
                    continue
                try:
                    for inner in _clear(fd):
                        with contextlib.suppress(OSError):  # left: the rmdir below fails
                            os.rename(inner, f".rm-{uuid.uuid4().hex}", src_dir_fd=fd, dst_dir_fd=top)
                finally:
                    os.close(fd)
                try:
                    os.rmdir(name, dir_fd=top)
                except OSError:
                    stuck.add(name)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)
