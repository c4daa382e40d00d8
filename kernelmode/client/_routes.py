"""The route table of the REST API, and the request of every client method; no I/O here.

``Client`` and ``AsyncClient`` send exactly the :class:`Call` objects built below, so the two
flavours cannot reach different routes or send different bodies. Bodies are plain dicts (the
server validates them and answers with its own error codes); only ``limits`` is checked here,
with the server's model, so that a typo fails before a session is made.
"""

from __future__ import annotations

import base64
import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from ..models import (
    ApprovalAnswer,
    ArtifactList,
    CheckpointInfo,
    CheckpointList,
    FileDeleted,
    FileList,
    Health,
    LimitsPatch,
    PackagesResult,
    RunProgress,
    RunResult,
    SessionInfo,
    SessionList,
    ToolList,
    ToolMatches,
    UploadResult,
)

T = TypeVar("T")
EXTRA_WAIT = 90.0  # beyond a run's own timeout: interrupt grace, a restart, harvesting
NO_TIMEOUT = 3600.0  # read timeout of a run with no timeout of its own
RESTART_TIMEOUT = 120.0  # a restart waits for the new kernel

# What an upload accepts: bytes, a local file's path, or an open binary file (streamed).
UploadData = bytes | str | os.PathLike[str] | IO[bytes]


