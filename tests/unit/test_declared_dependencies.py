"""Every third-party package that kernelmode imports is declared in pyproject.toml (issue 28: httpx2
and mcp_types were imported but came only by way of the mcp package). Code that runs inside
kernels (kernelmode/kernel/) is left out: its packages are the kernel environment's
(kernel-image/requirements.txt)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
IN_KERNEL = ROOT / "kernelmode" / "kernel"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_norm(re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0]) for r in requirements}


def test_every_imported_package_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"])
    extras = _names([r for reqs in project["optional-dependencies"].values() for r in reqs])
    dists = importlib.metadata.packages_distributions()
    missing: dict[str, set[str]] = {}
    for path in (ROOT / "kernelmode").rglob("*.py"):
        if IN_KERNEL in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "kernelmode":
                    continue
                # an adapter's framework is an extra (kernelmode.adapters), imported only there
                allowed = declared | extras if "adapters" in path.parts else declared
                for dist in dists.get(top, [top]):
                    if _norm(dist) not in allowed:
                        missing.setdefault(dist, set()).add(str(path.relative_to(ROOT)))
    assert missing == {}, f"imported but not declared in pyproject.toml: {missing}"
