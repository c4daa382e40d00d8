"""`kernelmode mcp --url URL`: MCP over stdio, bridged to a running `kernelmode serve`.

A transport bridge to the server's /mcp endpoint: messages pass through unchanged, so the tools
are the server's. (Without a URL, `kernelmode mcp` starts an embedded service: embedded.py.)
stdout carries only the protocol (logs go to stderr).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.server.stdio import stdio_server

log = logging.getLogger("kernelmode.mcp")


async def _pump(source: Any, sink: Any, what: str, done: anyio.Event) -> None:
    try:
        async for message in source:
            if isinstance(message, Exception):
                log.warning("%s: %s", what, message)
                continue
            await sink.send(message)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
        pass
    finally:
        done.set()


async def _preflight(http: httpx2.AsyncClient, base: str) -> str | None:
    """Why the server cannot be used (unreachable, wrong token), or None."""
    try:
        r = await http.get(base + "/v1/tools")
    except httpx2.HTTPError as e:
        return f"cannot reach the kernelmode server at {base}: {e}"
    if r.status_code == 401:
        return f"the server at {base} refused the token (check --token / $KERNELMODE_TOKEN)"
    if r.status_code != 200:
        return f"the server at {base} answered {r.status_code}: is it a kernelmode server?"
    return None


async def bridge(url: str, token: str) -> int:
    """Relay stdio to the /mcp endpoint of a running server until either side ends."""
    base = url.rstrip("/").removesuffix("/mcp")
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30.0, read=None))
    problem = await _preflight(http, base)
    if problem is not None:
        await http.aclose()
        log.error("%s", problem)
        return 2
    endpoint = base + "/mcp"
    try:
        async with stdio_server() as (stdin, stdout), \
                streamable_http_client(endpoint, http_client=http) as (server_in, server_out):
            done = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pump, stdin, server_out, "from the client", done)
                tg.start_soon(_pump, server_in, stdout, "from the server", done)
                await done.wait()
                tg.cancel_scope.cancel()
    finally:
        await http.aclose()
    return 0
