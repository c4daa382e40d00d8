"""The embedded artifact store: files under the data dir, served by the manager at links signed
with HMAC and an expiry (capability URLs: they work without the API token)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from ..errors import StoreError
from .base import CHECKPOINT_PREFIX, linkable


class LocalStore:
    name = "local"

    def __init__(self, root: Path, link_ttl_seconds: int) -> None:
        self.root = root
        self.link_ttl_seconds = link_ttl_seconds
        self._key = b""

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_file = self.root.parent / "artifacts.key"  # kept, so links survive a restart
        if not key_file.exists():
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self._key = bytes.fromhex(key_file.read_text().strip())

    async def stop(self) -> None:
        pass

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if os.path.commonpath([path, self.root.resolve()]) != str(self.root.resolve()):
            raise StoreError(f"bad artifact key {key!r}")
        return path

    async def put_file(self, key: str, path: Path, mime_type: str) -> None:
        dest = self._path(key)

        def copy() -> None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
            try:
                shutil.copyfile(path, tmp)
                os.replace(tmp, dest)  # atomic: the object appears whole or not at all
            finally:
                tmp.unlink(missing_ok=True)
            (dest.parent / f".{dest.name}.type").write_text(mime_type)

        try:
            await asyncio.to_thread(copy)
        except OSError as e:
            raise StoreError(f"local artifact store: cannot write {key}: {e.strerror}") from e

    async def get(self, key: str) -> bytes:
        try:
            return await asyncio.to_thread(self._path(key).read_bytes)
        except OSError as e:
            raise StoreError(f"no artifact {key}") from e

    @contextlib.contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise StoreError(f"no artifact {key}") from e
        with f:
            yield f

    def content_type(self, key: str) -> str:
        path = self._path(key)
        try:
            return (path.parent / f".{path.name}.type").read_text()
        except OSError:
            return "application/octet-stream"

    async def list(self, prefix: str) -> list[tuple[str, int]]:
        base = self._path(prefix) if prefix else self.root
        out = []
        for p in sorted(base.rglob("*")) if base.is_dir() else []:
            if p.is_file() and not p.name.startswith("."):
                out.append((str(p.relative_to(self.root)), p.stat().st_size))
        return out

    # -- signed links ------------------------------------------------------------------------------
    def _sign(self, key: str, expires: int) -> str:
        return hmac.new(self._key, f"{key}\n{expires}".encode(), hashlib.sha256).hexdigest()

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(path.unlink, True)
            await asyncio.to_thread((path.parent / f".{path.name}.type").unlink, True)
        except OSError as e:
            raise StoreError(f"local artifact store: cannot delete {key}: {e.strerror}") from e
        if key.startswith(CHECKPOINT_PREFIX) and path.parent != self.root / CHECKPOINT_PREFIX.rstrip("/"):
            # A checkpoint's folder (its id: never written again) goes with its last object.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(path.parent.rmdir)

    async def link(self, key: str, base_url: str) -> str:
        if not linkable(key):
            raise StoreError(f"no download link for {key!r}")
        expires = int(time.time()) + self.link_ttl_seconds
        return f"{base_url.rstrip('/')}/v1/artifacts/{quote(key)}?expires={expires}&sig={self._sign(key, expires)}"

    def verify(self, key: str, expires: str, sig: str) -> bool:
        """True when the link is genuine and unexpired (constant-time comparison)."""
        if not linkable(key):
            return False
        try:
            exp = int(expires)
        except ValueError:
            return False
        # As bytes: compare_digest refuses str with non-ASCII characters (a fuzzed link).
        return hmac.compare_digest(self._sign(key, exp).encode(), sig.encode()) and exp >= time.time()
