"""What the MCP front door tells a model about its tools: dedented, short descriptions."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer

from kernelmode.config import Settings
from kernelmode.mcp.tools import McpTools
from kernelmode.tools.registry import ToolRegistry


async def test_tool_descriptions_are_dedented_and_short() -> None:
    def no_services() -> Any:
        raise AssertionError("listing tools needs no service")

    srv: MCPServer[Any] = MCPServer("t", tools=McpTools(Settings(), ToolRegistry(), no_services).build())
    listed = await srv.list_tools()
    assert {t.name for t in listed} >= {"run_python", "get_run", "upload_file", "install_packages"}
    for tool in listed:
        text = tool.description or ""
        assert text, tool.name
        assert not any(line.startswith(" ") for line in text.splitlines()), (tool.name, text)
        assert len(text) <= 1200, (tool.name, len(text))
