"""The handlers of a session's files: its workspace (upload, download, list, delete), its
artifacts and notebook, and the signed public artifact links."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from typing import Any, BinaryIO, cast
from urllib.parse import quote, unquote

from tornado import web
from tornado.http1connection import HTTP1Connection
from tornado.iostream import StreamClosedError

from ..artifacts.local import LocalStore
from ..errors import (
    Forbidden,
    KernelmodeError,
    NotFound,
    PayloadTooLarge,
    StoreError,
)
from ..models import (
    ArtifactList,
    FileDeleted,
)
from .base import BaseHandler

log = logging.getLogger("kernelmode.api")


# Types a browser would render (and run scripts in): always downloaded, never sniffed.
_ACTIVE_TYPES = {"text/html", "image/svg+xml", "application/xhtml+xml", "text/xml", "application/xml"}


class FilesHandler(BaseHandler):
    forward_by = "session"

    async def get(self, session_id: str) -> None:
        self.send(await self.services.sessions.list_files(self.own(session_id)))


class FileHandler(BaseHandler):
    """Uploads stream to a spool file (not memory) under their own size cap."""

    forward_by = "session"
    _spool: Any = None
    _received = 0

    def prepare_body(self) -> None:
        if self.request.method != "PUT":
            return
        cap = self.services.settings.artifacts.max_upload_bytes
        length = int(self.request.headers.get("Content-Length", "0") or 0)
        if length > cap:
            raise PayloadTooLarge(f"the upload is {length} bytes, over this server's limit of {cap}")
        conn = self.request.connection
        if isinstance(conn, HTTP1Connection):
            conn.set_max_body_size(cap + 1)
        self._spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115

    def forward_body_limit(self) -> int | None:
        return self.services.settings.artifacts.max_upload_bytes + 1

    def data_received(self, chunk: bytes) -> Any:
        if self.relay is not None:
            return self.relay.feed(chunk)
        self._received += len(chunk)
        if self._spool is not None and not self.rejected \
                and self._received <= self.services.settings.artifacts.max_upload_bytes:
            self._spool.write(chunk)

    def on_finish(self) -> None:
        if self._spool is not None:
            self._spool.close()

    async def put(self, session_id: str, path: str) -> None:
        cap = self.services.settings.artifacts.max_upload_bytes
        if self._received > cap:
            raise PayloadTooLarge(f"the upload is over this server's limit of {cap} bytes")
        overwrite = self.get_query_argument("overwrite", "false").lower() in ("1", "true", "yes")
        self._spool.seek(0)
        result = await self.services.sessions.upload(self.own(session_id), path, self._spool, self._received,
                                                overwrite)
        self.send(result, 201)

    async def get(self, session_id: str, path: str) -> None:
        # Streamed from the kernel's file agent chunk by chunk (artifacts/channel.py): the
        # manager holds two chunks, never the file. The length is the kernel's announcement;
        # a kernel that then sends more or less fails the transfer (the connection is cut).
        download, mime = await self.services.sessions.open_file(self.own(session_id), path)
        self.set_header("Content-Type", mime)
        self.set_header("Content-Length", str(download.size))
        self.set_header("X-Content-Type-Options", "nosniff")
        name = path.rsplit("/", 1)[-1]
        if mime in _ACTIVE_TYPES:
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name)}")
        chunks = download.chunks()
        try:
            self.write(await anext(chunks, b""))  # errors before the first byte answer as JSON
            async for chunk in chunks:
                self.write(chunk)
                await self.flush()
        except (KernelmodeError, StreamClosedError) as e:
            if not self._headers_written:
                raise
            log.warning("download of %s from session %s failed midway: %s", name, session_id, e)
            self.request.connection.close()  # type: ignore[union-attr]
            return
        finally:
            await chunks.aclose()  # the kernel's side of the transfer is closed too
        self.finish()

    async def delete(self, session_id: str, path: str) -> None:
        self.send(FileDeleted(path=await self.services.sessions.delete_file(self.own(session_id), path)))


class ArtifactsHandler(BaseHandler):
    forward_by = "session"

    async def get(self, session_id: str) -> None:
        self.send(ArtifactList(artifacts=await self.services.sessions.artifacts(self.own(session_id))))


class NotebookHandler(BaseHandler):
    """The session's runs as an .ipynb (console runs included; also after the session is gone)."""

    forward_by = "session"

    async def get(self, session_id: str) -> None:
        # Written run by run to a spool (on disk past 1 MiB), then sent in chunks: a long history
        # with big outputs never sits in memory whole.
        with tempfile.SpooledTemporaryFile(max_size=1 << 20) as spool:
            await asyncio.to_thread(self.services.sessions.notebook, self.own(session_id), cast(BinaryIO, spool))
            self.set_header("Content-Type", "application/x-ipynb+json")
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(session_id)}.ipynb")
            self.set_header("X-Content-Type-Options", "nosniff")
            self.set_header("Content-Length", str(spool.tell()))
            spool.seek(0)
            while chunk := await asyncio.to_thread(spool.read, 1 << 20):
                self.write(chunk)
                await self.flush()
        self.finish()


class PublicArtifactHandler(BaseHandler):
    """Local-store download links: signed and expiring, so they need no bearer token."""

    public = True

    async def get(self, key: str) -> None:
        store = self.services.artifact_store
        if not isinstance(store, LocalStore):
            raise web.HTTPError(404, "artifacts are served by the S3 store's own links")
        key = unquote(key)
        if not store.verify(key, self.get_query_argument("expires", ""), self.get_query_argument("sig", "")):
            raise Forbidden("this download link is invalid or has expired: ask for a fresh one "
                            "(GET /v1/sessions/{id}/artifacts)")
        try:
            data = await store.get(key)
        except StoreError as e:
            raise NotFound(str(e)) from e
        mime = store.content_type(key)
        self.set_header("Content-Type", mime)
        self.set_header("X-Content-Type-Options", "nosniff")
        name = key.rsplit("/", 1)[-1]
        if mime in _ACTIVE_TYPES:
            self.set_header("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name)}")
        self.finish(data)
