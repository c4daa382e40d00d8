"""Typed tool modules on the kernel side (the preamble alone, stdlib only): ``from tools.gh import
list_commits``, signatures and docstrings from the JSON schemas, ``help()``, ``tools.search``."""

from __future__ import annotations

import inspect
import json
import pydoc
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kernelmode.kernel import preamble

SPECS: list[dict[str, Any]] = [
    {"name": "add", "description": "Add two integers.", "signature": "add(a: int, b: int = 0)",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer", "default": 0}},
                    "required": ["a"]}},
    {"name": "gh.list_commits", "description": "List the commits of a branch.",
     "signature": "list_commits(owner: str, repo: str, sha: str | None = None, per_page: int = 30)",
     "parameters": {"type": "object", "required": ["owner", "repo"], "properties": {
         "owner": {"type": "string", "description": "Repository owner"},
         "repo": {"type": "string", "description": "Repository name"},
         "sha": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
         "per_page": {"type": "integer", "default": 30},
         "state": {"type": "string", "enum": ["open", "closed"], "default": "open"},
         "labels": {"type": "array", "items": {"type": "string"}},
         "opts": {"$ref": "#/$defs/Opts"}},
         "$defs": {"Opts": {"type": "object"}}}},
    {"name": "gh.create_issue", "description": "Open an issue.", "signature": "create_issue(title: str)",
     "parameters": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}},
]


class Channel:
    """The manager's side: echoes calls, answers searches with a fixed list."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def __call__(self, prompt: str) -> str:
        req = json.loads(prompt[len(preamble.MARKER):])
        self.requests.append(req)
        if req["tool"] == preamble.SEARCH:
            return json.dumps({"id": req["id"], "ok": True, "result": [
                {"name": "gh.list_commits", "description": "List the commits of a branch.",
                 "signature": "list_commits(owner: str, repo: str)", "score": 3.2}]})
        return json.dumps({"id": req["id"], "ok": True, "result": [req["tool"], req["arguments"]]})


@pytest.fixture()
def tools() -> Iterator[preamble.Tools]:
    before = set(sys.modules)
    t = preamble.build(SPECS, Channel())
    preamble.register_modules(t)
    yield t
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_groups_import_like_modules(tools: preamble.Tools) -> None:
    import tools as imported  # type: ignore[import-not-found]
    from tools.gh import list_commits  # type: ignore[import-not-found]

    assert imported is tools and list_commits is tools.gh.list_commits
    assert list_commits("me", "repo", per_page=5) == ["gh.list_commits", {"owner": "me", "repo": "repo", "per_page": 5}]
    assert tools.add(1) == ["add", {"a": 1}]  # tools.NAME(...) as before
    with pytest.raises(ImportError):
        exec("from tools.gh import nope", {})


def test_signatures_and_docstrings_come_from_the_schema(tools: preamble.Tools) -> None:
    sig = str(inspect.signature(tools.gh.list_commits))
    assert sig.startswith("(owner: str, repo: str, sha: str | None = None, per_page: int = 30, "
                          "state: Literal['open', 'closed'] = 'open', labels: list[str] = None")
    assert "opts: dict = None" in sig
    doc = tools.gh.list_commits.__doc__
    assert doc.startswith("List the commits of a branch.")
    assert "owner (str, required): Repository owner" in doc and "per_page (int, default 30)" in doc


def test_help_of_a_group_lists_its_functions(tools: preamble.Tools) -> None:
    text = pydoc.render_doc(tools.gh, renderer=pydoc.plaintext)
    assert "tools.gh" in text and "list_commits(owner: str, repo: str" in text
    assert "create_issue(title: str)" in text and "Repository owner" in text
    assert "add(a: int, b: int = 0)" in pydoc.render_doc(tools, renderer=pydoc.plaintext)


def test_search_asks_the_manager_and_displays_the_calls(tools: preamble.Tools) -> None:
    found = tools.search("recent commits", limit=3)
    req = tools.__dict__["_bridge"]._raw_input.requests[-1]
    assert req["tool"] == preamble.SEARCH and req["arguments"] == {"query": "recent commits", "limit": 3}
    assert found[0]["name"] == "gh.list_commits"
    assert repr(found).startswith("tools.gh.list_commits(owner: str, repo: str)")
    with pytest.raises(TypeError):
        tools.search("  ")


def test_a_tool_named_search_keeps_its_name() -> None:
    spec = {"name": "search.web", "description": "Search the web.", "parameters": {}}
    t = preamble.build([spec], Channel())
    assert t.search.web() == ["search.web", {}]
    assert isinstance(t.search, preamble._Group)
    assert t.search_tools("web")[0]["score"] == 3.2


def test_positional_arguments_follow_the_signature_not_the_schema_order() -> None:
    spec = {"name": "gh.list_commits", "parameters": {"type": "object", "required": ["owner", "repo"],
            "properties": {"author": {"type": "string"}, "owner": {"type": "string"}, "repo": {"type": "string"}}}}
    t = preamble.build([spec], Channel())
    assert str(inspect.signature(t.gh.list_commits)) == "(owner: str, repo: str, author: str = None)"
    assert t.gh.list_commits("me", "r") == ["gh.list_commits", {"owner": "me", "repo": "r"}]


@pytest.mark.parametrize("schema", [
    {"type": ["string", "integer", "null"]}, {"anyOf": [{"enum": ["a", 1]}, {"type": "array", "items": {"anyOf": []}}]},
    {"$ref": "#/nowhere"}, {"enum": [{"x": 1}]}, {"type": 5}, {"oneOf": "no"}, {"$ref": "#/$defs/Self"},
    {"items": {"type": "string"}, "type": "array"}, {"allOf": [{"type": "string"}]}, "not a schema", True])
def test_any_schema_gives_a_signature(schema: Any) -> None:
    spec = {"name": "t", "parameters": {"type": "object", "properties": {"p": schema},
                                        "$defs": {"Self": {"$ref": "#/$defs/Self"}}}}
    t = preamble.build([spec], Channel())
    assert list(inspect.signature(t.t).parameters) == ["p"] and t.t.__doc__


def test_parameters_that_are_not_python_names_are_keyword_only_through_kwargs() -> None:
    spec = {"name": "mail", "parameters": {"type": "object", "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}, "x-y": {"type": "string"}}}}
    t = preamble.build([spec], Channel())
    assert str(inspect.signature(t.mail)) == "(to: str)"
    assert t.mail("b", **{"from": "a"}) == ["mail", {"to": "b", "from": "a"}]


def test_a_refused_search_names_tools_search() -> None:
    def refuse(prompt: str) -> str:
        req = json.loads(prompt[len(preamble.MARKER):])
        return json.dumps({"id": req["id"], "ok": False, "error": "limit must be an integer from 1 to 50"})

    t = preamble.build(SPECS, refuse)
    with pytest.raises(preamble.ToolError, match=r"^tools.search: limit must be"):
        t.search("x", limit=99)


def test_properties_that_are_not_a_mapping_give_no_parameters() -> None:
    t = preamble.build([{"name": "odd", "description": "Odd.", "parameters": {"properties": ["a"], "required": 3}}],
                       Channel())
    assert str(inspect.signature(t.odd)) == "()" and t.odd.__doc__ == "Odd."
