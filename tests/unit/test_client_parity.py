"""The sync and async clients are one client: the same public methods with the same parameters,
sending the same requests, all of them routes the server documents.

The requests are caught at httpx's transport seam (``httpx.MockTransport``) and answered with
minimal valid bodies; what the server does with them is tests/integration/test_client.py's job.
"""

from __future__ import annotations

import inspect
import io
import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest

from kernelmode.api.openapi import openapi_document
from kernelmode.client import AsyncClient, AsyncSession, Client, Session, _routes
from kernelmode.models import Limits

# Names that differ only because one flavour is async; everything else must be equal.
_ASYNC_ONLY = {"__aenter__": "__enter__", "__aexit__": "__exit__", "aclose": "close"}
_ASYNC_WORDS = [("AsyncSession", "Session"), ("AsyncClient", "Client"), ("AsyncIterator", "Iterator"),
                ("AsyncBaseTransport", "BaseTransport")]
PAIRS = [(Client, AsyncClient), (Session, AsyncSession)]


def _public(cls: type) -> dict[str, Any]:
    """Public methods, the constructor and the context-manager methods."""
    dunders = {"__init__", *_ASYNC_ONLY, *_ASYNC_ONLY.values()}
    return {n: getattr(cls, n) for n in dir(cls)
            if (not n.startswith("_") or n in dunders) and callable(getattr(cls, n))}


def _sync_name(name: str) -> str:
    return _ASYNC_ONLY.get(name, name)


def _sync_text(annotation: Any) -> str:
    text = str(annotation)
    for a, s in _ASYNC_WORDS:
        text = text.replace(a, s)
    return text


def _signature(fn: Callable[..., Any]) -> list[tuple[str, Any, Any, str]]:
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, _sync_text(p.annotation)) for p in sig.parameters.values()]
    return [*params, ("return", None, None, _sync_text(sig.return_annotation))]


@pytest.mark.parametrize(("sync", "asyn"), PAIRS, ids=["client", "session"])
def test_same_public_methods_with_the_same_parameters(sync: type, asyn: type) -> None:
    s_methods, a_methods = _public(sync), _public(asyn)
    assert {_sync_name(n) for n in a_methods} == set(s_methods)
    for name, a_fn in a_methods.items():
        s_fn = s_methods[_sync_name(name)]
        assert _signature(a_fn) == _signature(s_fn), name
        if name == "__init__":
            continue
        assert inspect.iscoroutinefunction(a_fn) or inspect.isasyncgenfunction(a_fn), name
        assert not (inspect.iscoroutinefunction(s_fn) or inspect.isasyncgenfunction(s_fn)), name
        if not name.startswith("_"):
            assert s_fn.__doc__ and a_fn.__doc__, f"{name} needs a docstring on both flavours"


# -- the same requests --------------------------------------------------------------------------

SID, RID = "s-1", "r" * 32
_NOW = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()
_INFO = {"session_id": SID, "status": "idle", "created_at": _NOW, "last_activity": _NOW,
         "ttl_seconds": 60, "limits": Limits().model_dump(), "sandbox": "none"}
_RUN = {"run_id": RID, "session_id": SID, "status": "ok", "stdout": "hi\n"}
_CKPT = {"checkpoint_id": "c" * 32, "session_id": SID, "saved": ["x"], "skipped": [], "bytes": 10,
         "created_at": _NOW}
