"""UpstreamMcpServer against a real MCP server (tests/tools/mcp_test_server.py) over stdio and
streamable HTTP (loopback only)."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_types import CallToolResult, ImageContent, TextContent

from kernelmode.config import McpServerSettings
from kernelmode.errors import ToolFailed
from kernelmode.tools.base import Tool
from kernelmode.tools.mcp_upstream import (
    UpstreamMcpServer,
    UpstreamTool,
    call_result_to_data,
    schema_signature,
)

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
# A wait that must end by what the test is about (an exit, a refusal, its own timeout), never by
# the other timeout in play: that one is LONG, and HANG only guards against a hang (no timing).
LONG = 3600.0
HANG = 120.0
EXPECTED_TOOLS = {"echo", "add", "structured", "fail", "slow", "crash", "env_value", "greet"}


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"test MCP server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("test MCP server did not start listening")


class HttpServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "http", "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def server_children() -> list[int]:
    """PIDs of this process's children running the test server (read from /proc)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == me and state != "Z" and SERVER.encode() in cmdline and b"stdio" in cmdline:
            found.append(int(entry))
    return found


def stdio_settings(name: str = "t", **kw: Any) -> McpServerSettings:
    kw.setdefault("env", {"KM_TEST_VAR": "x"})
    kw.setdefault("connect_timeout_seconds", 15)
    return McpServerSettings(name=name, command=sys.executable, args=[SERVER, "stdio"], **kw)


def by_name(up: UpstreamMcpServer) -> dict[str, UpstreamTool]:
    return {t.upstream_name: t for t in up.tools()}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def http_server() -> Iterator[HttpServer]:
    srv = HttpServer()
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module", params=["stdio", "http"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[UpstreamMcpServer]:
    if request.param == "stdio":
        settings = stdio_settings()
    else:
        http: HttpServer = request.getfixturevalue("http_server")
        settings = McpServerSettings(name="t", url=http.url, connect_timeout_seconds=15)
    up = UpstreamMcpServer(settings)
    await up.start()
    assert up.available, up.last_error
    yield up
    await up.stop()


# --------------------------------------------------------------------------- against both transports


async def test_discovery(upstream: UpstreamMcpServer) -> None:
    tools = upstream.tools()
    assert {t.upstream_name for t in tools} == EXPECTED_TOOLS
    for t in tools:
        as_tool: Tool = t  # UpstreamTool satisfies the Tool protocol (checked by mypy)
        assert callable(as_tool.call)
        assert t.info.name == f"t.{t.upstream_name}"
        assert t.info.namespace == "t"
    tools_ = by_name(upstream)
    add = tools_["add"].info
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object"
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.signature == "add(a: int, b: int)"
    assert tools_["crash"].info.signature == "crash()"
    assert tools_["slow"].info.signature == "slow(seconds: float)"
    assert (
        tools_["greet"].info.signature
        == "greet(name: str, greeting: str = 'hello', times: int = 1, loud: bool | None = None)"
    )


async def test_results(upstream: UpstreamMcpServer) -> None:
    tools = by_name(upstream)
    assert await tools["echo"].call({"text": "héllo"}, 10) == "héllo"
    assert await tools["echo"].call({"text": '{"a": 1}'}, 10) == '{"a": 1}'  # JSON text stays str
    assert await tools["add"].call({"a": 2, "b": 40}, 10) == 42
    assert await tools["structured"].call({"n": 4}, 10) == {"n": 4, "squares": [0, 1, 4, 9]}
    assert await tools["greet"].call({"name": "x", "times": 2}, 10) == "hello x hello x"
    assert await tools["env_value"].call({"name": "KM_SURELY_UNSET_VAR"}, 10) is None


async def test_concurrent_calls(upstream: UpstreamMcpServer) -> None:
    tools = by_name(upstream)
    results = await asyncio.gather(
        *(tools["add"].call({"a": i, "b": 1}, 10) for i in range(20)),
        tools["slow"].call({"seconds": 0.2}, 10),
    )
    assert results[:20] == [i + 1 for i in range(20)]
    assert results[20] == "slept 0.2"


async def test_tool_error(upstream: UpstreamMcpServer) -> None:
    tools = by_name(upstream)
    with pytest.raises(ToolFailed, match="kaboom 123"):
        await tools["fail"].call({"message": "kaboom 123"}, 10)
    with pytest.raises(ToolFailed):  # argument validation error upstream
        await tools["add"].call({"a": "not a number"}, 10)
    with pytest.raises(ToolFailed):
        await upstream.call_tool("no_such_tool", {}, 10)
    assert upstream.available
    assert await tools["add"].call({"a": 1, "b": 1}, 10) == 2


