"""A small MCP server for the upstream-MCP tests, written with the official SDK (MCPServer).

Run as ``python tests/tools/mcp_test_server.py stdio`` or
``python tests/tools/mcp_test_server.py http --port N`` (streamable HTTP on 127.0.0.1, path /mcp).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("km-test")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def structured(n: int) -> dict[str, object]:
    """Return n and the squares of 0..n-1."""
    return {"n": n, "squares": [i * i for i in range(n)]}


@server.tool()
def fail(message: str) -> str:
    """Always fail with the given message (ToolError: the client sees the message)."""
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then say how long."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def crash() -> str:
    """Kill the server process at once."""
    os._exit(1)


@server.tool()
def env_value(name: str) -> str | None:
    """The server process's environment variable NAME, or None."""
    return os.environ.get(name)


@server.tool()
def greet(name: str, greeting: str = "hello", times: int = 1, loud: bool | None = None) -> str:
    """A tool with optional parameters, for signatures."""
    text = " ".join([f"{greeting} {name}"] * times)
    return text.upper() if loud else text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.transport == "stdio":
        server.run("stdio")
    else:
        server.run(
            "streamable-http",
            host="127.0.0.1",
            port=args.port,
            streamable_http_path="/mcp",
        )


if __name__ == "__main__":
    main()
