"""An upstream MCP server whose tools kernels call as ``tools.SERVER.TOOL``.

One :class:`UpstreamMcpServer` keeps one persistent client connection (stdio or streamable
HTTP, through the official ``mcp`` client) to one configured server. A single background task
owns the connection: it enters the SDK's ``async with`` contexts, lists the tools, then parks
until the connection is lost or :meth:`UpstreamMcpServer.stop` is called, and reconnects with
bounded exponential backoff. Tool calls come from other tasks and only send requests over the
live session, so no anyio cancel scope is ever entered in one task and left in another.

Its rooms: :mod:`~kernelmode.tools.mcp_adapt` turns upstream tools into kernelmode tools
(signatures) and their results into plain data; :mod:`~kernelmode.tools.mcp_transport` holds
the pieces below the session (a read stream that reports EOF, a stderr for stdio servers).

``is_error`` results, timeouts, protocol errors and a lost connection all raise ``ToolFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, TextIO

import anyio
import anyio.to_thread
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_REQUEST,
    REQUEST_TIMEOUT,
    CallToolResult,
    Implementation,
)
from mcp_types import Tool as McpTool

from kernelmode.config import McpServerSettings
from kernelmode.tools.mcp_adapt import (
    UpstreamTool,
    call_result_to_data,
    error_text,
    schema_signature,
)
from kernelmode.tools.mcp_transport import (
    Connection,
    describe,
    eof_watching,
    preload_validation,
    usable_errlog,
)

from ..errors import ToolFailed

__all__ = [
    "UpstreamMcpServer",
    "UpstreamTool",
    "call_result_to_data",
    "schema_signature",
]

logger = logging.getLogger(__name__)

INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
# Environment variables a stdio server inherits from the manager (besides its configured env).
INHERITED_ENV_VARS = ("PATH", "HOME", "LANG")
_MAX_TOOL_PAGES = 100
# Extra time start() and stop() allow beyond the connect timeout for a transport to wind down
# (the SDK's stdio shutdown: close stdin, wait 2 s, SIGTERM, wait 2 s, SIGKILL).
_SHUTDOWN_GRACE_SECONDS = 10.0


# --------------------------------------------------------------------------- server


class UpstreamMcpServer:
    """A persistent, self-healing client connection to one upstream MCP server."""

    def __init__(
        self,
        settings: McpServerSettings,
        *,
        errlog: TextIO | None = None,
        initial_backoff: float = INITIAL_BACKOFF_SECONDS,
        max_backoff: float = MAX_BACKOFF_SECONDS,
    ) -> None:
        """``errlog`` receives a stdio server's stderr (default: this process's stderr)."""
        self.settings = settings
        self._errlog = errlog
        self._initial_backoff = initial_backoff
        self._max_backoff = max(max_backoff, initial_backoff)
        self._tools: list[UpstreamTool] = []
        self._conn: Connection | None = None
        self._available = False
        self._last_error: str | None = None
        self._up = anyio.Event()
        self._first_attempt = anyio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._scope: anyio.CancelScope | None = None

    # ---- public state

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def available(self) -> bool:
        """True while a session is connected and initialized."""
        return self._available

    @property
    def last_error(self) -> str | None:
        """Why the server is (or last was) unavailable; None once a connection succeeds."""
        return self._last_error

    def tools(self) -> list[UpstreamTool]:
        """The tools from the latest successful listing (empty until the first connect).

        Kept while the server is temporarily down (calls then fail with 'unavailable') and
        replaced on every reconnect.
        """
        return list(self._tools)

    # ---- lifecycle

    async def start(self) -> None:
        """Connect, initialize and list tools; never raises.

        Returns once the first attempt succeeded or failed (bounded by
        ``connect_timeout_seconds`` plus transport shutdown time). On failure the server is
        marked unavailable and reconnection continues in the background with backoff.
        """
        if self._task is not None:
            return
        self._stopping = False
        self._first_attempt = anyio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"mcp-upstream-{self.name}"
        )
        with anyio.move_on_after(self.settings.connect_timeout_seconds + _SHUTDOWN_GRACE_SECONDS):
            await self._first_attempt.wait()

    async def stop(self) -> None:
        """Close the session and the transport (the stdio process is gone afterwards)."""
        self._stopping = True
        task = self._task
        if task is None:
            return
        conn = self._conn
        if conn is not None and conn.client is not None:
            conn.lost.set()  # graceful: the owner leaves its `async with` blocks
        elif self._scope is not None:
            self._scope.cancel()  # connecting or backing off: abandon (stdio cleanup is shielded)
        try:
            await asyncio.wait_for(asyncio.shield(task), _SHUTDOWN_GRACE_SECONDS)
        except asyncio.TimeoutError:
            logger.warning("MCP server %s did not shut down in time; cancelling", self.name)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except Exception:  # the owner task died of a bug; stop() still must not raise
            logger.exception("MCP server %s: connection task failed", self.name)
        self._task = None
        self._scope = None
        self._mark_down()

    async def wait_available(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait up to ``timeout`` seconds for a live session; True if there is one."""
        with anyio.move_on_after(timeout):
            while not self._available:
                await self._up.wait()
        return self._available

    # ---- calls

    async def call_tool(
        self,
        tool_name: str,
        arguments: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 - the Tool protocol's name
        *,
        output_schema: dict[str, Any] | None = None,
    ) -> Any:
        """Call upstream tool ``tool_name`` (its MCP name, without the server prefix)."""
        full_name = f"{self.name}.{tool_name}"
        conn = self._conn
        client = conn.client if conn is not None else None
        if conn is None or client is None or not self._available:
            raise ToolFailed(
                f"MCP server {self.name} is unavailable: {self._last_error or 'not connected'}"
            )
        try:
            with anyio.fail_after(timeout):
                result = await client.call_tool(tool_name, arguments, read_timeout_seconds=timeout)
        except TimeoutError:
            raise ToolFailed(f"tool {full_name} timed out after {timeout:g} s") from None
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                raise ToolFailed(f"tool {full_name} timed out after {timeout:g} s") from None
            if e.code == CONNECTION_CLOSED or (
                e.code == INVALID_REQUEST and e.message == "Session terminated"
            ):
                self._lose(conn, f"connection lost during {full_name}: {e.message}")
                raise ToolFailed(f"MCP server {self.name} is unavailable: {e.message}") from None
            raise ToolFailed(f"tool {full_name} failed: {e.message}") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            self._lose(conn, f"connection lost during {full_name}: {describe(e)}")
            raise ToolFailed(f"MCP server {self.name} is unavailable: connection closed") from None
        except ToolFailed:
            raise
        except Exception as e:  # invalid result, unserializable arguments, SDK surprises
            raise ToolFailed(f"tool {full_name} failed: {describe(e)}") from None
        if not isinstance(result, CallToolResult):  # pragma: no cover - extension results
            raise ToolFailed(f"tool {full_name} returned an unsupported result type")
        if result.is_error:
            raise ToolFailed(error_text(result) or f"tool {full_name} failed")
        return call_result_to_data(result, output_schema)

    # ---- the connection owner

    def _lose(self, conn: Connection, why: str) -> None:
        """Mark a live connection as lost so its owner tears it down and reconnects."""
        if conn is not self._conn or conn.lost.is_set():
            return
        if conn.client is not None and not self._stopping:
            logger.warning("MCP server %s: %s; reconnecting", self.name, why)
            self._last_error = why
        self._mark_down()
        conn.lost.set()

    def _mark_down(self) -> None:
        self._available = False
        if self._up.is_set():
            self._up = anyio.Event()

    def _transport(self, stack: AsyncExitStack, on_eof: Callable[[], None]) -> Any:
        s = self.settings
        if s.command is not None:
            env = {k: os.environ[k] for k in INHERITED_ENV_VARS if k in os.environ}
            env.update(s.env)
            params = StdioServerParameters(command=s.command, args=list(s.args), env=env, cwd=s.cwd)
            return eof_watching(stdio_client(params, errlog=usable_errlog(self._errlog)), on_eof)
        assert s.url is not None
        http = httpx2.AsyncClient(
            headers=dict(s.headers),
            timeout=httpx2.Timeout(s.connect_timeout_seconds, read=300.0),
        )
        stack.push_async_callback(http.aclose)
        return eof_watching(streamable_http_client(s.url, http_client=http), on_eof)

    async def _list_tools(self, client: Client) -> list[McpTool]:
        tools: list[McpTool] = []
        cursor: str | None = None
        for _ in range(_MAX_TOOL_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def _session(self, conn: Connection) -> None:
        """Connect, list tools, and hold the session until it is lost or stop() is called."""
        self._conn = conn
        timeout = self.settings.connect_timeout_seconds

        def on_eof() -> None:
            self._lose(conn, "the server closed the connection")

        try:
            with anyio.CancelScope() as scope:
                scope.deadline = anyio.current_time() + timeout
                async with AsyncExitStack() as stack:
                    transport = self._transport(stack, on_eof)
                    client = Client(
                        transport,
                        cache=None,
                        client_info=Implementation(name="kernelmode", version="0.1.0"),
                    )
                    await stack.enter_async_context(client)
                    tools = await self._list_tools(client)
                    scope.deadline = math.inf
                    if conn.lost.is_set():  # died right after listing
                        raise ConnectionError("the server closed the connection while connecting")
                    conn.client = client
                    conn.connected_at = time.monotonic()
                    self._tools = [UpstreamTool(self, t) for t in tools]
                    self._available = True
                    self._last_error = None
                    self._up.set()
                    self._first_attempt.set()
                    logger.info("MCP server %s connected: %d tools", self.name, len(tools))
                    await conn.lost.wait()
            if scope.cancelled_caught and conn.client is None:
                raise TimeoutError(f"no answer within {timeout:g} s")
        finally:
            self._mark_down()
            conn.client = None
            conn.lost.set()

    async def _run(self) -> None:
        delay = self._initial_backoff
        with anyio.CancelScope() as self._scope:
            await anyio.to_thread.run_sync(preload_validation, abandon_on_cancel=True)
            while not self._stopping:
                conn = Connection()
                error: str | None = None
                try:
                    await self._session(conn)
                except Exception as e:  # connection failures of every kind (and HTTP drops)
                    error = describe(e)
                self._first_attempt.set()
                if self._stopping:
                    break
                up_since = conn.connected_at
                if up_since is not None and time.monotonic() - up_since >= self._max_backoff:
                    delay = self._initial_backoff  # it was up for a while: not a crash loop
                if error is not None:
                    log = logger.warning if error != self._last_error else logger.debug
                    log("MCP server %s is unavailable (%s); retrying in %.1f s", self.name, error, delay)
                    self._last_error = error
                await anyio.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
        self._conn = None
