"""The workspace part of a checkpoint (sessions/checkpoints.py ``_archive``) when the kernel
changes a file while it is being tarred: a clear CheckpointFailed (a 409), never a bare OSError
(a 500 from POST /v1/sessions/{id}/checkpoint, a traceback in hibernation)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from kernelmode.artifacts.workspace import Workspace
from kernelmode.sessions.checkpoints import CheckpointFailed, _archive


class ShrinkingWorkspace(Workspace):
    """A kernel that truncates a file between the manager's open (and fstat) and its read, as
    ``open(path, "w")`` in a kernel thread does."""

    def open_file(self, rel: PurePosixPath) -> tuple[int, os.stat_result]:
        fd, st = super().open_file(rel)
        os.truncate(self.root / rel, 10)
        return fd, st


def test_a_file_that_shrinks_while_archived_fails_the_checkpoint_cleanly(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    ws_root.mkdir()
    (ws_root / "status.json").write_bytes(b"x" * 100_000)
    dest = tmp_path / "checkpoint.tar"
    with pytest.raises(CheckpointFailed, match="status.json"):
        _archive(ShrinkingWorkspace(ws_root), dest)
    assert not dest.exists()  # no half-written tar left in the scratch dir


def test_archive_keeps_regular_files(tmp_path: Path) -> None:
    ws_root = tmp_path / "ws"
    (ws_root / "sub").mkdir(parents=True)
    (ws_root / "sub" / "a.txt").write_bytes(b"hello")
    dest = tmp_path / "checkpoint.tar"
    assert _archive(Workspace(ws_root), dest)[0] == 1
    with tarfile.open(dest) as tar:
        member = tar.extractfile("sub/a.txt")
        assert member is not None and member.read() == b"hello"