_ANSWERS: dict[_routes.Route[Any], tuple[int, Any]] = {
    _routes.CREATE_SESSION: (201, _INFO),
    _routes.LIST_SESSIONS: (200, {"sessions": [_INFO]}),
    _routes.GET_SESSION: (200, _INFO),
    _routes.DELETE_SESSION: (204, None),
    _routes.EXECUTE: (200, _RUN),
    _routes.INTERRUPT: (200, _INFO),
    _routes.RESTART: (200, _INFO),
    _routes.UPLOAD: (201, {"path": "/mnt/data/a.txt", "size_bytes": 5}),
    _routes.DOWNLOAD: (200, b"bytes"),
    _routes.LIST_FILES: (200, {"files": []}),
    _routes.ARTIFACTS: (200, {"artifacts": []}),
    _routes.NOTEBOOK: (200, b"{}"),
    _routes.ONE_SHOT: (200, _RUN),
    _routes.GET_RUN: (200, {**_RUN, "done": True, "offset": 0, "next_offset": 1, "result": _RUN,
                            "events": [{"type": "stream", "name": "stdout", "text": "hi\n"}]}),
    _routes.TOOLS: (200, {"tools": []}),
    _routes.SEARCH_TOOLS: (200, {"tools": [{"name": "gh.list_commits", "signature": "list_commits()", "score": 2.5}]}),
    _routes.HEALTH: (200, {"status": "ok"}),
    _routes.READY: (503, {"status": "unavailable"}),
    _routes.APPROVE: (200, {"run_id": RID, "call_id": RID, "approved": False, "reason": "no", "by": "rest"}),
    _routes.INSTALL_PACKAGES: (200, {"installed": [{"name": "tabulate", "version": "0.9.0"}], "already": [],
                                     "duration_ms": 1.0}),
    _routes.CHECKPOINT: (200, _CKPT),
    _routes.LIST_CHECKPOINTS: (200, {"checkpoints": [_CKPT]}),
}


def _route_of(request: httpx.Request) -> _routes.Route[Any]:
    path = request.url.raw_path.decode().split("?")[0]
    if request.method == "GET" and path == "/v1/tools" and "q" in request.url.params:
        return _routes.SEARCH_TOOLS  # one path, two routes: a search has a q
    for route in _routes.ROUTES:
        pattern = re.sub(r"\\\{path\\\}", ".+", re.escape(route.path))
        pattern = re.sub(r"\\\{\w+\\\}", "[^/]+", pattern)
        if route.method == request.method and re.fullmatch(pattern, path):
            return route
    raise AssertionError(f"no route for {request.method} {path}")


def _answer(request: httpx.Request, body: bytes, seen: list[tuple[Any, ...]]) -> httpx.Response:
    headers = {k: request.headers.get(k) for k in ("content-type", "content-length", "authorization")}
    seen.append((request.method, request.url.raw_path.decode(), body, headers,
                 request.extensions["timeout"]["read"]))
    status, payload = _ANSWERS[_route_of(request)]
    if isinstance(payload, bytes) or payload is None:
        return httpx.Response(status, content=payload or b"")
    return httpx.Response(status, json=payload)


# (method, args, kwargs) of each call; uploads get a fresh file object per flavour.
CLIENT_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("create_session", ("mine",), {"ttl_seconds": 60, "limits": {"memory_mb": 512}, "tools": ["add"]}),
    ("create_session", (), {}),
    ("create_session", (), {"packages": ["tabulate"]}),
    ("install_packages", (SID, ["tabulate", "rich==13.7.1"]), {}),
    ("session", (SID,), {}),
    ("get_session", ("a/b c",), {}),
    ("list_sessions", (), {}),
    ("sessions_page", (), {"limit": 5, "cursor": "c-1"}),
    ("delete_session", (SID,), {}),
    ("execute", (SID, "1 + 1"), {"timeout_seconds": 5, "wait_seconds": 2}),
    ("execute", (SID, "print('hi')"), {"on_event": lambda e: None}),
    ("run_once", ("6 * 7",), {"files": {"in/a.txt": b"abc"}, "timeout_seconds": 9, "tools": []}),
    ("get_run", (RID,), {"offset": 3, "wait_seconds": 1.5}),
    ("follow", (RID,), {"on_event": lambda e: None, "poll_seconds": 4}),
    ("approve", (RID, RID), {}),
    ("approve", (RID, RID, False), {"reason": "no"}),
    ("interrupt", (SID,), {}),
    ("restart", (SID,), {}),
    ("upload", (SID, "/mnt/data/dir/a b.txt", b"hello"), {"overwrite": True}),
    ("upload", (SID, "f.bin", "FILE"), {}),
    ("download", (SID, "/mnt/data/dir/x#y.txt"), {}),
    ("list_files", (SID,), {}),
    ("artifacts", (SID,), {}),
    ("notebook", (SID,), {}),
    ("tools", (), {}),
    ("search_tools", ("list a repo's commits",), {"limit": 3}),
    ("health", (), {}),
    ("ready", (), {}),
    ("checkpoint", (SID,), {}),
    ("checkpoints", (SID,), {}),
    ("fork", (SID,), {"new_session_id": "f-1", "ttl_seconds": 60}),
    ("fork", (), {"checkpoint_id": "c" * 32}),
]
SESSION_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("run", ("x = 1",), {"timeout_seconds": 3}),
    ("execute", ("x",), {"wait_seconds": 0}),
    ("refresh", (), {}),
    ("upload", ("a.txt", "FILE"), {"overwrite": True}),
    ("download", ("a.txt",), {}),
    ("files", (), {}),
    ("artifacts", (), {}),
    ("interrupt", (), {}),
    ("restart", (), {}),
    ("install", ("tabulate", "rich==13.7.1"), {}),
    ("checkpoint", (), {}),
    ("checkpoints", (), {}),
    ("close", (), {}),
]


