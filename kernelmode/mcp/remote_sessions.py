"""What the MCP tools do to a session, done on the manager that owns it (remote.py says why):
the methods of ``SessionManager`` the tools use, each the REST call a client would make, with
the same models back, so that each tool's answer is written by the same code as for a local
session. Errors come back as the owner raised them (``Owner.call``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import quote

from ..models import (
    CheckpointInfo,
    FileList,
    PackagesResult,
    SessionCreate,
    SessionInfo,
    UploadResult,
)
from ..tenants import Principal
from .remote import Owner, wire_error

if TYPE_CHECKING:  # imported where used (remote.py says why)
    import httpx


class RemoteChunks:
    """A workspace file's bytes as the owner streams them; ``aclose`` ends the request (and
    frees its forwarding slot) whether or not it was read."""

    def __init__(self, response: httpx.Response, release: Callable[[], None]) -> None:
        self._response = response
        self._release: Callable[[], None] | None = release
        self._it = response.aiter_bytes()

    def __aiter__(self) -> RemoteChunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            try:
                await self._response.aclose()
            finally:
                release()


class RemoteDownload:
    """``Download`` (its ``size`` and ``chunks()``) of a file on the owner."""

    def __init__(self, size: int, chunks: RemoteChunks) -> None:
        self.size = size
        self._chunks = chunks

    def chunks(self) -> RemoteChunks:
        return self._chunks


class OwnerSessions:
    """The session methods the MCP tools call, on the session's owner."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner

    def _files(self, session_id: str, path: str = "") -> str:
        return f"/v1/sessions/{session_id}/files" + (f"/{quote(path)}" if path else "")

    async def upload(self, session_id: str, path: str, body: BinaryIO, size: int, overwrite: bool) -> UploadResult:
        return UploadResult.model_validate(await self.owner.call(
            "PUT", self._files(session_id, path), content=body.read(size),
            params={"overwrite": "true" if overwrite else "false"}))

    async def list_files(self, session_id: str) -> FileList:
        return FileList.model_validate(await self.owner.call("GET", self._files(session_id)))

    async def interrupt(self, session_id: str) -> SessionInfo:
        return SessionInfo.model_validate(await self.owner.call("POST", f"/v1/sessions/{session_id}/interrupt"))

    async def delete(self, session_id: str) -> None:
        await self.owner.call("DELETE", f"/v1/sessions/{session_id}")

    async def install_packages(self, session_id: str, packages: list[str], _source: str = "mcp") -> PackagesResult:
        return PackagesResult.model_validate(await self.owner.call(
            "POST", f"/v1/sessions/{session_id}/packages", json={"packages": packages}))

    async def checkpoint(self, session_id: str) -> CheckpointInfo:
        return CheckpointInfo.model_validate(await self.owner.call("POST", f"/v1/sessions/{session_id}/checkpoint"))

    async def create(self, req: SessionCreate, _principal: Principal) -> SessionInfo:
        """A fork of a session the owner holds (made there: its live kernel is checkpointed);
        the caller's tenant is the owner's reading of the token."""
        return SessionInfo.model_validate(await self.owner.call(
            "POST", "/v1/sessions", json=req.model_dump(mode="json", exclude_none=True)))

    async def open_file(self, session_id: str, path: str) -> tuple[RemoteDownload, str]:
        """(download, mime type) of a workspace file on the owner, streamed as it is read."""
        import httpx

        owner = self.owner
        forwarder = owner.router.forwarder
        forwarder.take()
        try:
            request = forwarder.client.build_request("GET", owner.base_url + self._files(session_id, path),
                                                     headers=owner.headers)
            try:
                response = await forwarder.client.send(request, stream=True)
            except httpx.HTTPError as e:
                raise owner.router.gone(owner.base_url, e) from e
        except BaseException:
            forwarder.give()
            raise
        chunks = RemoteChunks(response, forwarder.give)
        if response.status_code >= 400:
            try:
                await response.aread()
            finally:
                await chunks.aclose()
            raise wire_error(response)
        mime = response.headers.get("Content-Type", "application/octet-stream").split(";")[0].strip()
        return RemoteDownload(int(response.headers.get("Content-Length", "0") or 0), chunks), mime
