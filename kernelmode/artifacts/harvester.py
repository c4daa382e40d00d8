"""Harvester: after a successful run, keep new or changed workspace files and the run's rich
outputs in the artifact store, and describe them (path, size, type, sha256, link)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from ..config import ArtifactSettings
from ..errors import (
    FileNotFound,
    FileTransferFailed,
    KernelmodeError,
    KernelUnavailable,
    PayloadTooLarge,
    StoreError,
    WorkspaceChanged,
)
from ..models import Artifact, RunResult
from .base import ArtifactStore
from .channel import FileChannel, changes_buffer, receive_file
from .workspace import FileEntry, mime_type

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

    async def harvest(self, session_id: str, result: RunResult, channel: FileChannel | None,
                      note: bytes | None) -> None:
        """Keep in ``result.artifacts`` the files the run created or changed and its rich outputs.

        ``note``: the kernel's own list of changed files, carried by the run's execute_reply
        (kernel/file_agent.py's post-run note); without it the kernel is asked (one round trip).
        Only those files are then read, through the kernel's channels.

        Never raises: whatever goes wrong (the store, the kernel's answers) is said in
        ``result.artifact_error`` and the run itself stands."""
        budget = self.settings.max_artifacts_per_run
        notes = []
        changed: list[FileEntry] = []
        try:
            if channel is None:
                raise KernelUnavailable("the kernel is not connected")
            changes = changes_buffer(note, budget + 1) if note is not None else await channel.changes(budget + 1)
            changed = changes.files
            if changes.truncated:
                result.artifacts_truncated = True
            if changes.stopped:
                result.artifacts_truncated = True
                notes.append(f"the workspace walk {changes.stopped}")
        except KernelmodeError as e:
            log.warning("session %s run %s: the changed files could not be listed: %s", session_id, result.run_id, e)
            notes.append(f"the workspace could not be read, no files were kept ({e.code}: {e.message})")
        try:
            await self._keep(session_id, result, channel, changed)
        except StoreError as e:
            notes.append(f"the artifact store failed, some files were not kept: {e}")
            log.warning("session %s run %s: %s", session_id, result.run_id, e)
        except Exception as e:  # noqa: BLE001
            log.exception("session %s run %s: harvest failed", session_id, result.run_id)
            notes.append(f"keeping the run's files failed, some were not kept ({type(e).__name__})")
        if notes:
            result.artifact_error = "; ".join(notes)

    async def _keep(self, session_id: str, result: RunResult, channel: FileChannel | None,
                    changed: list[FileEntry]) -> None:
        budget = self.settings.max_artifacts_per_run
        for entry in changed:
            if len(result.artifacts) >= budget:
                result.artifacts_truncated = True
                break
            if channel is not None:
                await self._keep_file(session_id, result, channel, entry)
        for i, output in enumerate(result.outputs):
            if len(result.artifacts) >= budget:
                result.artifacts_truncated = True
                break
            await self._keep_output(session_id, result, i, output)

    async def _keep_file(self, session_id: str, result: RunResult, channel: FileChannel, entry: FileEntry) -> None:
        if entry.size > self.settings.max_artifact_bytes:
            result.artifacts_truncated = True
            return
        try:
            tmp, size, sha = await receive_file(channel, entry.path, self.settings.max_artifact_bytes, self.scratch)
        except (FileNotFound, PayloadTooLarge, WorkspaceChanged, FileTransferFailed, OSError):
            # gone, replaced (link, folder), grew past the cap, changed while read: the others go on
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