def _model(model: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    return lambda r: model.model_validate_json(r.content)


def _raw(r: httpx.Response) -> bytes:
    return r.content


def _nothing(r: httpx.Response) -> None:
    return None


@dataclass(frozen=True)
class Route(Generic[T]):
    """One REST route: verb, path template, the statuses that mean success, how to read them."""

    method: str
    path: str  # a template; ``{path}`` keeps its slashes, every other field is one segment
    parse: Callable[[httpx.Response], T]
    ok: tuple[int, ...] = (200,)
    retry_safe: bool = False  # may be re-sent on 502/503/504 (reads)

    def call(self, *, json: Any = None, params: dict[str, Any] | None = None, content: Any = None,
             timeout: float | None = None, headers: dict[str, str] | None = None,
             **path_args: str) -> Call[T]:
        """This route with its path filled in (each value URL-quoted) and its body."""
        fields = {name for _, name, _, _ in string.Formatter().parse(self.path) if name}
        if fields != set(path_args):
            raise TypeError(f"{self.path} takes {sorted(fields)}, got {sorted(path_args)}")
        quoted = {k: quote(v, safe="/" if k == "path" else "") for k, v in path_args.items()}
        return Call(self, self.path.format(**quoted), json=json, params=params, content=content,
                    timeout=timeout, headers=headers or {})


@dataclass
class Call(Generic[T]):
    """One request ready to send: a route, its filled-in path, body and read timeout."""

    route: Route[T]
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    content: Any = None
    timeout: float | None = None  # read timeout for long calls (execute, long-polls)
    headers: dict[str, str] = field(default_factory=dict)


_S = "/v1/sessions/{session_id}"

# The route table: every REST route the client reaches.
CREATE_SESSION = Route("POST", "/v1/sessions", _model(SessionInfo), ok=(201,))
LIST_SESSIONS = Route("GET", "/v1/sessions", _model(SessionList), retry_safe=True)
GET_SESSION = Route("GET", _S, _model(SessionInfo), retry_safe=True)
DELETE_SESSION = Route("DELETE", _S, _nothing, ok=(204,), retry_safe=True)
EXECUTE = Route("POST", f"{_S}/execute", _model(RunResult), ok=(200, 202))
INTERRUPT = Route("POST", f"{_S}/interrupt", _model(SessionInfo))
RESTART = Route("POST", f"{_S}/restart", _model(SessionInfo))
UPLOAD = Route("PUT", f"{_S}/files/{{path}}", _model(UploadResult), ok=(201,))
DOWNLOAD = Route("GET", f"{_S}/files/{{path}}", _raw, retry_safe=True)
LIST_FILES = Route("GET", f"{_S}/files", _model(FileList), retry_safe=True)
DELETE_FILE = Route("DELETE", f"{_S}/files/{{path}}", _model(FileDeleted))
ARTIFACTS = Route("GET", f"{_S}/artifacts", _model(ArtifactList), retry_safe=True)
NOTEBOOK = Route("GET", f"{_S}/notebook", _raw, retry_safe=True)
ONE_SHOT = Route("POST", "/v1/execute", _model(RunResult))
GET_RUN = Route("GET", "/v1/runs/{run_id}", _model(RunProgress), retry_safe=True)
APPROVE = Route("POST", "/v1/runs/{run_id}/approvals/{call_id}", _model(ApprovalAnswer))
TOOLS = Route("GET", "/v1/tools", _model(ToolList), retry_safe=True)
SEARCH_TOOLS = Route("GET", "/v1/tools", _model(ToolMatches), retry_safe=True)  # with ?q=
HEALTH = Route("GET", "/healthz", _model(Health), retry_safe=True)
READY = Route("GET", "/readyz", _model(Health), ok=(200, 503))  # 503 is an answer: not ready
INSTALL_PACKAGES = Route("POST", f"{_S}/packages", _model(PackagesResult))
INSTALL_TIMEOUT = 900.0  # a first install downloads (packages.timeout_seconds is 300 by default)
CHECKPOINT = Route("POST", f"{_S}/checkpoint", _model(CheckpointInfo))
LIST_CHECKPOINTS = Route("GET", f"{_S}/checkpoints", _model(CheckpointList), retry_safe=True)
CHECKPOINT_TIMEOUT = 900.0  # a checkpoint of a large namespace (sessions.checkpoint.timeout_seconds)

ROUTES: tuple[Route[Any], ...] = (
    CREATE_SESSION, LIST_SESSIONS, GET_SESSION, DELETE_SESSION, EXECUTE, INTERRUPT, RESTART, UPLOAD,
    DOWNLOAD, LIST_FILES, ARTIFACTS, NOTEBOOK, ONE_SHOT, GET_RUN, TOOLS, HEALTH, READY,
    SEARCH_TOOLS, APPROVE, INSTALL_PACKAGES, CHECKPOINT, LIST_CHECKPOINTS,
)


def workspace_path(path: str) -> str:
    """A workspace path as the files route takes it: relative to /mnt/data."""
    return path.removeprefix("/mnt/data/").lstrip("/")


# -- the request of each client method ----------------------------------------------------------

def create_session(session_id: str | None, ttl_seconds: int | None, limits: dict[str, int] | None,
                   tools: list[str] | None, packages: list[str] | None = None, fork_of: str | None = None,
                   from_checkpoint: str | None = None, egress: dict[str, Any] | None = None) -> Call[SessionInfo]:
    body: dict[str, Any] = {"session_id": session_id, "ttl_seconds": ttl_seconds, "tools": tools,
                            "limits": LimitsPatch(**limits).model_dump(exclude_none=True) if limits else None,
                            "packages": packages, "fork_of": fork_of, "from_checkpoint": from_checkpoint,
                            "egress": egress}
    timeout = INSTALL_TIMEOUT if packages else CHECKPOINT_TIMEOUT if fork_of or from_checkpoint else None
    return CREATE_SESSION.call(json={k: v for k, v in body.items() if v is not None}, timeout=timeout)


def install_packages(session_id: str, packages: list[str]) -> Call[PackagesResult]:
    return INSTALL_PACKAGES.call(session_id=session_id, json={"packages": list(packages)},
                                 timeout=INSTALL_TIMEOUT)


def execute(session_id: str, code: str, timeout_seconds: float | None,
            wait_seconds: float | None) -> Call[RunResult]:
    body: dict[str, Any] = {"code": code}
    if timeout_seconds is not None:
        body["timeout_seconds"] = timeout_seconds
    if wait_seconds is not None:
        body["wait_seconds"] = wait_seconds
    wait = wait_seconds if wait_seconds is not None else (timeout_seconds or NO_TIMEOUT)
    return EXECUTE.call(session_id=session_id, json=body, timeout=wait + EXTRA_WAIT)


def run_once(code: str, files: dict[str, bytes] | None, timeout_seconds: float | None,
             tools: list[str] | None, egress: dict[str, Any] | None = None) -> Call[RunResult]:
    body: dict[str, Any] = {"code": code, "files": [
        {"path": p, "content_base64": base64.b64encode(d).decode()} for p, d in (files or {}).items()]}
    if timeout_seconds is not None:
        body["timeout_seconds"] = timeout_seconds
    if tools is not None:
        body["tools"] = tools
    if egress is not None:
        body["egress"] = egress
    return ONE_SHOT.call(json=body, timeout=(timeout_seconds or NO_TIMEOUT) + EXTRA_WAIT)


def list_sessions(limit: int | None, cursor: str | None) -> Call[SessionList]:
    """One page of sessions: ``limit`` at most (the server's default: 100), after ``cursor``."""
    params = {k: v for k, v in (("limit", limit), ("cursor", cursor)) if v is not None}
    return LIST_SESSIONS.call(params=params or None)


def search_tools(query: str, limit: int) -> Call[ToolMatches]:
    return SEARCH_TOOLS.call(params={"q": query, "limit": limit})


def get_run(run_id: str, offset: int, wait_seconds: float) -> Call[RunProgress]:
    return GET_RUN.call(run_id=run_id, params={"offset": offset, "wait_seconds": wait_seconds},
                        timeout=wait_seconds + 30)


def approve(run_id: str, call_id: str, approve: bool, reason: str | None) -> Call[ApprovalAnswer]:
    body: dict[str, Any] = {"approve": approve, **({"reason": reason} if reason is not None else {})}
    return APPROVE.call(run_id=run_id, call_id=call_id, json=body)


def upload(session_id: str, path: str, content: Any, overwrite: bool,
           headers: dict[str, str] | None = None) -> Call[UploadResult]:
    """``content``: what the flavour's httpx client sends (bytes, a file, an async iterator)."""
    return UPLOAD.call(session_id=session_id, path=workspace_path(path), content=content,
                       params={"overwrite": "true"} if overwrite else None, timeout=600,
                       headers={"Content-Type": "application/octet-stream", **(headers or {})})


def upload_body(data: UploadData) -> bytes | IO[bytes]:
    """Bytes as they are, a path read into bytes, an open file as it is (streamed by httpx)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, (str, os.PathLike)):
        return Path(data).read_bytes()
    return data


def remaining_length(f: IO[bytes]) -> int | None:
    """How many bytes are left to read in ``f``, when that can be known without reading them."""
    try:
        return max(os.fstat(f.fileno()).st_size - f.tell(), 0)
    except (AttributeError, OSError, ValueError):
        pass
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
        return max(end - here, 0)
    except (AttributeError, OSError, ValueError):
        return None


def download(session_id: str, path: str) -> Call[bytes]:
    return DOWNLOAD.call(session_id=session_id, path=workspace_path(path))


def delete_file(session_id: str, path: str) -> Call[FileDeleted]:
    return DELETE_FILE.call(session_id=session_id, path=workspace_path(path))


def session_call(route: Route[T], session_id: str, timeout: float | None = None) -> Call[T]:
    """A route whose only argument is the session (get, delete, interrupt, restart, listings)."""
    return route.call(session_id=session_id, timeout=timeout)

