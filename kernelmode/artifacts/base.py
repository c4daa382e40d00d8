"""What every artifact store does: keep bytes under a key and hand out download links."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..errors import KernelmodeError


class StoreError(KernelmodeError):
    """The store could not keep or find an object (outage, refused, missing)."""

    code = "store_error"
    http_status = 502


class ArtifactStore(Protocol):
    name: str

    async def start(self) -> None:
        """Check/prepare the store (create the bucket...); raise StoreError if unusable."""

    async def stop(self) -> None: ...

    async def put_file(self, key: str, path: Path, mime_type: str) -> None:
        """Store a file's bytes under ``key``, atomically: after a failure no partial object is
        visible. Raise StoreError."""

    async def get(self, key: str) -> bytes:
        """The object's bytes; StoreError if missing or the store is down."""

    async def link(self, key: str, base_url: str) -> str:
        """An absolute download URL that works without the API token, valid for the store's
        configured lifetime. ``base_url`` is the manager's public URL (used by the local store)."""

    async def list(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of the objects under ``prefix``."""
