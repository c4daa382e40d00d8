"""The kernel-side preamble on its own (stdlib only), with a stand-in for the stdin channel."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kernelmode.kernel import preamble
from kernelmode.sessions.boot import boot_code

SPECS = [
    {"name": "add", "description": "Add.", "signature": "add(a: int, b: int = 0) -> int",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer", "default": 0}},
                    "required": ["a"]}},
    {"name": "gh.list_commits", "description": "Commits.", "signature": "list_commits(repo: str)",
     "parameters": {"type": "object", "properties": {"repo": {"type": "string"}}, "required": ["repo"]}},
]


class Channel:
    """Answers requests like the manager's broker would, and remembers them."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, prompt: str) -> str:
        assert prompt.startswith(preamble.MARKER)
        req = json.loads(prompt[len(preamble.MARKER):])
        self.requests.append(req)
        if req["tool"] == "add":
            return json.dumps({"id": req["id"], "ok": True, "result": sum(req["arguments"].values())})
        return json.dumps({"id": req["id"], "ok": False, "error": "no such repo"})


def test_calls_map_positional_arguments_in_order():
    ch = Channel()
    tools = preamble.build(SPECS, ch)
    assert tools.add(1, b=2) == 3
    assert tools["add"](5) == 5
    assert ch.requests[0]["arguments"] == {"a": 1, "b": 2}
    with pytest.raises(TypeError, match="multiple values"):
        tools.add(1, a=2)
    with pytest.raises(TypeError, match="takes 2 positional"):
        tools.add(1, 2, 3)


def test_namespaces_errors_and_listing():
    tools = preamble.build(SPECS, Channel())
    with pytest.raises(preamble.ToolError, match="gh.list_commits: no such repo"):
        tools.gh.list_commits("x/y")
    assert tools["gh.list_commits"] is tools.gh.list_commits
    assert dir(tools) == ["add", "gh"] and dir(tools.gh) == ["list_commits"]
    with pytest.raises(preamble.UnknownToolError, match="unknown tool 'nope'"):
        _ = tools.nope
    with pytest.raises(AttributeError):
        _ = tools.gh.nope
    assert "tools.add(a: int, b: int = 0) -> int" in tools._help_text()
    assert "Commits." in tools._help_text()
    assert str(__import__("inspect").signature(tools.add)) == "(a: int, b: int = 0)"  # typed (issue 17)


def test_a_reply_for_another_call_is_refused():
    tools = preamble.build(SPECS, lambda prompt: json.dumps({"id": "other", "ok": True, "result": 1}))
    with pytest.raises(preamble.ToolError, match="does not match"):
        tools.add(1)


def test_no_input_is_an_eof_error():
    with pytest.raises(EOFError, match="no interactive input"):
        preamble._no_input("name? ")


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(Path(preamble.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= {"__future__", "inspect", "json", "threading", "uuid", "typing", "sys", "types", "os",
                        "importlib"}


def test_boot_code_carries_data_as_literals():
    tricky = [{**SPECS[0], "description": "'''\"\"\"\\n); import os; os._exit(1) #"}]
    code = boot_code(tricky)
    ast.parse(code)  # valid Python whatever the data holds
    call = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
            and getattr(n.func, "id", "") == "__kernelmode_boot"][0]
    assert json.loads(call.args[1].value) == tricky
