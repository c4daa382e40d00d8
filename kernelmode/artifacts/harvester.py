"""Harvester: after a successful run, keep new or changed workspace files and the run's rich
outputs in the artifact store, and describe them (path, size, type, sha256, link)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from ..config import ArtifactSettings
from ..errors import KernelmodeError
from ..models import Artifact, RunResult
from .base import ArtifactStore, StoreError
from .workspace import FileEntry, Listing, Workspace, mime_type, temp_copy

log = logging.getLogger("kernelmode.artifacts")

# Rich output types kept as files, in order of preference within one display.
OUTPUT_TYPES = {
    "image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/svg+xml": "svg",
    "application/pdf": "pdf", "text/html": "html", "application/json": "json",
}
BINARY_TYPES = {"image/png", "image/jpeg", "image/gif", "application/pdf"}


SESSION_FILES = "session"  # the "run id" under which a session's own files are kept


class Harvester:
    def __init__(self, store: ArtifactStore, settings: ArtifactSettings, scratch: Path) -> None:
        self.store = store
        self.settings = settings
        self.scratch = scratch
        self.public_url = ""

    async def harvest(self, session_id: str, result: RunResult, ws: Workspace,
                      before: dict[str, FileEntry]) -> dict[str, FileEntry]:
        """Walk the workspace after a run and keep in ``result.artifacts`` what it created or
        changed; returns the walk (the next run's ``before``).

        Never raises: whatever goes wrong (the store, a workspace kernel code is changing or
        made unreadable) is said in ``result.artifact_error`` and the run itself stands."""
        try:
            after = await asyncio.to_thread(ws.scan)
        except Exception as e:  # noqa: BLE001 (the run's result must survive anything here)
            log.exception("session %s run %s: the workspace walk failed", session_id, result.run_id)
            result.artifact_error = f"the workspace could not be read, no files were kept ({type(e).__name__})"
            return before
        notes = []
        if after.stopped:
            result.artifacts_truncated = True
            notes.append(f"the workspace walk {after.stopped}")
        try:
            await self._keep(session_id, result, ws, self._changed(before, after))
        except StoreError as e:
            notes.append(f"the artifact store failed, some files were not kept: {e}")
            log.warning("session %s run %s: %s", session_id, result.run_id, e)
        except Exception as e:  # noqa: BLE001
            log.exception("session %s run %s: harvest failed", session_id, result.run_id)
            notes.append(f"keeping the run's files failed, some were not kept ({type(e).__name__})")
        if notes:
            result.artifact_error = "; ".join(notes)
        return after

    @staticmethod
    def _changed(before: dict[str, FileEntry], after: dict[str, FileEntry]) -> list[FileEntry]:
        """Files new or changed since ``before``. When that walk stopped early, a path it did not
        see counts as new only if changed since it began (else it was merely not looked at)."""
        since = before.started_ns if isinstance(before, Listing) and before.stopped else None
        out = []
        for rel, e in sorted(after.items()):
            b = before.get(rel)
            if b is None:
                if since is None or e.ctime_ns >= since:
                    out.append(e)
            elif (b.size, b.mtime_ns, b.inode) != (e.size, e.mtime_ns, e.inode):
                out.append(e)
        return out

    async def _keep(self, session_id: str, result: RunResult, ws: Workspace, changed: list[FileEntry]) -> None:
        budget = self.settings.max_artifacts_per_run
        for entry in changed:
            if len(result.artifacts) >= budget:
                result.artifacts_truncated = True
                break
            await self._keep_file(session_id, result, ws, entry)
        for i, output in enumerate(result.outputs):
            if len(result.artifacts) >= budget:
                result.artifacts_truncated = True
                break
            await self._keep_output(session_id, result, i, output)

    async def _keep_file(self, session_id: str, result: RunResult, ws: Workspace, entry: FileEntry) -> None:
        if entry.size > self.settings.max_artifact_bytes:
            result.artifacts_truncated = True
            return
        try:
            tmp, size, sha = await asyncio.to_thread(
                temp_copy, ws, PurePosixPath(entry.path), self.scratch, self.settings.max_artifact_bytes)
        except (KernelmodeError, OSError):  # gone, replaced (link, folder, fifo), unreadable, grew past the cap
            result.artifacts_truncated = True
            return
        try:
            # Stored and shown under its escaped name: store keys and JSON take no lone surrogates.
            rel = entry.shown_path
            await self._put(session_id, result, f"/mnt/data/{rel}", rel, tmp, size, sha)
        finally:
            tmp.unlink(missing_ok=True)  # noqa: ASYNC240 (a local temp file)

    async def _keep_output(self, session_id: str, result: RunResult, index: int, output: dict[str, Any]) -> None:
        data = output.get("data", {})
        mime = next((m for m in OUTPUT_TYPES if m in data), None)
        if mime is None:
            return
        if output.get("type") == "execute_result" and not mime.startswith("image/"):
            return  # the repr of the last value (a DataFrame's HTML...) is the result, not a file
        value = data[mime]
        if mime in BINARY_TYPES:
            raw = base64.b64decode(value) if isinstance(value, str) else b""
        elif isinstance(value, str):
            raw = value.encode()
        else:
            raw = json.dumps(value).encode()
        name = f"output-{index + 1}.{OUTPUT_TYPES[mime]}"
        with tempfile.NamedTemporaryFile(dir=self.scratch, delete=False) as f:
            f.write(raw)
        tmp = Path(f.name)
        try:
            await self._put(session_id, result, f"outputs/{name}", f"outputs/{name}", tmp, len(raw),
                            hashlib.sha256(raw).hexdigest(), mime)
        finally:
            tmp.unlink(missing_ok=True)  # noqa: ASYNC240

    async def _put(self, session_id: str, result: RunResult, shown: str, rel: str, tmp: Path,
                   size: int, sha: str, mime: str | None = None) -> None:
        key = f"{session_id}/{result.run_id}/{rel}"
        mime = mime or mime_type(rel)
        await self.store.put_file(key, tmp, mime)
        result.artifacts.append(Artifact(
            path=shown, name=PurePosixPath(rel).name, size_bytes=size, mime_type=mime, sha256=sha,
            download_url=await self.store.link(key, self.public_url),
        ))

    async def keep_session_file(self, session_id: str, name: str, data: bytes, mime: str) -> Artifact:
        """Keep a file of the session itself (its notebook), listed with the runs' artifacts."""
        artifact = Artifact(path=name, name=name, size_bytes=len(data), mime_type=mime,
                            sha256=hashlib.sha256(data).hexdigest(), download_url="")
        key = self._key(session_id, SESSION_FILES, artifact)
        fd, tmp = tempfile.mkstemp(dir=self.scratch)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            await self.store.put_file(key, Path(tmp), mime)
        finally:
            Path(tmp).unlink(missing_ok=True)  # noqa: ASYNC240
        return artifact.model_copy(update={"download_url": await self.store.link(key, self.public_url)})

    @staticmethod
    def _key(session_id: str, run_id: str, artifact: Artifact) -> str:
        return f"{session_id}/{run_id}/{artifact.path.removeprefix('/mnt/data/')}"

    async def relink(self, session_id: str, run_id: str, artifact: Artifact) -> Artifact:
        """The same artifact with a fresh download link (links expire; objects stay)."""
        key = self._key(session_id, run_id, artifact)
        return artifact.model_copy(update={"download_url": await self.store.link(key, self.public_url)})

    async def fetch(self, session_id: str, run_id: str, artifact: Artifact) -> bytes:
        """The stored bytes of an artifact (StoreError if the store lost it or is down)."""
        return await self.store.get(self._key(session_id, run_id, artifact))
