"""The LangChain adapter and the LangGraph example, with the real frameworks against a real server."""

from __future__ import annotations

import re
import socket

import pytest

pytest.importorskip("langchain_core", reason="the 'langchain' extra is not installed")
pytest.importorskip("langgraph", reason="the 'langchain' extra is not installed")

from langchain_core.messages import ToolMessage  # noqa: E402
from langchain_core.tools import BaseTool, ToolException  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402

from kernelmode import AsyncClient, Client  # noqa: E402
from kernelmode.adapters.langchain import KernelmodeTool, as_langchain_tool  # noqa: E402
from kernelmode.errors import SessionNotFound  # noqa: E402
from tests.adapters.conftest import run_example  # noqa: E402
from tests.conftest import Server  # noqa: E402


def _sid(text: str) -> str:
    m = re.search(r"session_id: (\S+)", text)
    assert m, text
    return m.group(1)


def test_adapters_package_does_not_import_the_frameworks() -> None:
    import subprocess
    import sys

    code = ("import sys, kernelmode.adapters; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('langchain_core', 'langgraph', 'crewai')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_schema_name_and_description(km: Client) -> None:
    tool = as_langchain_tool(km)
    assert isinstance(tool, BaseTool) and isinstance(tool, KernelmodeTool)
    assert tool.name == "run_python" and "stateful" in tool.description
    assert list(tool.args) == ["code"] and tool.args["code"]["type"] == "string"
    fn = convert_to_openai_tool(tool)["function"]  # what a model provider is sent
    assert fn["name"] == "run_python"
    assert fn["parameters"]["required"] == ["code"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"
    assert tool.session_id is None  # no session until the first call

    other = as_langchain_tool(km, name="python", description="Run code.", tags=["km"])
    assert (other.name, other.description, other.tags) == ("python", "Run code.", ["km"])
    assert other.session_id is None


def test_two_calls_share_variables_and_errors_are_text(km: Client) -> None:
    tool = as_langchain_tool(km)
    try:
        first = tool.invoke({"code": "x = 20\nprint('set x')"})
        assert first.startswith("status: ok") and "[stdout]\nset x" in first
        sid = tool.session_id
        assert sid is not None and _sid(first) == sid

        second = tool.invoke({"code": "x + 22"})
        assert "[result]\n42" in second and _sid(second) == sid

        err = tool.invoke({"code": "x / 0"})  # an error in the code: text for the model
        assert isinstance(err, str) and "status: ERROR" in err
        assert "ZeroDivisionError: division by zero" in err
        assert "[result]\n20" in tool.invoke({"code": "x"})  # the session lives on

        # As a model's tool call: a ToolMessage carrying the same text.
        msg = tool.invoke({"name": "run_python", "args": {"code": "x * 2"}, "id": "call_1",
                           "type": "tool_call"})
        assert isinstance(msg, ToolMessage) and msg.tool_call_id == "call_1"
        assert "[result]\n40" in str(msg.content)
    finally:
        tool.close()


def test_close_deletes_the_session_and_a_later_call_starts_afresh(km: Client) -> None:
    tool = as_langchain_tool(km, session={"limits": {"memory_mb": 512}, "ttl_seconds": 600})
    tool.invoke({"code": "y = 1"})
    sid = tool.session_id
    assert sid is not None
    info = km.get_session(sid)
    assert info.limits.memory_mb == 512  # the session options were used
    tool.close()
    assert tool.session_id is None
    with pytest.raises(SessionNotFound):
        km.get_session(sid)
    tool.close()  # twice is fine

    again = tool.invoke({"code": "y"})
    assert "NameError" in again and _sid(again) != sid
    tool.close()


def test_a_session_that_vanished_is_replaced_and_the_model_is_told(km: Client) -> None:
    tool = as_langchain_tool(km)
    try:
        tool.invoke({"code": "z = 1"})
        old = tool.session_id
        assert old is not None
        km.delete_session(old)  # expired or deleted behind the tool's back
        text = tool.invoke({"code": "1 + 1"})
        assert text.startswith("NOTE: the previous session was gone") and "[result]\n2" in text
        assert tool.session_id not in (None, old)
    finally:
        tool.close()


def test_a_handed_in_session_is_used_and_left_alone(km: Client) -> None:
    with km.create_session() as s:
        s.run("w = 'mine'")
        tool = as_langchain_tool(s)
        assert tool.session_id == s.id
        assert "[result]\n'mine'" in tool.invoke({"code": "w"})
        tool.close()
        assert km.get_session(s.id).session_id == s.id  # still there: it is the caller's
    with pytest.raises(ValueError):
        as_langchain_tool(s, session={"ttl_seconds": 60})
    with pytest.raises(TypeError):
        as_langchain_tool("http://127.0.0.1:8888")  # type: ignore[arg-type]


def test_service_failures_reach_the_model_as_text_or_raise_on_request() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    with Client(f"http://127.0.0.1:{port}", "t", retries=0) as dead:
        text = as_langchain_tool(dead).invoke({"code": "1"})
        assert "kernelmode could not run the code (unreachable)" in text
        with pytest.raises(ToolException, match="unreachable"):
            as_langchain_tool(dead, handle_tool_error=False).invoke({"code": "1"})


async def test_async_path_with_a_sync_client_runs_in_a_thread(km: Client) -> None:
    tool = as_langchain_tool(km)
    await tool.ainvoke({"code": "a = 5"})
    assert "[result]\n10" in await tool.ainvoke({"code": "a * 2"})
    assert "[result]\n15" in tool.invoke({"code": "a * 3"})  # the same session both ways
    sid = tool.session_id
    assert sid is not None
    await tool.aclose()
    with pytest.raises(SessionNotFound):
        km.get_session(sid)


async def test_async_path_with_an_async_client(server: Server, km: Client) -> None:
    async with AsyncClient(server.url, server.token) as akm:
        tool = as_langchain_tool(akm)
        await tool.ainvoke({"code": "b = 7"})
        assert "[result]\n49" in await tool.ainvoke({"code": "b * b"})
        assert "status: ERROR" in await tool.ainvoke({"code": "undefined_name"})
        with pytest.raises(TypeError, match="asynchronously"):
            tool.invoke({"code": "b"})
        sid = tool.session_id
        assert sid is not None
        await tool.aclose()
        with pytest.raises(SessionNotFound):
            km.get_session(sid)


def test_host_tools_are_reached_from_the_one_tool(tool_server: Server) -> None:
    with Client(tool_server.url, tool_server.token) as c:
        tool = as_langchain_tool(c, session={"tools": ["add"]})
        try:
            text = tool.invoke({"code": "sum(tools.add(i, b=1) for i in range(10))"})
            assert "[result]\n55" in text and "[tool calls: 10, 0 failed] add(ok), add(ok)" in text
            hidden = tool.invoke({"code": "tools.weather('Paris')"})  # not in this session's list
            assert "status: ERROR" in hidden and "ToolError" in hidden
        finally:
            tool.close()


def test_langgraph_example_runs_an_agent_offline(server: Server, km: Client, tmp_path) -> None:
    pytest.importorskip("langchain", reason="the 'langchain' extra is not installed")
    proc = run_example("langgraph_agent.py", server, tmp_path)
    out = proc.stdout
    assert out.count("--- model calls run_python:") == 2
    assert "[stdout]\nloaded 3 products" in out and "[result]\n42" in out
    assert out.rstrip().endswith("--- final answer:\nThe order total is 42.")
    sids = set(re.findall(r"session_id: (\S+)", out))
    assert len(sids) == 1  # both calls in one session
    with pytest.raises(SessionNotFound):  # and the example deleted it
        km.get_session(sids.pop())
