"""What checkpoints need of both artifact stores (real S3 API: moto; the local store): stored
from a /proc/self/fd path, streamed back, deleted, and never given a download link."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernelmode.artifacts.base import CHECKPOINT_PREFIX, ArtifactStore
from kernelmode.artifacts.local import LocalStore
from kernelmode.artifacts.s3 import S3Store
from kernelmode.errors import StoreError


@pytest.fixture(params=["local", "s3"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ArtifactStore]:
    store: ArtifactStore
    if request.param == "s3":
        store = S3Store(request.getfixturevalue("s3_settings"))
    else:
        store = LocalStore(tmp_path / "artifacts", 60)
    await store.start()
    yield store
    await store.stop()


async def test_checkpoint_objects_round_trip_and_are_never_linked(any_store: ArtifactStore, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "blob"
    src.write_bytes(data)
    key = f"{CHECKPOINT_PREFIX}{'a' * 32}/namespace.kmck"
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        await any_store.put_file(key, Path(f"/proc/self/fd/{fd}"), "application/octet-stream")
    finally:
        os.close(fd)
    with any_store.reader(key) as f:
        assert b"".join(iter(lambda: f.read(1 << 20), b"")) == data
    with pytest.raises(StoreError):
        await any_store.link(key, "http://127.0.0.1:1")
    await any_store.delete(key)
    await any_store.delete(key)  # gone already: fine
    assert [k for k, _ in await any_store.list(CHECKPOINT_PREFIX)] == []
    if isinstance(any_store, LocalStore):  # nor an empty folder left behind
        assert list((tmp_path / "artifacts" / CHECKPOINT_PREFIX).iterdir()) == []
    with pytest.raises(StoreError), any_store.reader(key):
        pass


async def test_ordinary_keys_still_link(any_store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("x")
    await any_store.put_file("sess/run/a.txt", src, "text/plain")
    assert (await any_store.link("sess/run/a.txt", "http://127.0.0.1:1")).startswith("http")


