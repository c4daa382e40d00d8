"""An MCP server with many real tools: those of bench/data/mcp_tools.json (real MCP servers' tool
lists), names, descriptions and input schemas as the real servers publish them. A call answers
with the tool's name and the arguments it got (nothing is done), so tests can check routing.

Run as ``python tests/tools/mcp_catalog_server.py SERVER [SERVER...]`` (stdio), e.g. ``github
slack``: each named server's tools (two servers with one tool name: the first wins).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)

CATALOG = Path(__file__).resolve().parents[2] / "bench" / "data" / "mcp_tools.json"


def load(servers: list[str]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for s in json.loads(CATALOG.read_text())["servers"]:
        if s["name"] in servers:
            for t in s["tools"]:
                schema = t["inputSchema"] or {"type": "object", "properties": {}}
                tools.setdefault(t["name"], Tool(name=t["name"], description=t["description"], input_schema=schema))
    return tools


def main() -> None:
    tools = load(sys.argv[1:])

    async def list_tools(ctx: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=list(tools.values()))

    async def call_tool(ctx: Any, params: CallToolRequestParams) -> CallToolResult:
        if params.name not in tools:
            return CallToolResult(content=[TextContent(text=f"no tool {params.name}")], is_error=True)
        answer = {"tool": params.name, "arguments": params.arguments or {}}
        return CallToolResult(content=[TextContent(text=json.dumps(answer))], structured_content=answer)

    server: Server[Any] = Server("km-catalog", on_list_tools=list_tools, on_call_tool=call_tool)

    async def run() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(run)


if __name__ == "__main__":
    main()
