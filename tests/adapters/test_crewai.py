"""The CrewAI adapter and its example, with the real CrewAI against a real server."""

from __future__ import annotations

import os
import re
import socket

import pytest

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # no telemetry attempts from tests
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
pytest.importorskip("crewai", reason="the 'crewai' extra is not installed")

from crewai import Agent  # noqa: E402
from crewai.tools import BaseTool  # noqa: E402

from kernelmode import AsyncClient, Client  # noqa: E402
from kernelmode.adapters.crewai import KernelmodeCrewTool, as_crewai_tool  # noqa: E402
from kernelmode.client import ServerUnreachable  # noqa: E402
from kernelmode.errors import SessionNotFound  # noqa: E402
from tests.adapters.conftest import run_example  # noqa: E402
from tests.conftest import Server  # noqa: E402


def _sid(text: str) -> str:
    m = re.search(r"session_id: (\S+)", text)
    assert m, text
    return m.group(1)


def test_schema_name_and_an_agent_takes_it(km: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = as_crewai_tool(km)
    assert isinstance(tool, BaseTool) and isinstance(tool, KernelmodeCrewTool)
    assert tool.name == "run_python"
    schema = tool.args_schema.model_json_schema()
    assert schema["required"] == ["code"] and schema["properties"]["code"]["type"] == "string"
    assert "Tool Name: run_python" in tool.description and "stateful" in tool.description
    structured = tool.to_structured_tool()  # what CrewAI's agent executor uses
    assert structured.name == "run_python"
    assert list(structured.args_schema.model_json_schema()["properties"]) == ["code"]
    assert tool.session_id is None  # no session until the first call

    # An agent accepts it (building one needs an LLM key; nothing is sent: no Crew runs).
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    agent = Agent(role="Analyst", goal="Compute", backstory="Careful.", tools=[tool], llm="gpt-4o-mini")
    assert agent.tools is not None and agent.tools[0] is tool

    other = as_crewai_tool(km, name="python", description="Run code.", result_as_answer=True)
    assert other.name == "python" and other.description.endswith("Run code.") and other.result_as_answer


def test_two_calls_share_variables_and_errors_are_text(km: Client) -> None:
    tool = as_crewai_tool(km)
    try:
        first = tool.run(code="x = 20\nprint('set x')")
        assert first.startswith("status: ok") and "[stdout]\nset x" in first
        sid = tool.session_id
        assert sid is not None and _sid(first) == sid
        second = tool.run(code="x + 22")
        assert "[result]\n42" in second and _sid(second) == sid

        err = tool.run(code="x / 0")
        assert isinstance(err, str) and "status: ERROR" in err
        assert "ZeroDivisionError: division by zero" in err
        assert "[result]\n20" in tool.run(code="x")
        assert "[result]\n40" in tool.to_structured_tool().invoke({"code": "x * 2"})
    finally:
        tool.close()


def test_close_deletes_the_session(km: Client) -> None:
    tool = as_crewai_tool(km, session={"limits": {"memory_mb": 512}})
    tool.run(code="y = 1")
    sid = tool.session_id
    assert sid is not None and km.get_session(sid).limits.memory_mb == 512
    tool.close()
    with pytest.raises(SessionNotFound):
        km.get_session(sid)
    again = tool.run(code="y")  # a later call starts a new session
    assert "NameError" in again and _sid(again) != sid
    tool.close()


def test_a_handed_in_session_is_left_alone_and_bad_targets_are_refused(km: Client, server: Server) -> None:
    with km.create_session() as s:
        s.run("w = 'mine'")
        tool = as_crewai_tool(s)
        assert "[result]\n'mine'" in tool.run(code="w")
        tool.close()
        assert km.get_session(s.id).session_id == s.id
    with pytest.raises(TypeError, match="synchronously"):
        as_crewai_tool(AsyncClient(server.url, server.token))  # type: ignore[arg-type]


def test_service_failures_raise_for_crewai_to_report() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", "t", retries=0) as dead, pytest.raises(ServerUnreachable):
        as_crewai_tool(dead).run(code="1")


def test_host_tools_are_reached_from_the_one_tool(tool_server: Server) -> None:
    with Client(tool_server.url, tool_server.token) as c:
        tool = as_crewai_tool(c)
        try:
            text = tool.run(code="r = tools.weather('Paris')\n[tools.add(r['temp'], b=21), r['city']]")
            assert "[result]\n[42, 'Paris']" in text
            assert "[tool calls: 2, 0 failed] weather(ok), add(ok)" in text
        finally:
            tool.close()


def test_crewai_example_runs(server: Server, km: Client, tmp_path) -> None:
    out = run_example("crewai_tool.py", server, tmp_path).stdout
    assert "[stdout]\n3 order lines loaded" in out
    assert "[result]\n'order total: 42'" in out
    sids = set(re.findall(r"session_id: (\S+)", out))
    assert len(sids) == 1
    with pytest.raises(SessionNotFound):
        km.get_session(sids.pop())
