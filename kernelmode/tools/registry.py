"""ToolRegistry: every host tool by name — Python callables and upstream MCP servers' tools."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, InvalidRequest
from .base import Tool, ToolInfo, ToolMatch
from .python_tool import PythonTool, load_callable
from .search import ToolSearch

if TYPE_CHECKING:
    from ..config import McpServerSettings, ToolSettings
    from .mcp_upstream import UpstreamMcpServer

log = logging.getLogger("kernelmode.tools")


class ToolRegistry:
    def __init__(self) -> None:
        self._python: dict[str, PythonTool] = {}
        self._servers: dict[str, UpstreamMcpServer] = {}
        self._search = ToolSearch()
        self._approval: set[str] = set()  # tools, or whole servers, whose calls wait for a yes/no

    # -- registration ------------------------------------------------------------------------------
    def register(self, func: Callable[..., Any] | None = None, *, name: str | None = None,
                 description: str | None = None, requires_approval: bool = False) -> Any:
        """Register a Python callable (library mode); usable as a decorator, with or without ().

        >>> registry = ToolRegistry()
        >>> @registry.register
        ... def add(a: int, b: int) -> int:
        ...     "Add two integers."
        ...     return a + b
        """
        def do(f: Callable[..., Any]) -> Callable[..., Any]:
            tool = PythonTool(f, name=name, description=description)
            self._check_free(tool.info.name)
            self._python[tool.info.name] = tool
            if requires_approval:
                self._approval.add(tool.info.name)
            return f

        return do(func) if func is not None else do

    def _check_free(self, name: str) -> None:
        if name in self._python or name in self._servers:
            raise ConfigError(f"a tool or MCP server named {name!r} is already registered")

    def add_from_settings(self, tools: Iterable[ToolSettings], servers: Iterable[McpServerSettings]) -> None:
        for t in tools:
            self.register(load_callable(t.function), name=t.name, description=t.description,
                          requires_approval=t.requires_approval)
        for s in servers:
            from .mcp_upstream import UpstreamMcpServer

            self._check_free(s.name)
            self._servers[s.name] = UpstreamMcpServer(s)
            if s.requires_approval is True:
                self._approval.add(s.name)
            elif s.requires_approval:
                self._approval.update(f"{s.name}.{t}" for t in s.requires_approval)

    def requires_approval(self, name: str) -> bool:
        """The tool's calls wait for a person's yes/no (the approval gate)."""
        return name in self._approval or (
            name.partition(".")[0] in self._servers and name.partition(".")[0] in self._approval)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to the upstream MCP servers (one that is down does not stop the rest)."""
        await asyncio.gather(*(s.start() for s in self._servers.values()))
        for name, server in self._servers.items():
            if server.available:
                log.info("MCP server %s: %d tool(s)", name, len(server.tools()))
            else:
                log.warning("MCP server %s is unavailable for now: %s", name, server.last_error)

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self._servers.values()), return_exceptions=True)

    # -- lookup ------------------------------------------------------------------------------------
    @property
    def namespaces(self) -> set[str]:
        return set(self._servers)

    def all(self) -> list[Tool]:
        tools: list[Tool] = list(self._python.values())
        for server in self._servers.values():
            tools.extend(server.tools())
        return sorted(tools, key=lambda t: t.info.name)

    def get(self, name: str) -> Tool | None:
        if name in self._python:
            return self._python[name]
        namespace, _, _ = name.partition(".")
        server = self._servers.get(namespace)
        if server is not None:
            for tool in server.tools():
                if tool.info.name == name:
                    return tool
        return None

    def check_allow_list(self, allow: list[str] | None) -> None:
        """Each entry must name a tool or an MCP server (namespace); else a 422 for the caller."""
        if allow is None:
            return
        known = {t.info.name for t in self.all()} | self.namespaces
        unknown = [a for a in allow if a not in known]
        if unknown:
            raise InvalidRequest(
                f"tools: unknown tool or namespace {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known)) or 'none'}"
            )

    def infos(self, allow: list[str] | None = None) -> list[ToolInfo]:
        return [t.info.model_copy(update={"requires_approval": True}) if self.requires_approval(t.info.name)
                else t.info for t in self.all() if allowed(t.info.name, allow)]

    def search(self, query: str, limit: int = 8, allow: list[str] | None = None) -> list[ToolMatch]:
        """The tools (of those ``allow`` lets through) that best fit an intent: tools/search.py."""
        return self._search.search(self.infos(allow), query, limit)


def allowed(name: str, allow: list[str] | None) -> bool:
    """None allows everything; otherwise the tool's name or its namespace must be listed."""
    return allow is None or name in allow or name.partition(".")[0] in allow
