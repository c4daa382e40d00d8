"""tools/search.py: ranking by intent over real MCP servers' tools (bench/data), the quality bar
(recall@5 >= 0.9 on the labelled intents), allow-lists, re-indexing, and validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernelmode.errors import InvalidRequest
from kernelmode.tools.base import ToolInfo
from kernelmode.tools.mcp_adapt import schema_signature
from kernelmode.tools.registry import ToolRegistry
from kernelmode.tools.search import ToolSearch, check_query, tokens, tool_limit

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"


def catalog() -> list[ToolInfo]:
    servers = json.loads((DATA / "mcp_tools.json").read_text())["servers"]
    return [ToolInfo(name=f"{s['name']}.{t['name']}", namespace=s["name"], description=t["description"],
                     parameters=t["inputSchema"], signature=schema_signature(t["name"], t["inputSchema"]))
            for s in servers for t in s["tools"]]


def recall_at_5(part: str) -> float:
    infos, search = catalog(), ToolSearch()
    pairs = json.loads((DATA / "tool_intents.json").read_text())[part]
    hits = sum(bool(set(p["tools"]) & {m.name for m in search.search(infos, p["intent"], 5)}) for p in pairs)
    return hits / len(pairs)


def test_the_labelled_set_is_big_enough_and_names_real_tools() -> None:
    infos = catalog()
    names = {i.name for i in infos}
    doc = json.loads((DATA / "tool_intents.json").read_text())
    assert len(infos) >= 300 and len(doc["pairs"]) >= 100
    servers = json.loads((DATA / "mcp_tools.json").read_text())["servers"]
    assert all(s["source"] and "@" in s["source"] for s in servers)  # where each list came from
    for p in doc["pairs"] + doc["held_out"]:
        assert set(p["tools"]) <= names, p


def test_recall_at_5_stays_at_least_0_9() -> None:
    assert recall_at_5("pairs") >= 0.9


def test_held_out_intents_are_found_too() -> None:
    assert recall_at_5("held_out") >= 0.85  # written after the tuning: a looser bar, same order


def test_words_are_split_and_stemmed() -> None:
    assert tokens("listCommits get_file_contents HTTPServer") == ["list", "commit", "get", "file", "content",
                                                                   "http", "server"]
    assert tokens("Please show me the issues") == ["show", "issu"]


def test_answers_carry_name_one_line_description_signature_and_score() -> None:
    infos = catalog()
    top = ToolSearch().search(infos, "list the commits of a github repository", 3)
    assert top[0].name == "github.list_commits"
    assert top[0].signature.startswith("list_commits(owner: str, repo: str")
    assert "\n" not in top[0].description and top[0].description.startswith("Get list of commits")
    assert top[0].score >= top[1].score >= top[2].score > 0


def test_nothing_related_answers_nothing() -> None:
    assert ToolSearch().search(catalog(), "zzzqqq xyzzy", 5) == []


def info(name: str, description: str, **props: Any) -> ToolInfo:
    schema = {"type": "object", "properties": props}
    return ToolInfo(name=name, namespace=name.partition(".")[0] if "." in name else None,
                    description=description, parameters=schema, signature=schema_signature(name, schema))


def test_a_changed_tool_set_is_indexed_again() -> None:
    search = ToolSearch(keep=2)
    first = [info("a.send_mail", "Send an email."), info("a.add", "Add numbers.")]
    assert search.search(first, "send an email", 1)[0].name == "a.send_mail"
    second = [*first, info("b.post_message", "Post a message to a chat channel.")]
    assert search.search(second, "post to the chat", 1)[0].name == "b.post_message"
    for n in range(3):  # more sets than it keeps: the oldest goes
        search.search([info(f"t{n}", "x")], "x", 1)
    assert len(search._indexes) == 2


def test_registry_search_sees_only_the_allowed_tools() -> None:
    reg = ToolRegistry()

    @reg.register
    def delete_everything(really: bool) -> str:
        """Delete every file of the host."""
        return "gone"

    @reg.register
    def list_files(folder: str) -> list[str]:
        """List the files of a folder."""
        return []

    assert {m.name for m in reg.search("delete files", 5)} == {"delete_everything", "list_files"}
    assert [m.name for m in reg.search("delete files", 5, allow=["list_files"])] == ["list_files"]
    assert reg.search("delete files", 5, allow=[]) == []


@pytest.mark.parametrize(("query", "limit"), [("", 5), ("   ", 5), ("x" * 1001, 5), ("ok", 0), ("ok", 51),
                                              ("ok", True), ("ok", "5"), (None, 5), (3, 5)])
def test_bad_queries_and_limits_are_refused(query: Any, limit: Any) -> None:
    with pytest.raises(InvalidRequest):
        check_query(query, limit)


def test_limits_from_a_query_string() -> None:
    assert tool_limit(None) == 8 and tool_limit("3") == 3
    with pytest.raises(InvalidRequest, match="integer"):
        tool_limit("three")
