"""What a start imports: `kernelmode serve` and the stdio MCP server (`kernelmode mcp`, launched
by an MCP host on every start) load the service's modules before they answer, and each module
they load costs start time. Heavy libraries that only a later request needs are imported when
it comes (issue 33): tool search's bm25s, PyStemmer and numpy (~80 ms) at the first search; the
session layer, in the embedded `kernelmode mcp`, after ``initialize`` is answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LATER = ("numpy", "bm25s", "Stemmer")  # tools/search.py, at the first search


def _loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_a_start_does_not_import_what_only_a_search_needs() -> None:
    loaded = _loaded("import kernelmode.cli, kernelmode.embedded, kernelmode.mcp.stdio, kernelmode.server")
    assert not loaded & set(LATER), f"imported at start: {sorted(loaded & set(LATER))}"


def test_the_first_search_imports_them_and_ranks() -> None:
    loaded = _loaded(
        "from kernelmode.tools.base import ToolInfo\n"
        "from kernelmode.tools.search import ToolSearch\n"
        "infos = [ToolInfo(name='github.list_commits', description='List the commits of a repository.',"
        " signature='list_commits(repo)', namespace='github'),"
        " ToolInfo(name='mail.send', description='Send an email.', signature='send(to)', namespace='mail')]\n"
        "assert [m.name for m in ToolSearch().search(infos, 'commits of a repo')][:1] == ['github.list_commits']")
    assert set(LATER) <= loaded


def test_the_embedded_server_spawns_its_gateway_before_the_mcp_sdk_is_imported() -> None:
    """`kernelmode mcp` (embedded) starts the gateway child from early_start.py before anything
    imports the MCP SDK (~0.4 s): the gateway's start overlaps the imports that follow."""
    loaded = _loaded("import kernelmode.cli, kernelmode.embedded, kernelmode.early_start")
    assert not {m for m in loaded if m == "mcp" or m.startswith("mcp.")}, "the MCP SDK"
    assert not {m for m in loaded if m.startswith(("kernelmode.sessions", "kernelmode.server", "kernelmode.mcp."))}


def test_what_initialize_needs_does_not_import_the_session_layer() -> None:
    """The MCP server (tools, instructions) is made before the session layer is imported (~0.35 s,
    imported after initialize is answered)."""
    loaded = _loaded("import kernelmode.cli, kernelmode.embedded, kernelmode.mcp.app")
    heavy = {m for m in loaded if m.startswith(("kernelmode.sessions", "kernelmode.server", "kernelmode.api",
                                                 "kernelmode.gateway.client", "jupyter_client"))}
    assert not heavy, sorted(heavy)


def test_the_embedded_start_does_not_import_httpx() -> None:
    """httpx (~40 ms) forwards to other managers (api/forwarding.py, mcp/remote*.py): a single
    manager, as the embedded `kernelmode mcp` is, never needs it, so no start imports it."""
    loaded = _loaded("import kernelmode.cli, kernelmode.embedded, kernelmode.mcp.app, kernelmode.server")
    assert "httpx" not in loaded


def test_the_forwarding_module_imports_httpx_at_its_first_forwarder() -> None:
    """api/forwarding.py's one lazy accessor: importing the module costs no httpx; the first
    Forwarder imports it, and the module's name is the module from then on."""
    loaded = _loaded("import kernelmode.api.forwarding")
    assert "httpx" not in loaded
    loaded = _loaded("import types, kernelmode.api.forwarding as f\nf.Forwarder('m', 2)\n"
                     "assert isinstance(f.httpx, types.ModuleType)")
    assert "httpx" in loaded
