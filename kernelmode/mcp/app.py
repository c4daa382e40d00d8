"""The MCP server of kernelmode: stateful Python for a model, on the running service.

Transports are elsewhere (``http.py`` for /mcp, ``stdio.py`` for `kernelmode mcp`); the tools
in ``tools.py``, each connection's session in ``connections.py``, answers about runs in
``answers.py``. This module puts them on an ``MCPServer`` with the middleware that every
request passes: the era check, the wait for the service's start, and the message cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.tools.base import Tool
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, METHOD_NOT_FOUND, CallToolResult, TextContent

from .. import __version__
from ..config import Settings
from ..errors import KernelmodeError, MessageTooLarge
from ..services import Services
from ..tools.registry import ToolRegistry
from .budget import fit_message, fit_text
from .connections import TENANT_HEADER
from .fastcall import FAST_TOOLS
from .instructions import instructions
from .tools import McpTools, protocol_error

__all__ = ["TENANT_HEADER", "KernelmodeMCP"]

# Tool calls that need only the host tools: answered while the service starts.
_NO_SESSION_TOOLS = frozenset({"list_tools", "search_tools"})
# What a client sends first, whose answer it waits for before anything else.
_GREETINGS = frozenset({"initialize", "server/discover"})


def start_failed(error: MCPError) -> CallToolResult:
    """A tool call's answer when the service could not start (the embedded `kernelmode mcp`):
    what failed and what to do, for the model and its user to read; the error object as REST
    gives it in the structured content, for a program."""
    text = (f"{error.error.message}\n\nThis MCP server cannot run code until that is fixed: fix "
            "what is named above (`kernelmode doctor` checks everything the service needs), then "
            "restart the MCP server.")
    data = error.error.data if isinstance(error.error.data, dict) else None
    return CallToolResult(content=[TextContent(text=text)], structured_content=data, is_error=True)


class KernelmodeMCP:
    """An MCPServer whose tools drive the service's sessions.

    ``settings`` and ``tools`` (started: the instructions list them) are all that ``initialize``
    and the tool list need; ``services`` gives the rest once the service has started (it waits
    for the start, and raises what stopped it), so the embedded `kernelmode mcp` can answer at once.
    """

    def __init__(self, settings: Settings, tools: ToolRegistry,
                 services: Callable[[], Awaitable[Services]]) -> None:
        self.cfg = settings.mcp
        self._started = services
        self._services: Services | None = None
        self.tools = McpTools(settings, tools, self._running)
        built = self.tools.build()
        self.server: MCPServer[Any] = MCPServer(
            name="kernelmode", version=__version__, instructions=instructions(tools), tools=built,
            middleware=[self._refuse_discover, self._note_greeting, self._await_start, self._cap_message],
        )
        # Set once the client's greeting (initialize, or server/discover in the 2026-07-28 era)
        # has been answered, or another request came: the embedded `kernelmode mcp` imports and
        # starts the rest of the service then, not while its client waits for that answer.
        self.greeted = asyncio.Event()
        # The registered Tool objects of the direct route's tools (fastcall.py): kept here, as
        # the SDK's tool table is private.
        self.fast_tools: dict[str, Tool] = {t.name: t for t in built if t.name in FAST_TOOLS}

    def _running(self) -> Services:
        assert self._services is not None, "a tool that needs the sessions ran before _await_start"
        return self._services

    @staticmethod
    async def _refuse_discover(ctx: Any, call_next: Any) -> Any:
        """Over HTTP, keep clients on the initialize handshake, whose connections have an identity.

        The 2026-07-28 per-request envelope has no connection, so "this client's session" would
        not exist; a client that probes server/discover falls back to initialize on this error.
        Over stdio the process is the connection, so the modern era is fine there.
        """
        if getattr(ctx, "method", None) == "server/discover" and getattr(ctx, "request", None) is not None:
            raise MCPError(METHOD_NOT_FOUND, "server/discover is not offered: use the initialize handshake")
        return await call_next(ctx)

    async def _note_greeting(self, ctx: Any, call_next: Any) -> Any:
        if getattr(ctx, "method", None) not in _GREETINGS:
            self.greeted.set()  # before: a tool call may wait for what this starts
        try:
            return await call_next(ctx)
        finally:
            self.greeted.set()

    async def _await_start(self, ctx: Any, call_next: Any) -> Any:
        """A tool call that needs the sessions waits until the service has started; a failed
        start answers every such call with its reason and what to do (an isError, never a hang)."""
        params = ctx.params if isinstance(ctx.params, Mapping) else {}
        if self._services is None and ctx.method == "tools/call" and params.get("name") not in _NO_SESSION_TOOLS:
            try:
                await self.await_start()
            except MCPError as e:
                return start_failed(e)
        return await call_next(ctx)

    async def await_start(self) -> None:
        """Wait for the service's start (at once once it ran); its failure as a protocol error."""
        if self._services is not None:
            return
        try:
            self._services = await self._started()
        except KernelmodeError as e:
            raise protocol_error(e, "kernelmode could not start") from e
        except Exception as e:  # anything else that stopped the start: say so, do not hang
            raise MCPError(INTERNAL_ERROR, f"kernelmode could not start: {e!r}") from e

    async def _cap_message(self, ctx: Any, call_next: Any) -> Any:
        """Every answer, measured as it goes on the wire, under ``mcp.max_message_bytes``: the one
        point where a whole result is known (progress notifications are clipped where sent)."""
        result = await call_next(ctx)
        if not isinstance(result, dict):
            return result  # a notification's (None)
        return await self.cap_answer(getattr(ctx, "method", None), result)

    async def cap_answer(self, method: str | None, result: dict[str, Any],
                         wire_size: int | None = None) -> dict[str, Any]:
        """An answer's wire form held to the text budget (tool calls) and the message cap (the
        middleware above, and the direct route of fastcall.py). ``wire_size``: the bytes of the
        message as it will be sent, when the caller has encoded it already (else measured here);
        ``result`` itself comes back when it fits."""
        if method == "tools/call":
            fitted = fit_text(result, self.cfg.max_text_chars)
            if fitted is not result:
                result, wire_size = fitted, None
        try:
            return await fit_message(result, self.cfg.max_message_bytes, wire_size)
        except MessageTooLarge as e:
            raise MCPError(INTERNAL_ERROR, str(e)) from e
