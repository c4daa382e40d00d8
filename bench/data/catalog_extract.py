"""Tool definitions out of an MCP server's source, for build_tool_catalog.py (stdin -> JSON).

``ts``: each object literal with ``name``, ``description`` and ``inputSchema`` (TypeScript
``Tool`` constants), evaluated by node. ``py``: each ``Tool(...)`` call, its keywords evaluated
with the module's own classes (pydantic models, enums) defined.
"""

from __future__ import annotations

import ast
import enum
import json
import subprocess
import sys
import types
import typing
from typing import Any

import pydantic


def _literal_at(src: str, start: int) -> str | None:
    depth, i, quote = 0, start, None
    while i < len(src):
        c = src[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return src[start:i + 1]
        i += 1
    return None


def _enclosing_open(src: str, pos: int) -> int:
    depth = 0
    for i in range(pos, -1, -1):
        if src[i] == "}":
            depth += 1
        elif src[i] == "{":
            if depth == 0:
                return i
            depth -= 1
    return -1


def from_ts(src: str) -> list[dict[str, Any]]:
    import re

    literals, seen = [], set()
    for m in re.finditer(r"\bname:\s*[\"']([\w\-]+)[\"']", src):
        o = _enclosing_open(src, m.start())
        if o < 0 or o in seen:
            continue
        lit = _literal_at(src, o)
        if lit and "inputSchema" in lit and "description" in lit:
            seen.add(o)
            literals.append(lit)
    js = ("const out=[];for(const t of " + json.dumps(literals) + "){try{const v=(new Function("
          "'return ('+t+')'))();if(v&&v.name&&v.inputSchema)out.push({name:v.name,description:"
          "v.description||'',inputSchema:v.inputSchema});}catch(e){}}console.log(JSON.stringify(out));")
    return json.loads(subprocess.run(["node", "-e", js], capture_output=True, text=True, check=True).stdout)


def from_py(src: str) -> list[dict[str, Any]]:
    tree = ast.parse(src)
    ns: dict[str, Any] = {"BaseModel": pydantic.BaseModel, "Field": pydantic.Field, "Enum": enum.Enum,
                          "StrEnum": enum.StrEnum, "Optional": typing.Optional, "List": list,
                          "Literal": typing.Literal, "Any": typing.Any, "Annotated": typing.Annotated,
                          "AnyUrl": pydantic.AnyUrl, "types": types.SimpleNamespace(), "local_tz": "UTC"}
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.Assign):
            try:
                exec(compile(ast.Module([node], []), "<src>", "exec"), ns)
            except Exception:  # a definition that needs what is not here: not a tool's
                pass
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "Tool":
            kw: dict[str, Any] = {}
            for k in node.keywords:
                try:
                    kw[str(k.arg)] = eval(compile(ast.Expression(k.value), "<kw>", "eval"), ns)
                except Exception:
                    kw[str(k.arg)] = None
            name = kw.get("name")
            name = name.value if isinstance(name, enum.Enum) else name
            schema = kw.get("inputSchema")
            if isinstance(name, str) and isinstance(schema, dict):
                out.append({"name": name, "description": kw.get("description") or "", "inputSchema": schema})
    return out


if __name__ == "__main__":
    print(json.dumps(from_py(sys.stdin.read()) if sys.argv[1] == "py" else from_ts(sys.stdin.read())))
