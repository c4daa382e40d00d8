"""Python client for the kernelmode REST API: ``Client`` (sync) and ``AsyncClient``, on httpx.

::

    from kernelmode import Client

    with Client("http://127.0.0.1:8888", token="...") as km:
        with km.create_session() as s:           # deleted when the block ends
            s.upload("sales.csv", b"region,amount\\nnorth,10\\n")
            s.run("import pandas as pd; df = pd.read_csv('/mnt/data/sales.csv')")
            print(s.run("df.amount.sum()").result)
        print(km.run("print(6 * 7)").stdout)      # one-shot: a fresh kernel, discarded after

Results are the server's own pydantic models (RunResult, SessionInfo...). A failure is an
exception from kernelmode.errors carrying the server's error code (``SessionNotFound``,
``TooManySessions``...); a failure in the user's code is not an exception but a RunResult with
``status == "error"``. Requests are retried only where that is safe: a request that never
reached the server (connection refused), and reads (GET) on 502/503/504.

Each class's methods map one-to-one to REST routes. Both classes build their requests with the
same ``_Requests`` helpers so that the sync and async doors cannot drift apart.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from . import errors
from .models import (
    Artifact,
    ArtifactList,
    FileList,
    Health,
    LimitsPatch,
    RunProgress,
    RunResult,
    SessionInfo,
    SessionList,
    ToolList,
    UploadResult,
    WorkspaceFile,
)
from .tools.base import ToolInfo

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8888"
_RETRYABLE_STATUS = {502, 503, 504}
_EXTRA_WAIT = 90.0  # beyond a run's own timeout: interrupt grace, a restart, harvesting


class ServerUnreachable(errors.KernelmodeError):
    """The request could not reach the server (refused, timed out, connection dropped)."""

    code = "unreachable"
    http_status = 0


def _error_classes() -> dict[str, type[errors.KernelmodeError]]:
    found: dict[str, type[errors.KernelmodeError]] = {}
    todo: list[type[errors.KernelmodeError]] = [errors.KernelmodeError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.code, cls)
        todo.extend(cls.__subclasses__())
    return found


_ERRORS = _error_classes()


def error_from_response(r: httpx.Response) -> errors.KernelmodeError:
    """The server's ``{"error": {"code", "message"}}`` as the matching exception."""
    try:
        body = r.json()["error"]
        code, message, details = str(body["code"]), str(body["message"]), body.get("details")
    except (ValueError, KeyError, TypeError):
        code, message, details = "http_error", f"HTTP {r.status_code}: {r.text[:300]}", None
    cls = _ERRORS.get(code, errors.KernelmodeError)
    exc = cls(message, details=details)
    if exc.code != code:  # a code this client does not know: keep the server's
        exc.code = code
    exc.http_status = r.status_code
    return exc


@dataclass
class _Request(Generic[T]):
    """One REST call: how to send it and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Any = None
    params: dict[str, Any] | None = None
    content: Any = None
    timeout: float | None = None  # read timeout for long calls (execute)
    ok: tuple[int, ...] = (200,)
    retry_safe: bool = False  # may be re-sent on 502/503/504
    headers: dict[str, str] = field(default_factory=dict)


def _model(model: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    return lambda r: model.model_validate_json(r.content)


def _path(session_id: str) -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}"


def _file_path(session_id: str, path: str) -> str:
    return f"{_path(session_id)}/files/{quote(path.removeprefix('/mnt/data/').lstrip('/'), safe='/')}"


def _data(data: bytes | str | os.PathLike[str] | IO[bytes]) -> Any:
    """Upload bodies: bytes, a local file's path, or an open binary file (streamed)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, (str, os.PathLike)):
        return Path(data).read_bytes()
    return data


