"""MCP fixtures: real `mcp` SDK clients over streamable HTTP against the session `server`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import pytest
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from kernelmode.mcp.budget import McpRunResult
from tests.conftest import Server

Connect = Callable[..., contextlib.AbstractAsyncContextManager[Client]]


@contextlib.asynccontextmanager
async def mcp_client(server: Server, token: str | None = None, close: bool = True) -> AsyncIterator[Client]:
    """A connected Client; on exit its connection's own session is closed (unless ``close``
    is False), so the shared server does not collect kernels."""
    tok = server.token if token is None else token
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {tok}"},
                              timeout=httpx2.Timeout(30, read=300))
    try:
        async with Client(streamable_http_client(server.url + "/mcp", http_client=http)) as client:
            try:
                yield client
            finally:
                if close:
                    with contextlib.suppress(Exception):
                        await client.call_tool("close_session", {})
    finally:
        await http.aclose()


@pytest.fixture()
def mcp_connect(server: Server) -> Connect:
    """``async with mcp_connect() as client: ...`` (used inside the test, so that the SDK's task
    groups are entered and left in the same task)."""

    def connect(**kw: Any) -> contextlib.AbstractAsyncContextManager[Client]:
        return mcp_client(server, **kw)

    return connect


def run_record(structured: dict[str, Any] | None) -> dict[str, Any]:
    """A run answer's structured content with the fields it leaves out at their defaults filled
    in (the outputSchema's defaults), as a program reading it would: answers carry only what
    differs from the default."""
    assert structured is not None
    return McpRunResult.model_validate(structured).model_dump(mode="json")
