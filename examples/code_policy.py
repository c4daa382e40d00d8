"""An example code policy for kernelmode: ``policy: {module: "examples.code_policy:check"}``.

kernelmode calls ``check(code=..., session_id=..., tenant=...)`` before each run (REST, MCP,
and each cell sent over the console channel or the Jupyter API) and acts on the answer: ``"allow"``, ``("deny", reason)`` (the run ends as an error naming the
reason; the session is unaffected) or ``("ask", reason)`` (the run waits for a person's yes/no
through the approval gate: REST ``POST /v1/runs/{run_id}/approvals/{call_id}`` or an MCP
elicitation).

This one:
- refuses process spawning (``subprocess``, ``os.system``, ``os.popen``, ``os.exec*``,
  ``os.spawn*``, ``pty``) for the tenants in RESTRICTED_TENANTS;
- asks before code opens a file for writing at an absolute path outside /mnt/data.

A policy reads code, so it is a guard rail for well-meaning agents, not a security boundary:
code can always hide what it calls (``getattr(__import__("o" + "s"), ...)``). The sandbox is
the boundary (no network, no host files, limits); this hook is for house rules and audit.
"""

from __future__ import annotations

import ast

RESTRICTED_TENANTS = {"interns"}  # tenant names (server.tenants[].name); "admin" is the admin token
_SPAWNING_MODULES = {"subprocess", "pty", "multiprocessing"}
_SPAWNING_OS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"}
_WRITE_MODES = set("wax+")


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def spawns_processes(tree: ast.AST) -> str | None:
    """What in the code starts a process, if anything."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _SPAWNING_MODULES:
                    return f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _SPAWNING_MODULES:
            return f"from {node.module} import ..."
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in _SPAWNING_OS or alias.name.startswith(("exec", "spawn")):
                    return f"from os import {alias.name}"
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, attr = name.rpartition(".")
            if head == "os" and (attr in _SPAWNING_OS or attr.startswith(("exec", "spawn"))):
                return f"{name}()"
    return None


def writes_outside_workspace(tree: ast.AST) -> str | None:
    """An ``open(PATH, MODE)`` that writes to a literal absolute path outside /mnt/data."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _dotted(node.func) in ("open", "io.open", "builtins.open")):
            continue
        args = list(node.args)
        mode = args[1] if len(args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        path = args[0] if args else next((k.value for k in node.keywords if k.arg == "file"), None)
        if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str) and _WRITE_MODES & set(mode.value)):
            continue
        if isinstance(path, ast.Constant) and isinstance(path.value, str) and path.value.startswith("/") \
                and not (path.value + "/").startswith("/mnt/data/"):
            return path.value
    return None


def check(code: str, session_id: str, tenant: str) -> str | tuple[str, str]:
    """The policy: allow, deny (reason) or ask (reason)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "allow"  # the kernel reports the syntax error itself (IPython magics land here too)
    if tenant in RESTRICTED_TENANTS and (what := spawns_processes(tree)):
        return "deny", f"tenant {tenant} may not start processes ({what})"
    if (path := writes_outside_workspace(tree)) is not None:
        return "ask", f"writes to {path}, outside /mnt/data"
    return "allow"
