"""The iterative tree remover (workspace teardown): a tree 1,500 folders deep, where
shutil.rmtree raises RecursionError on Python 3.11; links are removed, never followed."""

from __future__ import annotations

import os
from pathlib import Path

from kernelmode.artifacts.remove import remove_tree
from kernelmode.artifacts.volume import WorkspaceVolumes


def _deep(root: Path, depth: int) -> None:
    """A chain ``d/d/d...`` with a file at every level, made through fds (past PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(depth):
        os.close(os.open(f"f{level}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)


def test_removes_a_tree_1500_deep(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    _deep(ws, 1500)
    (ws / "side" / "a" / "b").mkdir(parents=True)
    (ws / "side" / "a" / "b" / "x.txt").write_text("x")
    remove_tree(ws)  # if it failed, pytest's own (recursive) clean-up of tmp_path would too
    assert not ws.exists()


def test_links_are_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_text("p")
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "to-dir").symlink_to(outside)
    (ws / "to-file").symlink_to(outside / "keep" / "precious.txt")
    remove_tree(ws)
    assert not ws.exists()
    assert (outside / "keep" / "precious.txt").read_text() == "p"
    link = tmp_path / "top-link"
    link.symlink_to(outside)
    remove_tree(link)  # the path itself a link: the link goes, its target stays
    assert not link.is_symlink() and (outside / "keep" / "precious.txt").exists()


def test_missing_path_is_nothing_to_do(tmp_path: Path) -> None:
    remove_tree(tmp_path / "never-made")


def test_volume_destroy_removes_a_deep_plain_workspace(tmp_path: Path) -> None:
    """With quotas off a workspace is a plain folder: destroy() (and so the start-up sweep and
    session delete) must not raise RecursionError on one made 1,500 deep."""
    volumes = WorkspaceVolumes(tmp_path / "workspaces", "off")
    (tmp_path / "workspaces").mkdir()
    ws = tmp_path / "workspaces" / "k1"
    volumes.create(ws, 16)
    _deep(ws, 1500)
    volumes.destroy(ws)
    assert not ws.exists()
