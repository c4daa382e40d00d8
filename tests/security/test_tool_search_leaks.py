"""A session never learns of tools it may not call through tool search (issue 17): kernel code
that forges the manager's search request, with any arguments, gets only its allow-list's tools,
and their scores are those of an index of its own tools alone (nothing leaks through the
ranking's statistics). Both backends."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kernelmode.tools.base import ToolInfo
from kernelmode.tools.search import ToolSearch
from tests.conftest import Server, start_server
from tests.security.conftest import report

CONFIG = """
tools:
  - {name: add, function: "tests.integration.host_tools:add"}
  - {name: weather, function: "tests.integration.host_tools:weather"}
  - {name: fail, function: "tests.integration.host_tools:fail"}
"""

# Forge the preamble's request by hand, bypassing tools.search (and its argument checks).
FORGE = """
import json, sys
kernel = get_ipython().kernel
mod = sys.modules['kernelmode_preamble']
def forge(arguments):
    raw = type(kernel).raw_input(kernel, mod.MARKER + json.dumps({"id": "f" * 32, "tool": mod.SEARCH,
                                                                  "arguments": arguments}))
    return json.loads(raw)
out = {
    "plain": forge({"query": "weather forecast for a city, add numbers, fail", "limit": 50}),
    "extra": forge({"query": "weather", "limit": 50, "allow": None, "tools": ["weather"], "session_id": "x"}),
    "big": forge({"query": "weather", "limit": 10000}),
    "search": [m["name"] for m in tools.search("weather in a city", limit=50)],
    "modules": sorted(n for n in sys.modules if n == "tools" or n.startswith("tools.")),
    "dir": dir(tools),
}
try:
    import tools.weather
    out["import"] = "imported"
except ImportError:
    out["import"] = "refused"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("cfg") / "kernelmode.yaml"
    cfg.write_text(CONFIG)
    server = start_server(args=["--config", str(cfg)])
    yield server
    server.stop()


def test_forged_searches_see_only_the_allowed_tools(srv: Server) -> None:
    with srv.client() as api:
        sid = api.post("/v1/sessions", json={"tools": ["add"]}).json()["session_id"]
        try:
            r = api.post(f"/v1/sessions/{sid}/execute", json={"code": FORGE, "timeout_seconds": 60})
            out = report(r.json())
            infos = [ToolInfo(**t) for t in api.get("/v1/tools").json()["tools"]]
        finally:
            api.delete(f"/v1/sessions/{sid}")
    plain, extra = out["plain"], out["extra"]
    assert plain["ok"] and [m["name"] for m in plain["result"]] == ["add"]
    assert extra["ok"] and extra["result"] == []  # "weather" matches nothing this session may call
    assert not out["big"]["ok"] and "limit" in out["big"]["error"]
    assert out["search"] == [] and out["dir"] == ["add"] and out["import"] == "refused"
    assert out["modules"] == ["tools"]
    # The score is that of an index of the allowed tool alone: the others left no trace in it.
    alone = ToolSearch().search([i for i in infos if i.name == "add"],
                                "weather forecast for a city, add numbers, fail", 50)
    assert plain["result"][0]["score"] == alone[0].score


def test_rest_search_is_behind_the_token(srv: Server) -> None:
    r = httpx.get(srv.url + "/v1/tools", params={"q": "weather"})
    assert r.status_code == 401
    assert "weather" not in r.text
