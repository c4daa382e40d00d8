"""The pieces of an upstream MCP connection below the session: a read stream that reports its
end, a stderr for stdio servers, one connection's state, and the one-line description of a
connection error. Used by :class:`kernelmode.tools.mcp_upstream.UpstreamMcpServer` only.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, TextIO, TypeVar

import anyio
from mcp import Client

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def preload_validation() -> None:
    """Import what the SDK's client imports lazily on the first tool result.

    ``ClientSession.validate_tool_result`` imports jsonschema (~1.3 s, with format checkers)
    inside the first ``call_tool``, which would block the event loop; do it in a thread first.
    """
    for module in ("jsonschema", "jsonschema.validators", "referencing", "referencing.exceptions"):
        try:
            importlib.import_module(module)
        except Exception:  # the SDK will report it where it matters
            logger.debug("could not preload %s", module, exc_info=True)


def describe(exc: BaseException) -> str:
    """A one-line description of a (possibly grouped) connection error."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if isinstance(inner, (list, tuple)) and inner and isinstance(inner[0], BaseException):
            exc = inner[0]
            continue
        break
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EofWatchingReadStream(Generic[_T]):
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

    def __aiter__(self) -> EofWatchingReadStream[_T]:
        return self

    async def __anext__(self) -> _T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> EofWatchingReadStream[_T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@asynccontextmanager
async def eof_watching(
    transport: AbstractAsyncContextManager[tuple[Any, Any]], on_eof: Callable[[], None]
) -> AsyncIterator[tuple[Any, Any]]:
    async with transport as (read_stream, write_stream):
        yield EofWatchingReadStream[Any](read_stream, on_eof), write_stream


def usable_errlog(errlog: TextIO | None) -> TextIO:
    for candidate in (errlog, sys.stderr, sys.__stderr__):
        if candidate is None:
            continue
        try:
            candidate.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        return candidate
    raise OSError("no stderr file descriptor for the MCP server process")


class Connection:
    """One live session; `lost` is set when it must be torn down (EOF, failure, stop)."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.lost = anyio.Event()
        self.connected_at: float | None = None  # time.monotonic() when the session came up
