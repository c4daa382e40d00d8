"""``AsyncClient`` and ``AsyncSession``: the asynchronous I/O surface over the shared route table.

The same methods as ``Client`` / ``Session`` (``_sync.py``) with the same parameters, awaitable
(tests/unit/test_client_parity.py holds the two to it). An httpx AsyncClient belongs to one
event loop: make one per loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, TypeVar

import httpx

from .. import errors
from ..models import (
    ApprovalAnswer,
    Artifact,
    CheckpointInfo,
    FileDeleted,
    Health,
    PackagesResult,
    RunProgress,
    RunResult,
    SessionInfo,
    SessionList,
    UploadResult,
    WorkspaceFile,
)
from ..tools.base import ToolInfo, ToolMatch
from . import _routes as routes
from ._base import BaseClient, BaseSession, final
from ._routes import Call, UploadData

T = TypeVar("T")
OnEvent = Callable[[dict[str, Any]], None]


class AsyncClient(BaseClient):
    """Asynchronous client: the methods of ``Client``, awaitable. ``async with``, or ``aclose()``."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 retries: int = 2, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``url`` defaults to $KERNELMODE_URL, else http://127.0.0.1:8888; ``token`` to
        $KERNELMODE_TOKEN."""
        super().__init__(url, token, timeout, retries)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self._headers(), transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _send(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            r: httpx.Response | None = None
            exc: Exception | None = None
            try:
                r = await self._http.request(call.route.method, call.path, json=call.json,
                                             params=call.params, content=call.content,
                                             headers=call.headers, timeout=self._timeout(call))
            except httpx.TransportError as e:
                exc = e
            if not self._should_retry(call, attempt, r, exc):
                if exc is not None:
                    raise self._unreachable(self.url, exc) from exc
                assert r is not None
                return self._finish(call, r)
            await asyncio.sleep(self._backoff(attempt, r))
            attempt += 1

    # -- sessions ----------------------------------------------------------------------------------
    async def create_session(self, session_id: str | None = None, *, ttl_seconds: int | None = None,
                             limits: dict[str, int] | None = None, tools: list[str] | None = None,
                             packages: list[str] | None = None,
                             egress: dict[str, Any] | None = None) -> AsyncSession:
        """A new session; use it as a context manager to delete it at the end of the block.
        ``packages``: installed before its first run (see ``install_packages``). ``egress``: narrow
        the tenant's egress, e.g. ``{"allow": ["api.github.com"]}`` (a wider one: EgressRefused)."""
        return AsyncSession(self, await self._send(routes.create_session(session_id, ttl_seconds, limits,
                                                                         tools, packages, egress=egress)))

    async def fork(self, session_id: str | None = None, *, checkpoint_id: str | None = None,
                   new_session_id: str | None = None, ttl_seconds: int | None = None) -> AsyncSession:
        """A new session with a copy of ``session_id``'s variables and files (checkpointed now),
        or of checkpoint ``checkpoint_id``'s; the two are independent afterwards."""
        return AsyncSession(self, await self._send(routes.create_session(
            new_session_id, ttl_seconds, None, None, fork_of=session_id, from_checkpoint=checkpoint_id)))

    async def checkpoint(self, session_id: str) -> CheckpointInfo:
        """Save the session's variables and files now (restored after a kernel's death)."""
        return await self._send(routes.session_call(routes.CHECKPOINT, session_id, routes.CHECKPOINT_TIMEOUT))

    async def checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first."""
        return (await self._send(routes.session_call(routes.LIST_CHECKPOINTS, session_id))).checkpoints

    async def session(self, session_id: str) -> AsyncSession:
        """A handle on an existing session (SessionNotFound if there is none)."""
        return AsyncSession(self, await self.get_session(session_id))

    async def get_session(self, session_id: str) -> SessionInfo:
        """The session's current SessionInfo."""
        return await self._send(routes.session_call(routes.GET_SESSION, session_id))

    async def list_sessions(self) -> list[SessionInfo]:
        """Every session this token may see (all pages; ``iter_sessions`` reads them lazily)."""
        return [s async for s in self.iter_sessions()]

    async def sessions_page(self, *, limit: int | None = None, cursor: str | None = None) -> SessionList:
        """One page of sessions in creation order: ``limit`` at most (server default 100, most
        1000), after ``cursor`` (the previous page's ``next_cursor``; None when none remain)."""
        return await self._send(routes.list_sessions(limit, cursor))

    async def iter_sessions(self, *, page_size: int | None = None) -> AsyncIterator[SessionInfo]:
        """Every session this token may see, fetched a page (``page_size``) at a time."""
        cursor: str | None = None
        while True:
            page = await self.sessions_page(limit=page_size, cursor=cursor)
            for info in page.sessions:
                yield info
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def delete_session(self, session_id: str) -> None:
        """Delete a session and its kernel (SessionNotFound if there is none)."""
        await self._send(routes.session_call(routes.DELETE_SESSION, session_id))

    # -- runs --------------------------------------------------------------------------------------
    async def execute(self, session_id: str, code: str, *, timeout_seconds: float | None = None,
                      wait_seconds: float | None = None, on_event: OnEvent | None = None) -> RunResult:
        """Run code in a session. ``wait_seconds``: return ``running`` after that long.
        ``on_event``: stream output (stream chunks, displays) as it comes, then return the end."""
        if on_event is None:
            return await self._send(routes.execute(session_id, code, timeout_seconds, wait_seconds))
        first = await self._send(routes.execute(session_id, code, timeout_seconds, 0))
        return await self.follow(first.run_id, on_event=on_event)

    async def run_once(self, code: str, *, files: dict[str, bytes] | None = None,
                       timeout_seconds: float | None = None, tools: list[str] | None = None,
                 egress: dict[str, Any] | None = None) -> RunResult:
        """One-shot: run code in a fresh kernel that is discarded afterwards (POST /v1/execute).
        ``files``: {path in /mnt/data: bytes} put in place before the run; ``egress`` as in
        ``create_session``."""
        return await self._send(routes.run_once(code, files, timeout_seconds, tools, egress))

    async def get_run(self, run_id: str, *, offset: int = 0, wait_seconds: float = 0) -> RunProgress:
        """A run's output events from ``offset`` on, waiting up to ``wait_seconds`` for news."""
        return await self._send(routes.get_run(run_id, offset, wait_seconds))

    async def approve(self, run_id: str, call_id: str, approve: bool = True, *,
                      reason: str | None = None) -> ApprovalAnswer:
        """Decide a call of the run's ``pending_approvals`` (status ``awaiting_approval``);
        ``approve=False`` makes it raise ToolDenied (with ``reason``) in the code."""
        return await self._send(routes.approve(run_id, call_id, approve, reason))

    async def stream(self, run_id: str, *, offset: int = 0, poll_seconds: float = 30) -> AsyncIterator[dict[str, Any]]:
        """Yield a run's output events as they arrive (long-polling) until it ends."""
        while True:
            p = await self.get_run(run_id, offset=offset, wait_seconds=poll_seconds)
            for event in p.events:
                yield event
            offset = p.next_offset
            if p.done:
                return

    async def follow(self, run_id: str, *, on_event: OnEvent | None = None,
                     poll_seconds: float = 30) -> RunResult:
        """Wait for a run to end (long-polling), passing each output event to ``on_event``."""
        offset = 0
        while True:
            p = await self.get_run(run_id, offset=offset, wait_seconds=poll_seconds)
            for event in p.events:
                if on_event is not None:
                    on_event(event)
            offset = p.next_offset
            if p.done:
                return final(p)

    async def interrupt(self, session_id: str) -> SessionInfo:
        """Interrupt the session's running code (it ends as ``interrupted``)."""
        return await self._send(routes.session_call(routes.INTERRUPT, session_id))

    async def restart(self, session_id: str) -> SessionInfo:
        """Restart the session's kernel: variables are gone, files stay."""
        return await self._send(routes.session_call(routes.RESTART, session_id, routes.RESTART_TIMEOUT))

    async def install_packages(self, session_id: str, packages: list[str]) -> PackagesResult:
        """Install packages into the session (``["name", "name==1.2"]``): the server downloads
        wheels, the kernel stays offline. PackageRefused (403), NoWheel (422) on refusal."""
        return await self._send(routes.install_packages(session_id, packages))

    # -- files -------------------------------------------------------------------------------------
    async def upload(self, session_id: str, path: str, data: UploadData, *,
                     overwrite: bool = False) -> UploadResult:
        """Put bytes (or a local file, by path or open file) at /mnt/data/<path>."""
        body = routes.upload_body(data)
        if isinstance(body, bytes):
            return await self._send(routes.upload(session_id, path, body, overwrite))
        # httpx's AsyncClient sends only async bodies: read the file in chunks, off the loop.
        size = routes.remaining_length(body)
        return await self._send(routes.upload(session_id, path, _chunks(body), overwrite,
                                              {} if size is None else {"Content-Length": str(size)}))

    async def download(self, session_id: str, path: str) -> bytes:
        """A workspace file's bytes (``path`` relative to /mnt/data, or absolute under it)."""
        return await self._send(routes.download(session_id, path))

    async def delete_file(self, session_id: str, path: str) -> FileDeleted:
        """Delete a workspace file (FileNotFound if there is none)."""
        return await self._send(routes.delete_file(session_id, path))

    async def list_files(self, session_id: str) -> list[WorkspaceFile]:
        """The files of the session's workspace."""
        return (await self._send(routes.session_call(routes.LIST_FILES, session_id))).files

    async def artifacts(self, session_id: str) -> list[Artifact]:
        """The artifacts the session's runs kept."""
        return (await self._send(routes.session_call(routes.ARTIFACTS, session_id))).artifacts

    async def notebook(self, session_id: str) -> bytes:
        """The session's runs as an .ipynb (``nbformat.reads(data, as_version=4)``)."""
        return await self._send(routes.session_call(routes.NOTEBOOK, session_id))

    async def download_artifact(self, artifact: Artifact | str) -> bytes:
        """An artifact's bytes from its signed link (no token is sent with it)."""
        url = artifact.download_url if isinstance(artifact, Artifact) else artifact
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as http:
                r = await http.get(url)
        except httpx.TransportError as e:
            raise self._unreachable(url, e) from e
        return self._artifact_bytes(r)

    # -- server ------------------------------------------------------------------------------------
    async def tools(self) -> list[ToolInfo]:
        """The host tools kernels may call."""
        return (await self._send(routes.TOOLS.call())).tools

    async def search_tools(self, query: str, limit: int = 8) -> list[ToolMatch]:
        """The host tools that best fit an intent ("list a repository's commits"), best first."""
        return (await self._send(routes.search_tools(query, limit))).tools

    async def health(self) -> Health:
        """Liveness (``/healthz``)."""
        return await self._send(routes.HEALTH.call())

    async def ready(self) -> Health:
        """Readiness (``/readyz``): a 503 is an answer (``status == "unavailable"``), not an error."""
        return await self._send(routes.READY.call())


