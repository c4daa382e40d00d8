"""Host tools called from kernel code: real server, real sandboxed kernels, Python tools."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import pytest

from tests.conftest import Server, start_server
from tests.tools.test_mcp_upstream import SERVER as MCP_SERVER
from tests.tools.test_mcp_upstream import HttpServer

TOOL_SECRET = "KM_TOOL_SECRET_" + __import__("secrets").token_hex(6)

CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather"}
  - {name: fail, function: "tests.integration.host_tools:fail"}
  - {name: hang, function: "tests.integration.host_tools:hang"}
  - {name: big, function: "tests.integration.host_tools:big"}
mcp_servers:
  - name: up
    command: @PYTHON@
    args: [@MCP_SERVER@, stdio]
    env: {KM_TEST_VAR: "${KM_TOOL_SECRET}"}
  - name: web
    url: @URL@
tool_calls:
  call_timeout_seconds: 2
  rate_per_second: 0.1  # slow enough that no token comes back during the test
  rate_burst: 30
  max_argument_bytes: 65536
  max_result_bytes: 65536
"""

# Forge a request the way the preamble would, bypassing the tools object.
FORGE = """
import json, sys
kernel = get_ipython().kernel
marker = sys.modules['kernelmode_preamble'].MARKER
reply = type(kernel).raw_input(kernel, marker + json.dumps({"id": "x", "tool": %r, "arguments": %s}))
json.loads(reply)
"""


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    web = HttpServer()
    web.start()
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG.replace("@PYTHON@", json.dumps(sys.executable))
                   .replace("@MCP_SERVER@", json.dumps(MCP_SERVER)).replace("@URL@", web.url))
    srv = start_server({"KM_TOOL_SECRET": TOOL_SECRET}, args=["--config", str(cfg)])
    yield srv
    srv.discard()
    web.kill()
    srv.log_path.unlink(missing_ok=True)


@pytest.fixture()
def tapi(tool_server: Server) -> Iterator:
    with tool_server.client() as c:
        yield c


def _new(tapi, **body) -> str:
    r = tapi.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def _run(tapi, sid: str, code: str, **opts) -> dict:
    r = tapi.post(f"/v1/sessions/{sid}/execute", json={"code": code, **opts})
    assert r.status_code == 200, r.text
    return r.json()


def test_results_positional_keyword_item_and_async(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "(tools.add(2, 3), tools.add(a=1, b=1), tools['add'](4), tools.weather('Paris'))")
    assert r["status"] == "ok", r
    assert r["result"] == "(5, 2, 4, {'city': 'Paris', 'temp': 21, 'unit': 'C'})"
    assert [c["tool"] for c in r["tool_calls"]] == ["add", "add", "add", "weather"]
    assert all(c["ok"] and c["bytes_in"] > 0 and c["bytes_out"] > 0 for c in r["tool_calls"])
    r = _run(tapi, sid, "tools.add('7', '8')")  # validated and coerced by the type hints
    assert r["result"] == "15"



def test_each_tool_call_is_an_audit_line(tapi, tool_server: Server):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.add(20, 22)")
    assert r["result"] == "42"
    lines = [json.loads(x) for x in tool_server.log().splitlines() if x.startswith('{"ts"')]
    calls = [x for x in lines if x["event"] == "tool_call" and x["run_id"] == r["run_id"]]
    assert len(calls) == 1 and calls[0]["session_id"] == sid and calls[0]["tool"] == "add" and calls[0]["ok"]