async def test_timeout(upstream: UpstreamMcpServer) -> None:
    tools = by_name(upstream)
    with pytest.raises(ToolFailed, match=r"tool t\.slow timed out after 0\.5 s"):  # its own, not the tool's end
        await asyncio.wait_for(tools["slow"].call({"seconds": LONG}, 0.5), HANG)
    # the connection is still fine
    assert upstream.available
    assert await tools["slow"].call({"seconds": 0.01}, 10) == "slept 0.01"


async def test_env_passing_stdio(upstream: UpstreamMcpServer) -> None:
    if upstream.settings.command is None:
        pytest.skip("stdio only")
    env_value = by_name(upstream)["env_value"]
    assert await env_value.call({"name": "KM_TEST_VAR"}, 10) == "x"
    assert await env_value.call({"name": "PATH"}, 10) == os.environ["PATH"]


# --------------------------------------------------------------------------- stdio specifics


async def test_canary_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    canary = "KM_CANARY_" + secrets.token_hex(6)
    monkeypatch.setenv(canary, "secret")
    up = UpstreamMcpServer(stdio_settings())
    await up.start()
    try:
        assert up.available, up.last_error
        env_value = by_name(up)["env_value"]
        assert await env_value.call({"name": canary}, 10) is None
        assert await env_value.call({"name": "KM_TEST_VAR"}, 10) == "x"
    finally:
        await up.stop()


async def test_stdio_crash_respawn_and_stop() -> None:
    up = UpstreamMcpServer(stdio_settings(), initial_backoff=0.1, max_backoff=1.0)
    await up.start()
    try:
        assert up.available, up.last_error
        first = server_children()
        assert len(first) == 1
        tools = by_name(up)
        with pytest.raises(ToolFailed, match="MCP server t is unavailable"):  # not the call's timeout
            await asyncio.wait_for(tools["crash"].call({}, LONG), HANG)
        # calls right after the crash fail fast too (or work if already respawned)
        try:
            await asyncio.wait_for(tools["add"].call({"a": 1, "b": 1}, LONG), HANG)
        except ToolFailed as e:
            assert "unavailable" in str(e)
        assert await up.wait_available(15), up.last_error
        # respawned: a new process, refreshed tool list, old Tool objects work again
        assert await tools["add"].call({"a": 2, "b": 3}, 10) == 5
        assert {t.upstream_name for t in up.tools()} == EXPECTED_TOOLS
        second = server_children()
        assert len(second) == 1 and second != first
    finally:
        await up.stop()
    assert server_children() == []
    assert not up.available


async def test_stdio_server_that_exits_at_once() -> None:
    settings = McpServerSettings(
        name="dead", command=sys.executable, args=["-c", "import sys; sys.exit(3)"],
        connect_timeout_seconds=LONG,
    )
    up = UpstreamMcpServer(settings)
    await asyncio.wait_for(up.start(), HANG)  # its exit noticed, not the connect timeout waited out
    assert not up.available
    assert up.last_error
    assert up.tools() == []
    with pytest.raises(ToolFailed, match="MCP server dead is unavailable"):
        await up.call_tool("anything", {}, 5)
    await up.stop()


async def test_stdio_command_not_found() -> None:
    settings = McpServerSettings(name="nope", command="/nonexistent/mcp-server-xyz")
    up = UpstreamMcpServer(settings)
    await up.start()
    assert not up.available
    assert up.last_error is not None
    assert "nonexistent" in up.last_error or "No such file" in up.last_error
    await up.stop()


async def test_stdio_server_that_hangs() -> None:
    settings = McpServerSettings(
        name="hang", command=sys.executable,
        args=["-c", "import time; time.sleep(60)", SERVER, "stdio"],  # SERVER/stdio: for server_children()
        connect_timeout_seconds=1,
    )
    up = UpstreamMcpServer(settings, initial_backoff=LONG)
    await asyncio.wait_for(up.start(), HANG)  # one try: start does not wait for the next
    assert not up.available
    assert "1 s" in str(up.last_error)
    await up.stop()
    assert server_children() == []


