"""The package's import graph has no cycles: each room imports only rooms below it.

The graph is built from the source with ``ast`` (nothing is imported): an edge for every import
statement, at module level or deferred into a function (a deferred import still ties the two
modules together), but not in ``if TYPE_CHECKING:`` blocks: those are for the type checker only,
the way to name a type of a room above without importing it (the MCP SDK's
``streamable_http_manager`` does so for its server).
"""

from __future__ import annotations

import ast
import re
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


# -- one package per process ------------------------------------------------------------------
# kernelmode runs in four kinds of process. The manager (`kernelmode serve`: everything not named
# below). The Kernel Gateway, which loads gateway_ext/ (its config file names the classes) and the
# sandbox provisioners (entry points). The kernel launchers, scripts run by path with `python -I`.
# And the kernels, which get kernel/'s modules as source. What two of them share lives in the
# shared rooms: the protocol, the errors, the value models and the sandbox's pure helpers.
SHARED = frozenset({
    "kernelmode", "kernelmode.errors", "kernelmode.heap", "kernelmode.models",
    "kernelmode.tools", "kernelmode.tools.base",  # models' ToolInfo
    "kernelmode.protocol", "kernelmode.protocol.frames",
    "kernelmode.sandbox", "kernelmode.sandbox.spec", "kernelmode.sandbox.seccomp",
    "kernelmode.sandbox.uids", "kernelmode.sandbox.cgroups", "kernelmode.sandbox.bwrap_command",
    "kernelmode.sandbox.docker_engine", "kernelmode.sandbox.egress",  # the kernels' egress dirs
    "kernelmode.egress", "kernelmode.egress.patterns",  # models' egress host patterns
})
LAUNCHERS = frozenset({"kernelmode.sandbox.launcher", "kernelmode.sandbox.docker_launcher",
                       "kernelmode.sandbox.egress_bridge"})  # the sandbox's first process
GATEWAY_CONFIG = "kernelmode.gateway_ext.config.kernel_gateway_config"
_NAMED_CLASS = re.compile(r"[\"'](kernelmode(?:\.\w+)+)[\"']")


