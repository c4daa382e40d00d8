"""An upstream MCP server whose tools kernels call as ``tools.SERVER.TOOL``.

One :class:`UpstreamMcpServer` keeps one persistent client connection (stdio or streamable
HTTP, through the official ``mcp`` client) to one configured server. A single background task
owns the connection: it enters the SDK's ``async with`` contexts, lists the tools, then parks
until the connection is lost or :meth:`UpstreamMcpServer.stop` is called, and reconnects with
bounded exponential backoff. Tool calls come from other tasks and only send requests over the
live session, so no anyio cancel scope is ever entered in one task and left in another.

Call results become plain data (see :func:`call_result_to_data`):

* ``structured_content`` when the server gives it; MCPServer/FastMCP wrap a plain return value
  (``-> int``, ``-> str``, ``-> list[...]``...) as ``{"result": value}``, which is unwrapped
  to ``value`` when ``result`` is the only key (and the tool's output schema, if it has one,
  declares exactly that one property);
* otherwise the content list: no item -> ``None``; one item -> that item; several -> a list.
  Text is its ``str`` (never JSON-decoded, even if it looks like JSON); images and audio are
  ``{"type": "image"|"audio", "mime_type": ..., "data": <base64 str>}``; embedded resources
  ``{"type": "resource", "uri": ..., "mime_type": ..., "text"|"blob": ...}``; resource links
  ``{"type": "resource_link", "uri": ..., "name": ..., "mime_type": ..., "description": ...}``.

``is_error`` results, timeouts, protocol errors and a lost connection all raise ``ToolFailed``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Generic, TextIO, TypeVar

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
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    Implementation,
    ResourceLink,
    TextContent,
)
from mcp_types import Tool as McpTool

from kernelmode.config import McpServerSettings
from kernelmode.tools.base import ToolFailed, ToolInfo

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

_T = TypeVar("_T")


def _preload_validation() -> None:
    """Import what the SDK's client imports lazily on the first tool result.

    ``ClientSession.validate_tool_result`` imports jsonschema (~1.3 s, with format checkers)
    inside the first ``call_tool``, which would block the event loop; do it in a thread first.
    """
    for module in ("jsonschema", "jsonschema.validators", "referencing", "referencing.exceptions"):
        try:
            importlib.import_module(module)
        except Exception:  # the SDK will report it where it matters
            logger.debug("could not preload %s", module, exc_info=True)


# --------------------------------------------------------------------------- signatures

_JSON_TO_PY = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "null": "None",
    "array": "list",
    "object": "dict",
}


def _resolve_ref(schema: dict[str, Any], root: dict[str, Any]) -> Any:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _union(parts: list[str]) -> str:
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    if "Any" in seen:
        return "Any"
    # `X | None` reads best with None last.
    seen.sort(key=lambda p: p == "None")
    return " | ".join(seen) if seen else "Any"


def _py_type(schema: Any, root: dict[str, Any], depth: int = 0) -> str:
    """A Python-like type name for a JSON Schema (best effort, for humans and models)."""
    if depth > 8 or not isinstance(schema, dict):
        return "Any"
    if "$ref" in schema:
        return _py_type(_resolve_ref(schema, root), root, depth + 1)
    if "const" in schema:
        return f"Literal[{schema['const']!r}]"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "Literal[" + ", ".join(repr(v) for v in enum) + "]"
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _union([_py_type(o, root, depth + 1) for o in options])
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1:
        return _py_type(all_of[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([_py_type({**schema, "type": k}, root, depth + 1) for k in kind])
    if kind == "array":
        items = schema.get("items")
        if isinstance(items, dict) and items:
            return f"list[{_py_type(items, root, depth + 1)}]"
        return "list"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra and not schema.get("properties"):
            return f"dict[str, {_py_type(extra, root, depth + 1)}]"
        return "dict"
    if isinstance(kind, str):
        return _JSON_TO_PY.get(kind, "Any")
    return "Any"


def schema_signature(name: str, schema: dict[str, Any]) -> str:
    """A Python-like signature for a tool taking keyword arguments described by ``schema``.

    Required parameters come first (in schema order), then optional ones with ``= default``
    (the JSON default as a Python literal) or ``= None``. E.g.
    ``list_commits(repo: str, limit: int = 10, branch: str | None = None)``.
    """
    props = schema.get("properties")
    properties: dict[str, Any] = props if isinstance(props, dict) else {}
    req = schema.get("required")
    required = [r for r in req if isinstance(r, str)] if isinstance(req, list) else []
    params: list[str] = []
    for pname in [*(p for p in properties if p in required), *(r for r in required if r not in properties)]:
        params.append(f"{pname}: {_py_type(properties.get(pname), schema)}")
    for pname, pschema in properties.items():
        if pname in required:
            continue
        default = pschema.get("default") if isinstance(pschema, dict) else None
        params.append(f"{pname}: {_py_type(pschema, schema)} = {default!r}")
    return f"{name}({', '.join(params)})"


# --------------------------------------------------------------------------- results


def _content_to_data(item: Any) -> Any:
    if isinstance(item, TextContent):
        return item.text
    if isinstance(item, ImageContent | AudioContent):
        return {"type": item.type, "mime_type": item.mime_type, "data": item.data}
    if isinstance(item, EmbeddedResource):
        res = item.resource
        out: dict[str, Any] = {"type": "resource", "uri": str(res.uri), "mime_type": res.mime_type}
        if isinstance(res, BlobResourceContents):
            out["blob"] = res.blob
        else:
            out["text"] = res.text
        return out
    if isinstance(item, ResourceLink):
        return {
            "type": "resource_link",
            "uri": str(item.uri),
            "name": item.name,
            "mime_type": item.mime_type,
            "description": item.description,
        }
    if hasattr(item, "model_dump"):  # a content type newer than this code
        return item.model_dump(mode="json", exclude_none=True)
    return item


def _is_result_wrapper(output_schema: dict[str, Any] | None) -> bool:
    if output_schema is None:
        return True
    props = output_schema.get("properties")
    return isinstance(props, dict) and set(props) == {"result"}


def call_result_to_data(result: CallToolResult, output_schema: dict[str, Any] | None = None) -> Any:
    """Plain data for a successful ``CallToolResult`` (the rules are in the module docstring)."""
    structured = result.structured_content
    if structured is not None:
        if isinstance(structured, dict) and set(structured) == {"result"} and _is_result_wrapper(output_schema):
            return structured["result"]
        return structured
    items = [_content_to_data(c) for c in result.content]
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    return items


def _error_text(result: CallToolResult) -> str:
    texts = [c.text for c in result.content if isinstance(c, TextContent) and c.text]
    return "\n".join(texts)


def _describe(exc: BaseException) -> str:
    """A one-line description of a (possibly grouped) connection error."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if isinstance(inner, (list, tuple)) and inner and isinstance(inner[0], BaseException):
            exc = inner[0]
            continue
        break
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- transport


