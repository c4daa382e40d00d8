"""kernelmode uses only the public API of the MCP SDK and its HTTP client (issue 28): no attribute
whose name starts with ``_`` and that only mcp, mcp_types or httpx2 define is read, written or
looked up by name anywhere in kernelmode/. A private name of the SDK (``_server_instances``,
``_tool_manager``...) can change in any minor release and would break serving."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

KERNELMODE = Path(__file__).resolve().parents[2] / "kernelmode"
FOREIGN = ("mcp", "mcp_types", "httpx2")
_BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(root: Path, own_only: bool) -> set[str]:
    """The ``_`` names a tree defines: functions, classes, module and class-level names, and
    attributes set on ``self``/``cls`` (``own_only``: not those set on other objects)."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and (
                    not own_only or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def foreign_private_names() -> set[str]:
    names: set[str] = set()
    for pkg in FOREIGN:
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations, f"{pkg} is not installed"
        for location in spec.submodule_search_locations:
            names |= _defined(Path(location), own_only=False)
    return names - _defined(KERNELMODE, own_only=True)


def private_uses(source: str, forbidden: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of each use of a forbidden name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in forbidden:
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BY_NAME
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in forbidden):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.fixture(scope="module")
def forbidden() -> set[str]:
    names = foreign_private_names()
    # What the /mcp front door used to reach into: the scan must know these names.
    assert {"_server_instances", "_session_owners", "_tool_manager", "_lowlevel_server"} <= names
    return names


def test_the_scan_catches_reads_writes_and_lookups_by_name(forbidden: set[str]) -> None:
    source = ("a = m._server_instances\nt._requests_in_flight += 1\n"
              "getattr(t, '_idle_timeout', None)\nsrv._tool_manager.get_tool('x')\n")
    assert [line for line, _ in private_uses(source, forbidden)] == [1, 2, 3, 4]


def test_kernelmode_touches_no_private_name_of_mcp_or_httpx2(forbidden: set[str]) -> None:
    offences = [f"{path.relative_to(KERNELMODE.parent)}:{line}: {expr}"
                for path in sorted(KERNELMODE.rglob("*.py"))
                for line, expr in private_uses(path.read_text(encoding="utf-8"), forbidden)]
    assert offences == [], "private attributes of mcp/httpx2 used:\n" + "\n".join(offences)
