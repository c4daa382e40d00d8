"""A session's files: its workspace (uploads, listings, downloads), the artifacts its runs left
in the store, and its history as a notebook (also after the session was deleted). Workspace files
travel through the kernel's channels, so ``ready`` readies a session's kernel first."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import BinaryIO

from ..artifacts.channel import CHUNK, Download, FileChannel
from ..artifacts.harvester import SESSION_FILES, Harvester
from ..artifacts.workspace import clean_path, mime_type
from ..config import Settings
from ..errors import KernelUnavailable, SessionNotFound, StoreError
from ..models import Artifact, FileList, SessionInfo, UploadResult, WorkspaceFile
from .live import LiveSession, now
from .store import SessionStore

DOWNLOAD_MAX_BYTES = 1 << 40


class SessionFiles:
    """``live(session_id)``: the live session, or None (deleted, lost or unknown); ``wake``: the
    live session, woken if it hibernates (SessionNotFound, KernelUnavailable when lost);
    ``reseed``: a remote kernel's files back from its latest checkpoint."""

    def __init__(self, settings: Settings, store: SessionStore, harvester: Harvester | None,
                 live: Callable[[str], LiveSession | None], wake: Callable[[str], LiveSession],
                 reseed: Callable[[LiveSession], Awaitable[None]]) -> None:
        self.settings = settings
        self.store = store
        self.harvester = harvester
        self.live = live
        self.wake = wake
        self.reseed = reseed

    async def ready(self, session_id: str) -> LiveSession:
        """The live session with its kernel's file agent reachable: a kernel that is not ready
        (restarted, woken) is readied first."""
        s = self.wake(session_id)
        k = s.kernel
        if k.conn is not None and k.conn.is_open and not k.needs_ready and k.tools_installed is not None:
            return s
        async with s.lock:
            if await k.ensure_ready():
                self.store.save(s.info, s.kernel_id, s.workspace)
            await k.install_preamble(k.env.start_timeout)
            await self.reseed(s)
        return s

    def _channel(self, s: LiveSession) -> FileChannel:
        return FileChannel(s.conn, self.settings.sessions.files_timeout_seconds)

    # -- workspace (through the kernel's file agent: artifacts/channel.py) ------------------------
    async def upload(self, s: LiveSession, path: str, body: BinaryIO, size: int, overwrite: bool) -> UploadResult:
        """Write ``size`` bytes read from ``body`` to the workspace (atomically, in the kernel)."""
        rel = clean_path(path)
        quota = {"bytes": s.info.limits.disk_mb * 1024 * 1024, "mb": s.info.limits.disk_mb,
                 "files": self.settings.sessions.max_workspace_files}

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await asyncio.to_thread(body.read, CHUNK):
                yield chunk

        # An upload is an input, not something a run made: the agent keeps it out of the next
        # run's changes.
        shown, _ = await self._channel(s).write(rel, chunks(), size, overwrite, quota)
        return UploadResult(path=shown, size_bytes=size)

    async def list_files(self, s: LiveSession) -> FileList:
        """The workspace's files, as far as its bounded walk got (``note`` says where it stopped)."""
        files = await self._channel(s).scan()
        return FileList(files=[WorkspaceFile.model_validate(e.info()) for _, e in sorted(files.items())],
                        truncated=files.stopped is not None, note=files.stopped)

    async def open_file(self, s: LiveSession, path: str, max_bytes: int | None = None) -> tuple[Download, str]:
        """(download, mime type) of a workspace file: ``download.size``, then its ``chunks()``."""
        rel = clean_path(path)
        # Streamed (two chunks in memory at most): the cap is a sanity bound, not a memory one.
        download = await self._channel(s).open_read(rel, DOWNLOAD_MAX_BYTES if max_bytes is None else max_bytes)
        return download, mime_type(rel.name)

    async def delete_file(self, s: LiveSession, path: str) -> str:
        """Remove a file from the workspace; its path in the kernel."""
        rel = clean_path(path)
        return await self._channel(s).delete(rel)

    # -- artifacts -----------------------------------------------------------------------------------
    async def artifacts(self, session_id: str) -> list[Artifact]:
        """Artifacts of the session's runs (also after the session was deleted), fresh links."""
        if self.harvester is None:
            return []
        runs = self.store.runs(session_id)
        if not runs and self.live(session_id) is None and self.store.get(session_id) is None:
            raise SessionNotFound(f"no session {session_id!r}")
        kept = [await self.harvester.relink(session_id, r.run_id, a) for _, r in runs for a in r.artifacts]
        return kept + [await self.harvester.relink(session_id, SESSION_FILES, a)
                       for a in self.store.session_files(session_id)]

    async def find_artifact(self, session_id: str, ref: str) -> tuple[str, Artifact] | None:
        """(run id, artifact with a fresh link) of the latest artifact whose path is ``ref``."""
        if self.harvester is None:
            return None
        rel = ref.removeprefix("/mnt/data/").lstrip("/")
        for _, r in reversed(self.store.runs(session_id)):
            for a in r.artifacts:
                if a.path == ref or a.path.removeprefix("/mnt/data/") == rel:
                    return r.run_id, await self.harvester.relink(session_id, r.run_id, a)
        for a in reversed(self.store.session_files(session_id)):
            if a.path == rel:
                return SESSION_FILES, await self.harvester.relink(session_id, SESSION_FILES, a)
        return None

    async def artifact_bytes(self, session_id: str, run_id: str, artifact: Artifact) -> bytes:
        assert self.harvester is not None
        return await self.harvester.fetch(session_id, run_id, artifact)

    # -- notebook ------------------------------------------------------------------------------------
    def notebook(self, session_id: str, out: BinaryIO) -> None:
        """Write the session's runs as an .ipynb to ``out`` (also after the session was deleted),
        one run at a time from the store: memory holds one run's output, not the history's."""
        runs = self.store.run_count(session_id)
        live = self.live(session_id)
        info: SessionInfo | None = live.info if live is not None else self.store.get(session_id)
        if info is None and not runs:
            raise SessionNotFound(f"no session {session_id!r}")
        # Imported here: nbformat's jsonschema costs seconds of start-up otherwise (embedded MCP).
        from .. import notebook

        notebook.write_notebook(out, session_id, info, self.store.history_iter(session_id), runs)

    async def keep_notebook(self, session_id: str, name: str) -> Artifact:
        """Store the notebook as it is now among the session's artifacts."""
        assert self.harvester is not None
        with tempfile.TemporaryFile(dir=self.harvester.scratch) as f:
            await asyncio.to_thread(self.notebook, session_id, f)
            f.seek(0)
            data = await asyncio.to_thread(f.read)
        from ..notebook import MIME

        artifact = await self.harvester.keep_session_file(session_id, name, data, MIME)
        self.store.add_session_file(session_id, artifact)
        return artifact

    async def export_notebook(self, session_id: str) -> Artifact:
        """Keep the session's notebook as it is now among its artifacts, with a download link."""
        if self.harvester is None:
            raise KernelUnavailable("this server keeps no artifacts")
        stamp = now().strftime("%Y%m%d-%H%M%S")
        try:
            return await self.keep_notebook(session_id, f"notebook-{stamp}.ipynb")
        except StoreError as e:
            raise KernelUnavailable(f"the artifact store failed: {e}") from e
