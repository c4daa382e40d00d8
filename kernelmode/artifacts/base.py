"""What every artifact store does: keep bytes under a key and hand out download links."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import BinaryIO, Protocol

# Keys of checkpoints (sessions/checkpoints.py): no session id starts with a dot, and no store
# hands out a download link under this prefix (``link`` refuses it, the local store's
# ``verify`` too): what a kernel pickled is never served.
CHECKPOINT_PREFIX = ".checkpoints/"


def linkable(key: str) -> bool:
    """Whether a download link may be made for ``key``."""
    return not key.startswith(CHECKPOINT_PREFIX)


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

    def reader(self, key: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """The object opened for reading, streamed (blocking: use it in a thread); StoreError
        when it is missing or the store is down."""

    async def delete(self, key: str) -> None:
        """Remove the object (no error when it is already gone); StoreError if the store fails."""
