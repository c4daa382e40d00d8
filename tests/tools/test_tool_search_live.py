"""search_tools and typed tool modules on a real server: two upstream MCP servers with the real
tool lists of GitHub's (114 tools) and Slack's (8) MCP servers (tests/tools/mcp_catalog_server.py),
host tools beside them; searched through REST, MCP (the real SDK client) and kernel code, with
session allow-lists respected."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp_types import TextContent

from tests.conftest import Server, start_server
from tests.mcp.conftest import mcp_client

CATALOG_SERVER = str(Path(__file__).with_name("mcp_catalog_server.py"))
CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather"}
mcp_servers:
  - {name: github, command: @PYTHON@, args: [@SERVER@, github]}
  - {name: slack, command: @PYTHON@, args: [@SERVER@, slack]}
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG.replace("@PYTHON@", json.dumps(sys.executable)).replace("@SERVER@", json.dumps(CATALOG_SERVER)))
    server = start_server(args=["--config", str(cfg)])
    yield server
    server.discard()


@pytest.fixture(scope="module")
def api(srv: Server) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def session(api: httpx.Client) -> Callable[..., tuple[str, Callable[[str], dict[str, Any]]]]:
    """session(**body) -> (id, run(code) -> RunResult); sessions deleted at the end."""
    made: list[str] = []

    def make(**body: Any) -> tuple[str, Callable[[str], dict[str, Any]]]:
        r = api.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        made.append(sid)

        def run(code: str) -> dict[str, Any]:
            res = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
            assert res.status_code == 200, res.text
            return res.json()

        return sid, run

    yield make
    for sid in made:
        api.delete(f"/v1/sessions/{sid}")


# -- REST ------------------------------------------------------------------------------------------

def test_rest_ranks_by_intent(api: httpx.Client) -> None:
    r = api.get("/v1/tools", params={"q": "list the commits of a repository", "limit": 3})
    assert r.status_code == 200, r.text
    tools = r.json()["tools"]
    assert len(tools) == 3 and tools[0]["name"] == "github.list_commits"
    assert set(tools[0]) == {"name", "description", "signature", "score"}
    assert tools[0]["signature"].startswith("list_commits(owner: str, repo: str")
    top = api.get("/v1/tools", params={"q": "post a message in a slack channel"}).json()["tools"]
    assert top[0]["name"] == "slack.slack_post_message" and len(top) <= 8


def test_rest_without_q_lists_every_tool(api: httpx.Client) -> None:
    tools = api.get("/v1/tools").json()["tools"]
    assert len(tools) == 114 + 8 + 2 and "parameters" in tools[0]


@pytest.mark.parametrize("params", [{"q": ""}, {"q": "  "}, {"q": "x", "limit": "0"}, {"q": "x", "limit": "51"},
                                    {"q": "x", "limit": "five"}, {"limit": "3"}, {"q": "x" * 1001}])
def test_rest_refuses_bad_searches(api: httpx.Client, params: dict[str, str]) -> None:
    r = api.get("/v1/tools", params=params)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] and r.json()["error"]["message"]


def test_client_search_tools(srv: Server) -> None:
    from kernelmode.client import Client

    with Client(srv.url, srv.token) as km:
        found = km.search_tools("react with an emoji to a message", limit=2)
    assert found[0].name == "slack.slack_add_reaction" and found[0].score > 0


# -- MCP -------------------------------------------------------------------------------------------

async def test_mcp_search_tools_and_short_instructions(srv: Server) -> None:
    async with mcp_client(srv, close=False) as client:
        text = client.instructions or ""
        assert "search_tools" in text and "list_commits" not in text  # 124 tools: not listed
        res = await client.call_tool("search_tools", {"query": "open a pull request", "limit": 3})
        assert not res.is_error
        body = "".join(c.text for c in res.content if isinstance(c, TextContent))
        assert "tools.github.create_pull_request(" in body and "owner: str" in body
        bad = await client.call_tool("search_tools", {"query": "x", "limit": 99})
        assert bad.is_error


# -- kernel ----------------------------------------------------------------------------------------

def test_kernel_search_typed_modules_and_calls(session: Any) -> None:
    _, run = session()
    res = run("found = tools.search('post a message to a slack channel', limit=3)\n"
              "print(found[0]['name'])\n"
              "from tools.github import list_commits\n"
              "print(list_commits('octo', 'hello', perPage=5))\n"
              "import inspect, pydoc\n"
              "print(inspect.signature(list_commits))\n"
              "print('HELP', 'list_commits(owner: str, repo: str' in pydoc.render_doc(tools.github, renderer=pydoc.plaintext))\n"
              "print(tools.add(2, 3))\n"
              "found")
    assert res["status"] == "ok", res
    lines = res["stdout"].splitlines()
    assert lines[0] == "slack.slack_post_message"
    assert json.loads(lines[1].replace("'", '"')) == {"tool": "list_commits",
                                                      "arguments": {"owner": "octo", "repo": "hello", "perPage": 5}}
    assert lines[2].startswith("(owner: str, repo: str, author: str = None")
    assert lines[3] == "HELP True" and lines[4] == "5"
    assert res["result"].startswith("tools.slack.slack_post_message(")  # how a match list displays


def test_kernel_tab_completion_shows_the_tools(session: Any) -> None:
    _, run = session()
    res = run("from IPython.core.completer import provisionalcompleter\n"
              "with provisionalcompleter():\n"
              "    done = [c.text for c in get_ipython().Completer.completions('tools.github.list_comm', 22)]\n"
              "done")
    assert res["status"] == "ok", res
    assert "list_commits" in res["result"]


def test_search_respects_the_allow_list(session: Any, api: httpx.Client) -> None:
    _, run = session(tools=["slack", "add"])
    res = run("names = [m['name'] for m in tools.search('list the commits of a github repository', limit=50)]\n"
              "print(sorted(names))\n"
              "try:\n"
              "    from tools.github import list_commits\n"
              "except ImportError as e:\n"
              "    print('ImportError')\n")
    assert res["status"] == "ok", res
    names = eval(res["stdout"].splitlines()[0])  # noqa: S307 (a list literal printed by the test's own code)
    assert names and all(n.startswith("slack.") or n == "add" for n in names)
    assert res["stdout"].splitlines()[1] == "ImportError"