async def test_stop_without_start() -> None:
    up = UpstreamMcpServer(stdio_settings())
    await up.stop()
    assert not up.available


# --------------------------------------------------------------------------- http specifics


async def test_http_unreachable() -> None:
    port = free_port()  # nobody listens here
    settings = McpServerSettings(name="gone", url=f"http://127.0.0.1:{port}/mcp", connect_timeout_seconds=LONG)
    up = UpstreamMcpServer(settings)
    await asyncio.wait_for(up.start(), HANG)  # refused at once, not the connect timeout
    assert not up.available
    assert up.last_error
    assert up.tools() == []
    with pytest.raises(ToolFailed, match="MCP server gone is unavailable"):
        await up.call_tool("add", {"a": 1, "b": 2}, 5)
    await up.stop()


async def test_http_server_restart() -> None:
    srv = HttpServer()
    srv.start()
    up = UpstreamMcpServer(
        McpServerSettings(name="h", url=srv.url, headers={"X-Test": "1"}, connect_timeout_seconds=5),
        initial_backoff=0.1,
        max_backoff=0.5,
    )
    try:
        await up.start()
        assert up.available, up.last_error
        add = by_name(up)["add"]
        assert await add.call({"a": 1, "b": 2}, 10) == 3
        srv.kill()
        with pytest.raises(ToolFailed, match="MCP server h is unavailable"):  # not the call's timeout
            await asyncio.wait_for(add.call({"a": 1, "b": 2}, LONG), HANG)
        srv.start()  # same port
        assert await up.wait_available(15), up.last_error
        assert await add.call({"a": 20, "b": 22}, 10) == 42
    finally:
        await up.stop()
        srv.kill()


# --------------------------------------------------------------------------- pure functions


def test_schema_signature() -> None:
    schema = {
        "type": "object",
        "properties": {
            "limit": {"type": "integer", "default": 10},
            "repo": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"enum": ["a", "b"]},
            "opts": {"type": "object", "additionalProperties": {"type": "number"}},
            "flag": {"type": ["boolean", "null"]},
            "ref": {"$ref": "#/$defs/Thing"},
            "weird": {},
        },
        "required": ["repo", "mode"],
        "$defs": {"Thing": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    assert schema_signature("list_commits", schema) == (
        "list_commits(repo: str, mode: Literal['a', 'b'], limit: int = 10, tags: list[str] = None, "
        "opts: dict[str, float] = None, flag: bool | None = None, ref: dict = None, weird: Any = None)"
    )
    assert schema_signature("f", {"type": "object"}) == "f()"


def test_result_conversion() -> None:
    def text(t: str) -> TextContent:
        return TextContent(type="text", text=t)

    assert call_result_to_data(CallToolResult(content=[text("a")])) == "a"
    assert call_result_to_data(CallToolResult(content=[text("[1, 2]")])) == "[1, 2]"
    assert call_result_to_data(CallToolResult(content=[])) is None
    img = ImageContent(type="image", data="aGk=", mime_type="image/png")
    assert call_result_to_data(CallToolResult(content=[text("a"), img])) == [
        "a",
        {"type": "image", "mime_type": "image/png", "data": "aGk="},
    ]
    # structured content wins; {"result": x} is unwrapped unless the schema says it's a dict
    assert call_result_to_data(CallToolResult(content=[text("1")], structured_content={"result": 1})) == 1
    wrapped = {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"]}
    assert call_result_to_data(CallToolResult(content=[], structured_content={"result": 1}), wrapped) == 1
    free = {"type": "object", "additionalProperties": True}
    assert call_result_to_data(CallToolResult(content=[], structured_content={"result": 1}), free) == {
        "result": 1
    }
    assert call_result_to_data(CallToolResult(content=[], structured_content={"a": 1, "result": 2})) == {
        "a": 1,
        "result": 2,
    }


async def test_stop_with_call_in_flight() -> None:
    up = UpstreamMcpServer(stdio_settings())
    await up.start()
    assert up.available, up.last_error
    slow = by_name(up)["slow"]
    call = asyncio.ensure_future(slow.call({"seconds": LONG}, LONG))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(up.stop(), HANG)  # the call in flight ends with it, not when the tool would
    with pytest.raises(ToolFailed, match="unavailable"):
        await asyncio.wait_for(call, 2)
    assert server_children() == []
    with pytest.raises(ToolFailed, match="unavailable"):
        await slow.call({"seconds": 0}, 5)