def provisioner_modules() -> set[str]:
    """The modules the gateway finds through kernelmode's provisioner entry points."""
    text = (PACKAGE.parent / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    section = text.split('[project.entry-points."jupyter_client.kernel_provisioners"]')[1].split("\n[")[0]
    return set(re.findall(r'^[\w-]+ = "([\w.]+):\w+"', section, re.MULTILINE))


def gateway_roots(graph: dict[str, set[str]]) -> set[str]:
    """What the Kernel Gateway process is made to import: gateway_ext/, the classes its config
    file names by string, and the provisioners."""
    named = set()
    for dotted in _NAMED_CLASS.findall((PACKAGE / "gateway_ext" / "config" / "kernel_gateway_config.py").read_text()):
        named.add(max((m for m in graph if dotted == m or dotted.startswith(m + ".")), key=len))
    return {m for m in graph if m.startswith("kernelmode.gateway_ext")} | named | provisioner_modules()


def loaded_with(graph: dict[str, set[str]], roots: set[str]) -> dict[str, list[str]]:
    """Every module importing ``roots`` loads (their packages' __init__ too), each with the chain
    of imports that brings it in."""
    chains: dict[str, list[str]] = {r: [r] for r in roots}
    todo = sorted(roots)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for nxt in sorted(graph.get(name, set()) | {".".join(parts[:i]) for i in range(1, len(parts))}):
            if nxt in graph and nxt not in chains:
                chains[nxt] = [*chains[name], nxt]
                todo.append(nxt)
    return chains


def process_violations(graph: dict[str, set[str]], gateway_side: set[str],
                       runtime: dict[str, set[str]] | None = None) -> list[str]:
    """The imports that cross a process boundary, each as a sentence (empty: none). ``graph``
    names TYPE_CHECKING imports too (a name that crosses is a dependency on the other process's
    code); what the gateway process loads is followed in ``runtime`` (default: ``graph``), the
    imports that run (the package root names its lazy attributes for the type checker only)."""
    found = []
    kernel_side = {m for m in graph if m == "kernelmode.kernel" or m.startswith("kernelmode.kernel.")}
    for name in sorted(kernel_side | LAUNCHERS):
        if graph.get(name):  # sent into kernels as source / run by path with -I: no kernelmode there
            found.append(f"{name} runs outside kernelmode's package yet imports {sorted(graph[name])}")
    for name, chain in sorted(loaded_with(runtime or graph, gateway_side).items()):
        if name not in gateway_side | SHARED | LAUNCHERS:
            found.append(f"the gateway process loads the manager's {name}: {' -> '.join(chain)}")
    for name in sorted(SHARED):
        if bad := sorted((runtime or graph).get(name, set()) - SHARED - LAUNCHERS):
            found.append(f"shared {name} imports {bad}: the other process would load them")
    manager = set(graph) - gateway_side - SHARED - LAUNCHERS - kernel_side
    for name in sorted(manager):
        if bad := sorted(graph[name] & (gateway_side | kernel_side)):
            found.append(f"the manager's {name} imports {bad} of another process")
    return found


def test_the_process_map_sees_the_package() -> None:
    graph = import_graph(type_checking=True)
    gateway_side = gateway_roots(graph) | {"kernelmode.sandbox.base"}
    assert {"kernelmode.sandbox.bwrap", "kernelmode.sandbox.local", "kernelmode.sandbox.docker_backend",
            "kernelmode.gateway_ext.kg_extensions", "kernelmode.gateway_ext.ws_batch", GATEWAY_CONFIG} <= gateway_side
    assert SHARED | LAUNCHERS <= set(graph)
    chains = loaded_with(graph, {"kernelmode.sandbox.bwrap"})
    assert chains["kernelmode.protocol"] == ["kernelmode.sandbox.bwrap", "kernelmode.protocol"]
    assert "kernelmode.sandbox" in chains  # a package's __init__ runs before its modules


def test_a_crossing_of_each_kind_is_caught() -> None:
    graph = {"kernelmode": set(), "kernelmode.errors": set(), "kernelmode.sessions": set(),
             "kernelmode.sessions.manager": {"kernelmode.errors"}, "kernelmode.gateway_ext": set(),
             "kernelmode.gateway_ext.kg_extensions": {"kernelmode.errors"}, "kernelmode.kernel": set(),
             "kernelmode.kernel.preamble": set(), "kernelmode.api": set(), "kernelmode.api.handlers": set()}
    gateway_side = {"kernelmode.gateway_ext", "kernelmode.gateway_ext.kg_extensions"}
    assert process_violations(graph, gateway_side) == []
    graph["kernelmode.gateway_ext.kg_extensions"].add("kernelmode.sessions.manager")
    graph["kernelmode.api.handlers"] |= {"kernelmode.gateway_ext.kg_extensions", "kernelmode.kernel.preamble"}
    graph["kernelmode.kernel.preamble"].add("kernelmode.errors")
    assert process_violations(graph, gateway_side) == [
        "kernelmode.kernel.preamble runs outside kernelmode's package yet imports ['kernelmode.errors']",
        "the gateway process loads the manager's kernelmode.sessions: "
        "kernelmode.gateway_ext.kg_extensions -> kernelmode.sessions.manager -> kernelmode.sessions",
        "the gateway process loads the manager's kernelmode.sessions.manager: "
        "kernelmode.gateway_ext.kg_extensions -> kernelmode.sessions.manager",
        "the manager's kernelmode.api.handlers imports ['kernelmode.gateway_ext.kg_extensions', "
        "'kernelmode.kernel.preamble'] of another process",
    ]


def test_no_import_crosses_a_process_boundary() -> None:
    """In-kernel code and the launchers import nothing of kernelmode; what the gateway process
    loads is gateway_ext/, the provisioners and the shared rooms, never a room of the manager's
    (sessions, api, mcp, server, the gateway client...); the manager imports neither gateway_ext/
    nor a provisioner nor kernel/ (whose modules it sends into kernels as files), not even for the
    type checker."""
    graph = import_graph(type_checking=True)
    violations = process_violations(graph, gateway_roots(graph) | {"kernelmode.sandbox.base"}, import_graph())
    assert not violations, "\n".join(violations)


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
