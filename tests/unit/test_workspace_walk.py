"""The workspace walk (listings, harvests, upload accounting) of the kernel's file agent
(kernel/file_agent.py, run in-process behind a loopback) on a real directory: bounded,
iterative, indifferent to what kernel code does to the tree meanwhile, and safe with names that
are not UTF-8. The end-to-end attacks are in tests/security/test_workspace_abuse.py."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from pathlib import Path, PurePosixPath

import pytest

from kernelmode.artifacts.channel import FileChannel
from kernelmode.artifacts.harvester import Harvester
from kernelmode.artifacts.local import LocalStore
from kernelmode.artifacts.workspace import Listing, shown
from kernelmode.config import ArtifactSettings
from kernelmode.errors import WorkspaceChanged
from kernelmode.kernel import file_agent as agent
from kernelmode.models import RunResult
from tests.file_agent_loopback import Loopback

BAD = b"\xff\xfe-bad.txt"  # not UTF-8


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _deep(root: Path, depth: int, leaf_every: int = 0) -> None:
    """A chain of ``depth`` folders ``d/d/d...``, made through fds (the path is past PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        if leaf_every and level % leaf_every == 0:
            os.close(os.open(f"f{level}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.close(fd)


def _remove_chain(top: Path) -> None:
    """Remove a ``d/d/d...`` chain without recursion (shutil.rmtree, and so pytest's own clean-up
    of tmp_path, recurses per level on Python 3.11): lift the rest of the chain up, level by level."""
    d = top / "d"
    while d.is_dir():
        if (d / "d").is_dir():
            (d / "d").rename(top / "rest")
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
        if (top / "rest").is_dir():
            (top / "rest").rename(d)


def test_lists_regular_singly_linked_files_only(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "sub" / "deeper" / "b.csv").write_text("b,c")
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dirlink").symlink_to(tmp_path / "sub")
    os.link(tmp_path / "sub" / "deeper" / "b.csv", tmp_path / "hard.csv")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / ".upload-0123").write_text("half an upload")
    listing = _scan(tmp_path)
    assert sorted(listing) == ["a.txt"]  # b.csv and hard.csv are one file with two links
    (tmp_path / "hard.csv").unlink()
    listing = _scan(tmp_path)
    assert sorted(listing) == ["a.txt", "sub/deeper/b.csv"]
    assert listing.stopped is None


def test_undecodable_name_is_carried_and_shown_escaped(tmp_path: Path) -> None:
    os.makedirs(os.path.join(os.fsencode(tmp_path), b"dir\xe9"))
    for raw in (BAD, b"dir\xe9/inner\x80.csv"):
        with open(os.path.join(os.fsencode(tmp_path), raw), "wb") as f:
            f.write(b"x")
    listing = _scan(tmp_path)
    assert len(listing) == 2
    infos = {e.info()["path"] for e in listing.values()}
    assert infos == {"/mnt/data/\\xff\\xfe-bad.txt", "/mnt/data/dir\\xe9/inner\\x80.csv"}
    # Everything clients get encodes as JSON and UTF-8, and SQLite stores it.
    text = json.dumps([e.info() for e in listing.values()], default=str)
    text.encode()
    sqlite3.connect(":memory:").execute("select ?", (text,))
    # The carried name still opens the file (the harvest copies it by that name).
    entry = listing[os.fsdecode(BAD)]
    channel, _ = _channel(tmp_path)
    assert asyncio.run(_read(channel, entry.path)) == b"x"
    assert shown("plain-é.txt") == "plain-é.txt"


def test_a_tree_1500_deep_stops_at_the_depth_bound_without_recursion_or_fd_leak(tmp_path: Path) -> None:
    _deep(tmp_path, 1500, leaf_every=10)
    (tmp_path / "top.txt").write_text("t")
    fds = _open_fds()
    try:
        listing = _scan(tmp_path, max_depth=64)
    finally:
        _remove_chain(tmp_path)
    assert _open_fds() <= fds  # none leaked (another test's leftovers may close meanwhile)
    assert "top.txt" in listing
    assert "d/f0" in listing and "/".join(["d"] * 61) + "/f60" in listing
    assert max(p.count("/") for p in listing) <= 64
    assert listing.stopped is not None and "64 levels" in listing.stopped


def test_entries_are_bounded_with_a_note(tmp_path: Path) -> None:
    for i in range(300):
        (tmp_path / f"f{i}").touch()
    listing = _scan(tmp_path, max_entries=100)
    assert len(listing) == 100
    assert listing.stopped is not None and "100 entries" in listing.stopped
    assert _scan(tmp_path, max_entries=1000).stopped is None


def test_walk_survives_a_tree_that_changes_under_it(tmp_path: Path) -> None:
    """A thread swaps names between file, folder, link, link loop and fifo, as fast as it can."""
    stop = threading.Event()
    swaps = 0

    def churn() -> None:
        nonlocal swaps
        kinds = ["file", "dir", "link", "loop", "fifo", "tree"]
        while not stop.is_set():
            for i in range(20):
                p = tmp_path / f"n{i}"
                try:
                    if p.is_dir() and not p.is_symlink():
                        for sub in sorted(p.rglob("*"), reverse=True):
                            sub.rmdir() if sub.is_dir() and not sub.is_symlink() else sub.unlink()
                        p.rmdir()
                    elif p.exists() or p.is_symlink():
                        p.unlink()
                    kind = kinds[(i + swaps) % len(kinds)]
                    if kind == "file":
                        p.write_text("x" * i)
                    elif kind == "dir":
                        p.mkdir()
                    elif kind == "link":
                        p.symlink_to(tmp_path)
                    elif kind == "loop":
                        p.symlink_to(p)
                    elif kind == "fifo":
                        os.mkfifo(p)
                    else:
                        (p / "a" / "b").mkdir(parents=True)
                        (p / "a" / "b" / "c.txt").write_text("c")
                except OSError:
                    pass  # the walk never changes the tree; a race with ourselves is fine
            swaps += 1

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    channel, _ = _channel(tmp_path)
    fds = _open_fds()
    try:
        for _ in range(300):
            listing = asyncio.run(channel.scan())
            for e in listing.values():
                e.info()
    finally:
        stop.set()
        t.join(10)
    assert swaps > 0
    assert _open_fds() <= fds  # none leaked (another test's leftovers may close meanwhile)


def _scan(root: Path, **config: object) -> Listing:
    channel, _ = _channel(root, **config)
    return asyncio.run(channel.scan())


async def _read(channel: FileChannel, rel: str) -> bytes:
    return await (await channel.open_read(rel, 1 << 20)).read_all()


def _harvester(tmp_path: Path) -> tuple[Harvester, LocalStore]:
    store = LocalStore(tmp_path / "store", link_ttl_seconds=60)
    asyncio.run(store.start())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return Harvester(store, ArtifactSettings(), scratch), store


def _result() -> RunResult:
    return RunResult(run_id="r1", session_id="s1", status="ok", stdout="kept")


def _channel(ws_dir: Path, **config: object) -> tuple[FileChannel, Loopback]:
    loop = Loopback(ws_dir, **config)  # the real file agent, in-process (no kernel)
    return FileChannel(loop), loop  # type: ignore[arg-type]


def test_harvest_keeps_an_undecodable_name_under_its_escaped_key(tmp_path: Path) -> None:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    harvester, store = _harvester(tmp_path)
    channel, _ = _channel(ws_dir)
    with open(os.path.join(os.fsencode(ws_dir), BAD), "wb") as f:
        f.write(b"payload")
    result = _result()
    asyncio.run(harvester.harvest("s1", result, channel, None))
    assert [a.path for a in result.artifacts] == ["/mnt/data/\\xff\\xfe-bad.txt"]
    assert result.artifact_error is None
    assert asyncio.run(store.get("s1/r1/\\xff\\xfe-bad.txt")) == b"payload"
    result.model_dump_json().encode()


def test_harvest_never_raises_and_notes_why(tmp_path: Path) -> None:
    harvester, _ = _harvester(tmp_path)
    channel, loop = _channel(tmp_path)
    loop.tamper = lambda data, bufs: ({"x": 1}, [b"{not json"])  # a kernel answering garbage
    result = _result()
    asyncio.run(harvester.harvest("s1", result, channel, None))
    assert result.artifact_error and "could not be read" in result.artifact_error
    assert result.stdout == "kept"


def test_harvest_skips_a_file_that_vanished_after_the_walk(tmp_path: Path) -> None:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    harvester, _ = _harvester(tmp_path)
    channel, _ = _channel(ws_dir)
    (ws_dir / "a.txt").write_text("a")
    (ws_dir / "b.txt").write_text("b")
    note = json.dumps(agent._changes()).encode()  # the post-run note, then the kernel changes things
    for p in ws_dir.iterdir():
        p.unlink()
    (ws_dir / "b.txt").mkdir()
    result = _result()
    asyncio.run(harvester.harvest("s1", result, channel, note))
    assert result.artifacts == [] and result.artifacts_truncated


def test_a_walk_that_stopped_early_does_not_make_old_files_new(tmp_path: Path) -> None:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    for i in range(50):
        (ws_dir / f"old{i}").touch()
    harvester, _ = _harvester(tmp_path)
    channel, _ = _channel(ws_dir, max_entries=10)
    agent._state["max_entries"] = 1000
    (ws_dir / "new.txt").write_text("n")
    result = _result()
    asyncio.run(harvester.harvest("s1", result, channel, None))
    assert [a.path for a in result.artifacts] == ["/mnt/data/new.txt"]


def test_upload_whose_folder_vanishes_meanwhile_is_a_409(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()

    def chunks():  # the kernel removes the folder while the upload is being written
        yield b"first"
        for p in (tmp_path / "d").iterdir():
            p.unlink()
        (tmp_path / "d").rmdir()
        yield b"second"

    channel, _ = _channel(tmp_path)
    with pytest.raises(WorkspaceChanged) as e:
        asyncio.run(channel.write(PurePosixPath("d/f.txt"), chunks(), None, overwrite=False))
    assert e.value.http_status == 409 and "try again" in e.value.message
