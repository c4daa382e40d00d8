"""The package's import graph has no cycles: each room imports only rooms below it.

The graph is built from the source with ``ast`` (nothing is imported): an edge for every import
statement, at module level or deferred into a function (a deferred import still ties the two
modules together), but not in ``if TYPE_CHECKING:`` blocks: those are for the type checker only,
the way to name a type of a room above without importing it (the MCP SDK's
``streamable_http_manager`` does so for its server).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kernelmode"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``body``, nested ones too (in functions, if/try blocks), but not
    those of ``if TYPE_CHECKING:`` blocks unless ``type_checking``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            found += _imports(node.orelse)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                found += _imports([child], type_checking)
            elif isinstance(child, ast.ExceptHandler):
                found += _imports(child.body, type_checking)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the kernelmode modules it imports (TYPE_CHECKING blocks aside unless asked)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)).body, type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "kernelmode.server" in graph and "kernelmode.mcp.app" in graph
    assert "kernelmode.errors" in graph["kernelmode.api.handlers"]  # relative imports resolved
    assert "kernelmode.sessions" in graph["kernelmode.server"]
    assert "kernelmode.mcp.http" in graph["kernelmode.server"]  # deferred into a function: still an edge


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernelmode_has_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_kernel_side_imports_nothing_of_kernelmode() -> None:
    """Code sent into kernels runs where kernelmode may not be installed."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("kernelmode.kernel"):
            assert not edges, f"{name} imports {sorted(edges)}"


def test_front_doors_never_name_the_app() -> None:
    """REST, MCP and the console get ``Services`` passed in: none imports server.py, not even
    for the type checker (that import made the cycle server -> mcp -> server)."""
    graph = import_graph(type_checking=True)
    doors = [m for m in graph if m.startswith(("kernelmode.api", "kernelmode.mcp", "kernelmode.console"))]
    assert "kernelmode.mcp.tools" in doors
    for door in doors:
        # stdio.py starts the embedded service: it is a caller of server.running, not a door of it.
        if door != "kernelmode.mcp.stdio":
            assert "kernelmode.server" not in graph[door], door
    assert "kernelmode.server" not in graph["kernelmode.services"]


def test_the_core_imports_no_front_door() -> None:
    """sessions/ is what every front door calls: none of its rooms names a door, the app or the
    client, not even for the type checker; a room that needs the manager gets it passed in and
    names its type under TYPE_CHECKING only (forks, lifecycle, console_tap)."""
    doors = ("kernelmode.api", "kernelmode.mcp", "kernelmode.console", "kernelmode.client",
             "kernelmode.server", "kernelmode.cli")
    graph, runtime = import_graph(type_checking=True), import_graph()
    rooms = [m for m in graph if m.startswith("kernelmode.sessions.")]
    assert "kernelmode.sessions.listing" in rooms and "kernelmode.sessions.forks" in rooms
    for room in rooms:
        assert not [t for t in graph[room] if t.startswith(doors)], room
        if room != "kernelmode.sessions.manager":
            assert "kernelmode.sessions.manager" not in runtime[room], room


REPO = PACKAGE.parent
BENCH_SCRIPTS = {p.stem for p in (REPO / "bench").glob("*.py")}  # scripts import each other: `import harness`


def _top_imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (relative imports and TYPE_CHECKING ones too)."""
    names: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path)).body, type_checking=True):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _is_support(name: str) -> bool:
    return name == "tests.support" or name.startswith("tests.support.")


def test_bench_imports_only_the_support_package_of_tests() -> None:
    """bench/ shares tests/support with the tests, and nothing else of tests/ (a benchmark that
    imported a test module ran its fixtures' module code and broke when a test was renamed)."""
    files = [p for p in (REPO / "bench").rglob("*.py")]
    assert any(p.name == "servers.py" for p in files)
    for path in files:
        bad = sorted(n for n in _top_imports(path)
                     if (n == "tests" or n.startswith("tests.")) and not _is_support(n))
        assert not bad, f"{path.relative_to(REPO)} imports {bad}: move what it needs to tests/support"


def test_tests_import_nothing_of_bench() -> None:
    """The tests never import a benchmark (neither ``bench.x`` nor a script's ``import harness``);
    what both need lives in tests/support, the benchmarks' own tests in bench/selftest."""
    assert {"harness", "servers"} <= BENCH_SCRIPTS
    for path in (REPO / "tests").rglob("*.py"):
        bad = sorted(n for n in _top_imports(path)
                     if n.split(".")[0] == "bench" or (n.split(".")[0] in BENCH_SCRIPTS and "." not in n))
        assert not bad, f"{path.relative_to(REPO)} imports {bad} of bench/"


def test_the_support_package_imports_no_test_module() -> None:
    """tests/support is what bench/ may import: it must not pull test modules or conftest in."""
    support = REPO / "tests" / "support"
    assert (support / "server.py").is_file()
    for path in support.rglob("*.py"):
        bad = sorted(n for n in _top_imports(path) if n.startswith("tests.") and not _is_support(n))
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"