class _EofWatchingReadStream(Generic[_T]):
    """Wraps a transport's read stream and reports when it ends (e.g. the stdio server died).

    The SDK's dispatcher simply stops on EOF; this tells the connection owner to reconnect
    without waiting for the next call to notice.
    """

    def __init__(self, inner: Any, on_eof: Callable[[], None]) -> None:
        self._inner = inner
        self._on_eof = on_eof

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> _T:
        try:
            item: _T = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_eof()
            raise
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _EofWatchingReadStream[_T]:
        return self

    async def __anext__(self) -> _T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _EofWatchingReadStream[_T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@asynccontextmanager
async def _eof_watching(
    transport: AbstractAsyncContextManager[tuple[Any, Any]], on_eof: Callable[[], None]
) -> AsyncIterator[tuple[Any, Any]]:
    async with transport as (read_stream, write_stream):
        yield _EofWatchingReadStream[Any](read_stream, on_eof), write_stream


def _usable_errlog(errlog: TextIO | None) -> TextIO:
    for candidate in (errlog, sys.stderr, sys.__stderr__):
        if candidate is None:
            continue
        try:
            candidate.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        return candidate
    raise OSError("no stderr file descriptor for the MCP server process")


class _Connection:
    """One live session; `lost` is set when it must be torn down (EOF, failure, stop)."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.lost = anyio.Event()
        self.connected_at: float | None = None  # time.monotonic() when the session came up


# --------------------------------------------------------------------------- tools


class UpstreamTool:
    """One tool of an upstream MCP server, implementing the ``Tool`` protocol."""

    def __init__(self, server: UpstreamMcpServer, tool: McpTool) -> None:
        self.server = server
        self.upstream_name = tool.name
        self.output_schema: dict[str, Any] | None = tool.output_schema
        schema = dict(tool.input_schema)
        self.info = ToolInfo(
            name=f"{server.name}.{tool.name}",
            namespace=server.name,
            description=tool.description or "",
            parameters=schema,
            signature=schema_signature(tool.name, schema),
        )

    async def call(self, arguments: dict[str, Any], timeout: float) -> Any:  # noqa: ASYNC109
        return await self.server.call_tool(
            self.upstream_name, arguments, timeout, output_schema=self.output_schema
        )

    def __repr__(self) -> str:
        return f"<UpstreamTool {self.info.name}>"


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
        self._conn: _Connection | None = None
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
            self._lose(conn, f"connection lost during {full_name}: {_describe(e)}")
            raise ToolFailed(f"MCP server {self.name} is unavailable: connection closed") from None
        except ToolFailed:
            raise
        except Exception as e:  # invalid result, unserializable arguments, SDK surprises
            raise ToolFailed(f"tool {full_name} failed: {_describe(e)}") from None
        if not isinstance(result, CallToolResult):  # pragma: no cover - extension results
            raise ToolFailed(f"tool {full_name} returned an unsupported result type")
        if result.is_error:
            raise ToolFailed(_error_text(result) or f"tool {full_name} failed")
        return call_result_to_data(result, output_schema)

    # ---- the connection owner

    def _lose(self, conn: _Connection, why: str) -> None:
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
            return _eof_watching(stdio_client(params, errlog=_usable_errlog(self._errlog)), on_eof)
        assert s.url is not None
        http = httpx2.AsyncClient(
            headers=dict(s.headers),
            timeout=httpx2.Timeout(s.connect_timeout_seconds, read=300.0),
        )
        stack.push_async_callback(http.aclose)
        return _eof_watching(streamable_http_client(s.url, http_client=http), on_eof)

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

    async def _session(self, conn: _Connection) -> None:
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
            await anyio.to_thread.run_sync(_preload_validation, abandon_on_cancel=True)
            while not self._stopping:
                conn = _Connection()
                error: str | None = None
                try:
                    await self._session(conn)
                except Exception as e:  # connection failures of every kind (and HTTP drops)
                    error = _describe(e)
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