def _args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(io.BytesIO(b"from a file object") if a == "FILE" else a for a in args)


def _normal(result: Any) -> Any:
    """Results to compare: sessions by id (their client differs), models as JSON."""
    if isinstance(result, (Session, AsyncSession)):
        return ("session", result.id)
    if isinstance(result, list):
        return [_normal(r) for r in result]
    return result.model_dump(mode="json") if hasattr(result, "model_dump") else result


def _sync_requests() -> tuple[list[Any], list[Any]]:
    seen: list[tuple[Any, ...]] = []
    results: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return _answer(request, request.read(), seen)

    with Client("http://km.test", "tok", transport=httpx.MockTransport(handler)) as km:
        for name, args, kwargs in CLIENT_CALLS:
            results.append(_normal(getattr(km, name)(*_args(args), **kwargs)))
        results.append(list(km.stream(RID, offset=1, poll_seconds=2)))
        s = km.session(SID)
        for name, args, kwargs in SESSION_CALLS:
            results.append(_normal(getattr(s, name)(*_args(args), **kwargs)))
    return seen, results


async def _async_requests() -> tuple[list[Any], list[Any]]:
    seen: list[tuple[Any, ...]] = []
    results: list[Any] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        return _answer(request, await request.aread(), seen)

    async with AsyncClient("http://km.test", "tok", transport=httpx.MockTransport(handler)) as km:
        for name, args, kwargs in CLIENT_CALLS:
            results.append(_normal(await getattr(km, name)(*_args(args), **kwargs)))
        results.append([e async for e in km.stream(RID, offset=1, poll_seconds=2)])
        s = await km.session(SID)
        for name, args, kwargs in SESSION_CALLS:
            results.append(_normal(await getattr(s, name)(*_args(args), **kwargs)))
    return seen, results


async def test_both_flavours_send_the_same_requests_and_read_the_same_answers() -> None:
    sync_seen, sync_results = _sync_requests()
    async_seen, async_results = await _async_requests()
    assert len(sync_seen) == len(async_seen)
    for s, a in zip(sync_seen, async_seen, strict=True):
        assert s == a
    assert sync_results == async_results
    # Every route of the table was reached, file bodies included.
    reached = {_route_of(httpx.Request(m, "http://km.test" + p)) for m, p, *_ in sync_seen}
    assert reached == set(_routes.ROUTES)
    uploads = [(body, h) for m, _, body, h, _ in sync_seen if m == "PUT"]
    assert (b"from a file object", {"content-type": "application/octet-stream",
                                    "content-length": "18", "authorization": "Bearer tok"}) in uploads
    # Paths are quoted segment by segment; a file path keeps its slashes.
    paths = {p for _, p, *_ in sync_seen}
    assert "/v1/sessions/a%2Fb%20c" in paths
    assert "/v1/sessions/s-1/files/dir/x%23y.txt" in paths


def test_every_route_of_the_table_is_one_the_server_documents() -> None:
    documented = {(m.upper(), p) for p, item in openapi_document()["paths"].items() for m in item
                  if m in ("get", "post", "put", "delete")}
    assert {(r.method, r.path) for r in _routes.ROUTES} <= documented


def test_one_shot_runs_have_one_name() -> None:
    """``Client.run`` (a deprecated alias in the never-released 0.1.0) is gone: ``run`` is the
    session's (``Session.run``), ``run_once`` the one-shot run."""
    assert not hasattr(Client, "run") and not hasattr(AsyncClient, "run")
    assert hasattr(Session, "run") and hasattr(AsyncSession, "run")