def test_errors_are_tool_error_with_the_message(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.fail('boom')")
    assert r["status"] == "error"
    assert r["error"]["ename"] == "ToolError"
    assert r["error"]["evalue"] == "fail: ValueError: boom"
    assert "tools.fail('boom')" in r["error"]["traceback"]
    r = _run(tapi, sid, "tools.add(1, 2, 3)")
    assert r["error"]["ename"] == "TypeError"
    r = _run(tapi, sid, "tools.add(a=object())")
    assert r["error"]["ename"] == "TypeError" and "JSON" in r["error"]["evalue"]
    r = _run(tapi, sid, "tools.add(b=1)")
    assert r["error"]["ename"] == "ToolError" and "a: Field required" in r["error"]["evalue"]
    for code in ("tools.nope()", "tools['nope']()"):
        r = _run(tapi, sid, code)
        assert r["error"]["ename"] == "UnknownToolError", r
        assert "unknown tool 'nope'" in r["error"]["evalue"]
    assert _run(tapi, sid, "hasattr(tools, 'nope'), 'add' in tools")["result"] == "(False, True)"


def test_help_dir_and_signatures(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.help()\nprint(dir(tools))\nimport inspect\nprint(inspect.signature(tools.add))\nhelp(tools.weather)")
    assert "tools.add(a: int, b: int = 0) -> int" in r["stdout"]
    assert "Add two integers." in r["stdout"]
    assert "['add', 'big', 'fail', 'hang', 'up', 'weather', 'web']" in r["stdout"]
    assert "(a: int, b: int = 0)" in r["stdout"]  # typed from the JSON Schema (issue 17)
    assert "The weather in a city" in r["stdout"]


def test_get_tools_lists_schema_and_signature(tapi):
    tools = {t["name"]: t for t in tapi.get("/v1/tools").json()["tools"]}
    assert {"add", "weather", "fail", "hang", "big", "up.add", "web.echo"} <= set(tools)
    assert tools["up.add"]["namespace"] == "up"
    assert tools["up.add"]["signature"] == "add(a: int, b: int)"
    assert tools["add"]["signature"] == "add(a: int, b: int = 0) -> int"
    assert tools["add"]["parameters"]["required"] == ["a"]
    assert tools["add"]["parameters"]["properties"]["b"]["default"] == 0
    assert tools["weather"]["description"] == "The weather in a city (fake data)."


def test_allow_list_hides_and_refuses_other_tools(tapi):
    sid = _new(tapi, tools=["add"])
    assert tapi.get(f"/v1/sessions/{sid}").json()["tools"] == ["add"]
    r = _run(tapi, sid, "dir(tools)")
    assert r["result"] == "['add']"
    r = _run(tapi, sid, "tools.weather('x')")
    assert r["error"]["ename"] == "UnknownToolError"
    # Bypassing the tools object does not help: the broker checks the session's allow-list.
    r = _run(tapi, sid, FORGE % ("weather", json.dumps({"city": "x"})))
    assert r["status"] == "ok"
    assert "'ok': False" in r["result"] and "unknown tool" in r["result"]
    assert r["tool_calls"][0] == {**r["tool_calls"][0], "tool": "weather", "ok": False}
    bad = tapi.post("/v1/sessions", json={"tools": ["add", "nope"]})
    assert bad.status_code == 422 and "nope" in bad.json()["error"]["message"]


def test_timeout_of_a_tool_that_never_returns(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.hang()", timeout_seconds=30)
    assert r["error"]["ename"] == "ToolError"
    assert r["error"]["evalue"] == "hang: timed out after 2 s"
    assert _run(tapi, sid, "tools.add(1)")["result"] == "1"


def test_oversized_arguments_and_results(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.add('x' * 100_000)")
    assert r["error"]["ename"] == "ToolError" and "over the limit of 65536" in r["error"]["evalue"]
    r = _run(tapi, sid, "tools.big(100_000)")
    assert r["error"]["ename"] == "ToolError" and "over the limit of 65536" in r["error"]["evalue"]
    assert _run(tapi, sid, "len(tools.big(1000))")["result"] == "1000"


def test_rate_limit_is_per_session_and_identity_comes_from_the_channel(tapi):
    a, b = _new(tapi), _new(tapi)
    code = ("ok = err = 0\nfor i in range(60):\n    try:\n        tools.add(i)\n        ok += 1\n"
            "    except ToolError as e:\n        err += 1\n        msg = str(e)\n(ok, err, msg)")
    r = _run(tapi, a, code)
    ok, err, msg = eval(r["result"])
    assert 30 <= ok <= 31 and err == 60 - ok
    assert "rate limit" in msg
    # A request that claims to be another session's is still counted as this session's...
    forged = (FORGE % ("add", json.dumps({"a": 1}))).replace('"id": "x"', f'"id": "x", "session_id": "{b}"')
    r = _run(tapi, a, forged)
    assert "rate limit" in r["result"]
    # ...and the other session's budget is untouched.
    r = _run(tapi, b, "tools.add(5)")
    assert r["result"] == "5" and len(r["tool_calls"]) == 1


def test_tools_survive_restart_and_kernel_death(tapi):
    sid = _new(tapi)
    assert tapi.post(f"/v1/sessions/{sid}/restart").status_code == 200
    assert _run(tapi, sid, "tools.add(1, 1)")["result"] == "2"
    died = _run(tapi, sid, "import os\nos._exit(1)", timeout_seconds=30)
    assert died["status"] == "kernel_died"
    r = _run(tapi, sid, "tools.add(2, 2)", timeout_seconds=30)
    assert r["result"] == "4" and r["state_lost"] is True, r


def test_many_calls_in_one_cell(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "sum(tools.add(i, 1) for i in range(25))")
    assert r["result"] == str(sum(range(25)) + 25)
    assert len(r["tool_calls"]) == 25 and r["tool_calls_truncated"] is False


def test_upstream_mcp_tools_under_their_namespace(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "(tools.up.add(2, 3), tools.web.echo(text='hi'), tools['up.structured'](3), "
                        "tools.web.add(a=1, b=1))")
    assert r["status"] == "ok", r
    assert r["result"] == "(5, 'hi', {'n': 3, 'squares': [0, 1, 4]}, 2)"
    assert [c["tool"] for c in r["tool_calls"]] == ["up.add", "web.echo", "up.structured", "web.add"]
    r = _run(tapi, sid, "tools.up.fail('bad day')")
    assert r["error"]["ename"] == "ToolError" and "bad day" in r["error"]["evalue"]
    assert "tools.up.add(a: int, b: int)" in _run(tapi, sid, "tools.help()")["stdout"]


def test_namespace_allow_list(tapi):
    sid = _new(tapi, tools=["up"])
    assert _run(tapi, sid, "tools.up.add(1, 2)")["result"] == "3"
    assert _run(tapi, sid, "dir(tools)")["result"] == "['up']"
    assert _run(tapi, sid, "tools.add(1)")["error"]["ename"] == "UnknownToolError"


def test_config_secrets_reach_the_upstream_server_but_never_the_kernel(tapi):
    sid = _new(tapi)
    code = (
        "import os, glob\n"
        f"seen = [p for p in glob.glob('/proc/*/environ') if {TOOL_SECRET!r} in open(p, errors='replace').read()]\n"
        f"(tools.up.env_value('KM_TEST_VAR') == {TOOL_SECRET!r}, {TOOL_SECRET!r} in str(dict(os.environ)), seen)"
    )
    r = _run(tapi, sid, code)
    assert r["result"] == "(True, False, [])", r


def test_a_crashed_upstream_server_gives_errors_then_comes_back(tapi):
    sid = _new(tapi)
    r = _run(tapi, sid, "tools.up.crash()")
    assert r["error"]["ename"] == "ToolError"
    assert "unavailable" in r["error"]["evalue"] or "Connection closed" in r["error"]["evalue"]
    assert r["duration_ms"] < 10_000
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = _run(tapi, sid, "tools.up.add(20, 22)")
        if r["status"] == "ok":
            break
        time.sleep(0.5)
    assert r["result"] == "42", r


def test_library_mode_example_runs():
    import subprocess

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "examples" / "library_mode.py")],
                          capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stock value: 42473 EUR; 14 products out of stock" in proc.stdout
    assert "900 tool calls" in proc.stdout