class _Requests:
    """The request of every route, shared by Client and AsyncClient."""

    @staticmethod
    def create_session(session_id: str | None, ttl_seconds: int | None, limits: dict[str, int] | None,
                       tools: list[str] | None) -> _Request[SessionInfo]:
        body: dict[str, Any] = {"session_id": session_id, "ttl_seconds": ttl_seconds, "tools": tools,
                                "limits": LimitsPatch(**limits).model_dump(exclude_none=True) if limits else None}
        return _Request("POST", "/v1/sessions", _model(SessionInfo),
                        json={k: v for k, v in body.items() if v is not None}, ok=(201,))

    @staticmethod
    def execute(session_id: str, code: str, timeout_seconds: float | None,
                wait_seconds: float | None) -> _Request[RunResult]:
        body: dict[str, Any] = {"code": code}
        if timeout_seconds is not None:
            body["timeout_seconds"] = timeout_seconds
        if wait_seconds is not None:
            body["wait_seconds"] = wait_seconds
        wait = wait_seconds if wait_seconds is not None else (timeout_seconds or 3600.0)
        return _Request("POST", f"{_path(session_id)}/execute", _model(RunResult), json=body,
                        timeout=wait + _EXTRA_WAIT, ok=(200, 202))

    @staticmethod
    def one_shot(code: str, files: dict[str, bytes] | None, timeout_seconds: float | None,
                 tools: list[str] | None) -> _Request[RunResult]:
        body: dict[str, Any] = {"code": code, "files": [
            {"path": p, "content_base64": base64.b64encode(d).decode()} for p, d in (files or {}).items()]}
        if timeout_seconds is not None:
            body["timeout_seconds"] = timeout_seconds
        if tools is not None:
            body["tools"] = tools
        return _Request("POST", "/v1/execute", _model(RunResult), json=body,
                        timeout=(timeout_seconds or 3600.0) + _EXTRA_WAIT)

    @staticmethod
    def get_run(run_id: str, offset: int, wait_seconds: float) -> _Request[RunProgress]:
        return _Request("GET", f"/v1/runs/{quote(run_id, safe='')}", _model(RunProgress),
                        params={"offset": offset, "wait_seconds": wait_seconds},
                        timeout=wait_seconds + 30, retry_safe=True)

    @staticmethod
    def get(path: str, parse: Callable[[httpx.Response], T]) -> _Request[T]:
        return _Request("GET", path, parse, retry_safe=True)

    @staticmethod
    def upload(session_id: str, path: str, data: Any, overwrite: bool) -> _Request[UploadResult]:
        return _Request("PUT", _file_path(session_id, path), _model(UploadResult), content=_data(data),
                        params={"overwrite": "true"} if overwrite else None, ok=(201,), timeout=600,
                        headers={"Content-Type": "application/octet-stream"})