class AsyncSession(BaseSession):
    """A session of an ``AsyncClient``: ``async with`` deletes it on exit."""

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        super().__init__(info)
        self.client = client

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self, code: str, *, timeout_seconds: float | None = None, wait_seconds: float | None = None,
                  on_event: OnEvent | None = None) -> RunResult:
        """Run code in this session (``AsyncClient.execute``)."""
        return await self.client.execute(self.id, code, timeout_seconds=timeout_seconds,
                                         wait_seconds=wait_seconds, on_event=on_event)

    execute = run

    async def refresh(self) -> SessionInfo:
        """Fetch the session's SessionInfo again (``self.info``)."""
        self.info = await self.client.get_session(self.id)
        return self.info

    async def upload(self, path: str, data: UploadData, *, overwrite: bool = False) -> UploadResult:
        """Put bytes (or a local file, by path or open file) at /mnt/data/<path>."""
        return await self.client.upload(self.id, path, data, overwrite=overwrite)

    async def download(self, path: str) -> bytes:
        """A workspace file's bytes."""
        return await self.client.download(self.id, path)

    async def delete_file(self, path: str) -> FileDeleted:
        """Delete a workspace file."""
        return await self.client.delete_file(self.id, path)

    async def files(self) -> list[WorkspaceFile]:
        """The files of the workspace."""
        return await self.client.list_files(self.id)

    async def artifacts(self) -> list[Artifact]:
        """The artifacts this session's runs kept."""
        return await self.client.artifacts(self.id)

    async def interrupt(self) -> SessionInfo:
        """Interrupt the running code."""
        return await self.client.interrupt(self.id)

    async def restart(self) -> SessionInfo:
        """Restart the kernel: variables are gone, files stay."""
        return await self.client.restart(self.id)

    async def install(self, *packages: str) -> PackagesResult:
        """Install packages into this session: ``session.install("tabulate", "rich==13.7.1")``."""
        return await self.client.install_packages(self.id, list(packages))
    async def checkpoint(self) -> CheckpointInfo:
        """Save the variables and files now (restored after a kernel's death, or forked)."""
        return await self.client.checkpoint(self.id)

    async def checkpoints(self) -> list[CheckpointInfo]:
        """This session's checkpoints, newest first."""
        return await self.client.checkpoints(self.id)

    async def close(self) -> None:
        """Delete the session (a session already gone is fine)."""
        try:
            await self.client.delete_session(self.id)
        except errors.SessionNotFound:
            pass


async def _chunks(f: IO[bytes], size: int = 1 << 16) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(f.read, size):
        yield chunk
