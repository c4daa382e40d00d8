"""The MCP server's instructions list a handful of host tools, and point to search_tools beyond."""

from __future__ import annotations

from kernelmode.mcp.instructions import LIST_AT_MOST, call_form, instructions
from kernelmode.tools.registry import ToolRegistry


def registry(n: int) -> ToolRegistry:
    reg = ToolRegistry()
    for i in range(n):
        def tool(a: int, b: int = 0) -> int:
            """Add two integers."""
            return a + b

        reg.register(tool, name=f"add_{i}")
    return reg


def test_a_handful_of_tools_are_listed_with_their_calls() -> None:
    text = instructions(registry(LIST_AT_MOST))
    assert "tools.add_0(a: int, b: int = 0) -> int: Add two integers." in text
    assert "search_tools" not in text


def test_more_tools_are_found_with_search_tools() -> None:
    text = instructions(registry(LIST_AT_MOST + 1))
    assert "search_tools(" in text and "tools.search(" in text and "add_0" not in text
    assert f"{LIST_AT_MOST + 1} host tools" in text


def test_call_form_names_the_server() -> None:
    assert call_form("github.list_commits", "list_commits(owner: str)") == "tools.github.list_commits(owner: str)"
    assert call_form("add", "") == "tools.add(...)"