class _Base:
    def __init__(self, url: str | None, token: str | None, timeout: float, retries: int) -> None:
        self.url = (url or os.environ.get("KERNELMODE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("KERNELMODE_TOKEN")
        self.timeout = timeout
        self.retries = retries

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _timeout(self, req: _Request[Any]) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, read=req.timeout or self.timeout)

    @staticmethod
    def _finish(req: _Request[T], r: httpx.Response) -> T:
        if r.status_code not in req.ok:
            raise error_from_response(r)
        return req.parse(r)

    def _should_retry(self, req: _Request[Any], attempt: int, r: httpx.Response | None,
                      exc: Exception | None) -> bool:
        if attempt >= self.retries:
            return False
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True  # the request never reached the server
        return r is not None and req.retry_safe and r.status_code in _RETRYABLE_STATUS

    @staticmethod
    def _unreachable(url: str, exc: Exception) -> ServerUnreachable:
        return ServerUnreachable(f"cannot reach the kernelmode server at {url}: {exc}")


class Client(_Base):
    """Synchronous client. Use as a context manager, or call ``close()``."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 retries: int = 2, transport: httpx.BaseTransport | None = None) -> None:
        """``url`` defaults to $KERNELMODE_URL, else http://127.0.0.1:8888; ``token`` to
        $KERNELMODE_TOKEN."""
        super().__init__(url, token, timeout, retries)
        self._http = httpx.Client(base_url=self.url, headers=self._headers(), transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, req: _Request[T]) -> T:
        attempt = 0
        while True:
            r: httpx.Response | None = None
            exc: Exception | None = None
            try:
                r = self._http.request(req.method, req.path, json=req.json, params=req.params,
                                       content=req.content, headers=req.headers, timeout=self._timeout(req))
            except httpx.TransportError as e:
                exc = e
            if not self._should_retry(req, attempt, r, exc):
                if exc is not None:
                    raise self._unreachable(self.url, exc) from exc
                assert r is not None
                return self._finish(req, r)
            time.sleep(0.2 * 2 ** attempt)
            attempt += 1

    # -- sessions ----------------------------------------------------------------------------------
    def create_session(self, session_id: str | None = None, *, ttl_seconds: int | None = None,
                       limits: dict[str, int] | None = None, tools: list[str] | None = None) -> Session:
        """A new session; use it as a context manager to delete it at the end of the block."""
        info = self._send(_Requests.create_session(session_id, ttl_seconds, limits, tools))
        return Session(self, info)

    def session(self, session_id: str) -> Session:
        """A handle on an existing session (SessionNotFound if there is none)."""
        return Session(self, self.get_session(session_id))

    def get_session(self, session_id: str) -> SessionInfo:
        return self._send(_Requests.get(_path(session_id), _model(SessionInfo)))

    def list_sessions(self) -> list[SessionInfo]:
        return self._send(_Requests.get("/v1/sessions", _model(SessionList))).sessions

    def delete_session(self, session_id: str) -> None:
        self._send(_Request("DELETE", _path(session_id), lambda r: None, ok=(204,), retry_safe=True))

    # -- runs --------------------------------------------------------------------------------------
    def execute(self, session_id: str, code: str, *, timeout_seconds: float | None = None,
                wait_seconds: float | None = None,
                on_event: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
        """Run code in a session. ``wait_seconds``: return ``running`` after that long.
        ``on_event``: stream output (stream chunks, displays) as it comes, then return the end."""
        if on_event is None:
            return self._send(_Requests.execute(session_id, code, timeout_seconds, wait_seconds))
        first = self._send(_Requests.execute(session_id, code, timeout_seconds, 0))
        return self.follow(first.run_id, on_event=on_event)

    def run(self, code: str, *, files: dict[str, bytes] | None = None, timeout_seconds: float | None = None,
            tools: list[str] | None = None) -> RunResult:
        """One-shot: run code in a fresh kernel that is discarded afterwards (POST /v1/execute).
        ``files``: {path in /mnt/data: bytes} put in place before the run."""
        return self._send(_Requests.one_shot(code, files, timeout_seconds, tools))

    def get_run(self, run_id: str, *, offset: int = 0, wait_seconds: float = 0) -> RunProgress:
        return self._send(_Requests.get_run(run_id, offset, wait_seconds))

    def stream(self, run_id: str, *, offset: int = 0, poll_seconds: float = 30) -> Iterator[dict[str, Any]]:
        """Yield a run's output events as they arrive (long-polling) until it ends."""
        while True:
            p = self.get_run(run_id, offset=offset, wait_seconds=poll_seconds)
            yield from p.events
            offset = p.next_offset
            if p.done:
                return

    def follow(self, run_id: str, *, on_event: Callable[[dict[str, Any]], None] | None = None,
               poll_seconds: float = 30) -> RunResult:
        """Wait for a run to end (long-polling), passing each output event to ``on_event``."""
        offset = 0
        while True:
            p = self.get_run(run_id, offset=offset, wait_seconds=poll_seconds)
            for event in p.events:
                if on_event is not None:
                    on_event(event)
            offset = p.next_offset
            if p.done:
                return _final(p)

    def interrupt(self, session_id: str) -> SessionInfo:
        return self._send(_Request("POST", f"{_path(session_id)}/interrupt", _model(SessionInfo)))

    def restart(self, session_id: str) -> SessionInfo:
        return self._send(_Request("POST", f"{_path(session_id)}/restart", _model(SessionInfo), timeout=120))

    # -- files -------------------------------------------------------------------------------------
    def upload(self, session_id: str, path: str, data: bytes | str | os.PathLike[str] | IO[bytes], *,
               overwrite: bool = False) -> UploadResult:
        """Put bytes (or a local file, by path or open file) at /mnt/data/<path>."""
        return self._send(_Requests.upload(session_id, path, data, overwrite))

    def download(self, session_id: str, path: str) -> bytes:
        """A workspace file's bytes (``path`` relative to /mnt/data, or absolute under it)."""
        return self._send(_Requests.get(_file_path(session_id, path), lambda r: r.content))

    def list_files(self, session_id: str) -> list[WorkspaceFile]:
        return self._send(_Requests.get(f"{_path(session_id)}/files", _model(FileList))).files

    def artifacts(self, session_id: str) -> list[Artifact]:
        return self._send(_Requests.get(f"{_path(session_id)}/artifacts", _model(ArtifactList))).artifacts

    def notebook(self, session_id: str) -> bytes:
        """The session's runs as an .ipynb (``nbformat.reads(data, as_version=4)``)."""
        return self._send(_Requests.get(f"{_path(session_id)}/notebook", lambda r: r.content))

    def download_artifact(self, artifact: Artifact | str) -> bytes:
        """An artifact's bytes from its signed link (no token is sent with it)."""
        url = artifact.download_url if isinstance(artifact, Artifact) else artifact
        try:
            r = httpx.get(url, timeout=self.timeout)
        except httpx.TransportError as e:
            raise self._unreachable(url, e) from e
        if r.status_code != 200:
            raise error_from_response(r)
        return r.content

    # -- server ------------------------------------------------------------------------------------
    def tools(self) -> list[ToolInfo]:
        return self._send(_Requests.get("/v1/tools", _model(ToolList))).tools

    def health(self) -> Health:
        return self._send(_Request("GET", "/healthz", _model(Health), retry_safe=True))

    def ready(self) -> Health:
        return self._send(_Request("GET", "/readyz", _model(Health), ok=(200, 503), retry_safe=False))


class AsyncClient(_Base):
    """Asynchronous client: the same methods as ``Client``, awaitable."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 retries: int = 2, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(url, token, timeout, retries)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self._headers(), transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, req: _Request[T]) -> T:
        attempt = 0
        while True:
            r: httpx.Response | None = None
            exc: Exception | None = None
            try:
                r = await self._http.request(req.method, req.path, json=req.json, params=req.params,
                                             content=req.content, headers=req.headers,
                                             timeout=self._timeout(req))
            except httpx.TransportError as e:
                exc = e
            if not self._should_retry(req, attempt, r, exc):
                if exc is not None:
                    raise self._unreachable(self.url, exc) from exc
                assert r is not None
                return self._finish(req, r)
            await asyncio.sleep(0.2 * 2 ** attempt)
            attempt += 1

    async def create_session(self, session_id: str | None = None, *, ttl_seconds: int | None = None,
                             limits: dict[str, int] | None = None,
                             tools: list[str] | None = None) -> AsyncSession:
        info = await self._send(_Requests.create_session(session_id, ttl_seconds, limits, tools))
        return AsyncSession(self, info)

    async def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self.get_session(session_id))

    async def get_session(self, session_id: str) -> SessionInfo:
        return await self._send(_Requests.get(_path(session_id), _model(SessionInfo)))

    async def list_sessions(self) -> list[SessionInfo]:
        return (await self._send(_Requests.get("/v1/sessions", _model(SessionList)))).sessions

    async def delete_session(self, session_id: str) -> None:
        await self._send(_Request("DELETE", _path(session_id), lambda r: None, ok=(204,), retry_safe=True))

    async def execute(self, session_id: str, code: str, *, timeout_seconds: float | None = None,
                      wait_seconds: float | None = None,
                      on_event: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
        if on_event is None:
            return await self._send(_Requests.execute(session_id, code, timeout_seconds, wait_seconds))
        first = await self._send(_Requests.execute(session_id, code, timeout_seconds, 0))
        return await self.follow(first.run_id, on_event=on_event)

    async def run(self, code: str, *, files: dict[str, bytes] | None = None,
                  timeout_seconds: float | None = None, tools: list[str] | None = None) -> RunResult:
        return await self._send(_Requests.one_shot(code, files, timeout_seconds, tools))

    async def get_run(self, run_id: str, *, offset: int = 0, wait_seconds: float = 0) -> RunProgress:
        return await self._send(_Requests.get_run(run_id, offset, wait_seconds))

    async def follow(self, run_id: str, *, on_event: Callable[[dict[str, Any]], None] | None = None,
                     poll_seconds: float = 30) -> RunResult:
        offset = 0
        while True:
            p = await self.get_run(run_id, offset=offset, wait_seconds=poll_seconds)
            for event in p.events:
                if on_event is not None:
                    on_event(event)
            offset = p.next_offset
            if p.done:
                return _final(p)

    async def interrupt(self, session_id: str) -> SessionInfo:
        return await self._send(_Request("POST", f"{_path(session_id)}/interrupt", _model(SessionInfo)))

    async def restart(self, session_id: str) -> SessionInfo:
        return await self._send(_Request("POST", f"{_path(session_id)}/restart", _model(SessionInfo),
                                         timeout=120))

    async def upload(self, session_id: str, path: str, data: bytes | str | os.PathLike[str], *,
                     overwrite: bool = False) -> UploadResult:
        return await self._send(_Requests.upload(session_id, path, data, overwrite))

    async def download(self, session_id: str, path: str) -> bytes:
        return await self._send(_Requests.get(_file_path(session_id, path), lambda r: r.content))

    async def list_files(self, session_id: str) -> list[WorkspaceFile]:
        return (await self._send(_Requests.get(f"{_path(session_id)}/files", _model(FileList)))).files

    async def artifacts(self, session_id: str) -> list[Artifact]:
        return (await self._send(_Requests.get(f"{_path(session_id)}/artifacts", _model(ArtifactList)))).artifacts

    async def notebook(self, session_id: str) -> bytes:
        return await self._send(_Requests.get(f"{_path(session_id)}/notebook", lambda r: r.content))

    async def download_artifact(self, artifact: Artifact | str) -> bytes:
        url = artifact.download_url if isinstance(artifact, Artifact) else artifact
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as http:
                r = await http.get(url)
        except httpx.TransportError as e:
            raise self._unreachable(url, e) from e
        if r.status_code != 200:
            raise error_from_response(r)
        return r.content

    async def tools(self) -> list[ToolInfo]:
        return (await self._send(_Requests.get("/v1/tools", _model(ToolList)))).tools

    async def health(self) -> Health:
        return await self._send(_Request("GET", "/healthz", _model(Health), retry_safe=True))

    async def ready(self) -> Health:
        return await self._send(_Request("GET", "/readyz", _model(Health), ok=(200, 503)))


def _final(p: RunProgress) -> RunResult:
    if p.result is not None:
        return p.result
    failure = p.failure
    code = failure.code if failure else "internal"
    exc = _ERRORS.get(code, errors.KernelmodeError)(failure.message if failure else "the run ended without a result")
    raise exc


class Session:
    """A session of a ``Client``: a context manager that deletes the session on exit."""

    def __init__(self, client: Client, info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.id = info.session_id

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kernelmode Session {self.id}>"

    def run(self, code: str, *, timeout_seconds: float | None = None, wait_seconds: float | None = None,
            on_event: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
        return self.client.execute(self.id, code, timeout_seconds=timeout_seconds,
                                   wait_seconds=wait_seconds, on_event=on_event)

    execute = run

    def refresh(self) -> SessionInfo:
        self.info = self.client.get_session(self.id)
        return self.info

    def upload(self, path: str, data: bytes | str | os.PathLike[str] | IO[bytes], *,
               overwrite: bool = False) -> UploadResult:
        return self.client.upload(self.id, path, data, overwrite=overwrite)

    def download(self, path: str) -> bytes:
        return self.client.download(self.id, path)

    def files(self) -> list[WorkspaceFile]:
        return self.client.list_files(self.id)

    def artifacts(self) -> list[Artifact]:
        return self.client.artifacts(self.id)

    def interrupt(self) -> SessionInfo:
        return self.client.interrupt(self.id)

    def restart(self) -> SessionInfo:
        return self.client.restart(self.id)

    def close(self) -> None:
        """Delete the session (a session already gone is fine)."""
        try:
            self.client.delete_session(self.id)
        except errors.SessionNotFound:
            pass


class AsyncSession:
    """A session of an ``AsyncClient``: ``async with`` deletes it on exit."""

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.id = info.session_id

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<kernelmode AsyncSession {self.id}>"

    async def run(self, code: str, *, timeout_seconds: float | None = None, wait_seconds: float | None = None,
                  on_event: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
        return await self.client.execute(self.id, code, timeout_seconds=timeout_seconds,
                                         wait_seconds=wait_seconds, on_event=on_event)

    execute = run

    async def refresh(self) -> SessionInfo:
        self.info = await self.client.get_session(self.id)
        return self.info

    async def upload(self, path: str, data: bytes | str | os.PathLike[str], *,
                     overwrite: bool = False) -> UploadResult:
        return await self.client.upload(self.id, path, data, overwrite=overwrite)

    async def download(self, path: str) -> bytes:
        return await self.client.download(self.id, path)

    async def files(self) -> list[WorkspaceFile]:
        return await self.client.list_files(self.id)

    async def artifacts(self) -> list[Artifact]:
        return await self.client.artifacts(self.id)

    async def interrupt(self) -> SessionInfo:
        return await self.client.interrupt(self.id)

    async def restart(self) -> SessionInfo:
        return await self.client.restart(self.id)

    async def close(self) -> None:
        try:
            await self.client.delete_session(self.id)
        except errors.SessionNotFound:
            pass
