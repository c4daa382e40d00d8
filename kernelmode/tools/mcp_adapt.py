"""What an upstream MCP tool becomes in kernelmode: a Tool with a Python-like signature, and
plain data for its results; no I/O here (the connection is :mod:`kernelmode.tools.mcp_upstream`).

Call results become plain data (:func:`call_result_to_data`):

* ``structured_content`` when the server gives it; MCPServer/FastMCP wrap a plain return value
  (``-> int``, ``-> str``, ``-> list[...]``...) as ``{"result": value}``, which is unwrapped
  to ``value`` when ``result`` is the only key (and the tool's output schema, if it has one,
  declares exactly that one property);
* otherwise the content list: no item -> ``None``; one item -> that item; several -> a list.
  Text is its ``str`` (never JSON-decoded, even if it looks like JSON); images and audio are
  ``{"type": "image"|"audio", "mime_type": ..., "data": <base64 str>}``; embedded resources
  ``{"type": "resource", "uri": ..., "mime_type": ..., "text"|"blob": ...}``; resource links
  ``{"type": "resource_link", "uri": ..., "name": ..., "mime_type": ..., "description": ...}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcp_types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
)
from mcp_types import Tool as McpTool

from kernelmode.tools.base import ToolInfo

if TYPE_CHECKING:  # the server makes its tools; only its type is needed here
    from kernelmode.tools.mcp_upstream import UpstreamMcpServer

__all__ = ["UpstreamTool", "call_result_to_data", "error_text", "schema_signature"]


class UpstreamTool:
    """One tool of an upstream MCP server, implementing the ``Tool`` protocol."""

    def __init__(self, server: UpstreamMcpServer, tool: McpTool) -> None:
        self.server = server
        self.upstream_name = tool.name
        self.output_schema: dict[str, Any] | None = tool.output_schema
        schema = dict(tool.input_schema)
        self.info = ToolInfo(
            name=f"{server.name}.{tool.name}",
            namespace=server.name,
            description=tool.description or "",
            parameters=schema,
            signature=schema_signature(tool.name, schema),
        )

    async def call(self, arguments: dict[str, Any], timeout: float) -> Any:  # noqa: ASYNC109
        return await self.server.call_tool(
            self.upstream_name, arguments, timeout, output_schema=self.output_schema
        )

    def __repr__(self) -> str:
        return f"<UpstreamTool {self.info.name}>"


# --------------------------------------------------------------------------- signatures

_JSON_TO_PY = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "null": "None",
    "array": "list",
    "object": "dict",
}


def _resolve_ref(schema: dict[str, Any], root: dict[str, Any]) -> Any:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _union(parts: list[str]) -> str:
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    if "Any" in seen:
        return "Any"
    # `X | None` reads best with None last.
    seen.sort(key=lambda p: p == "None")
    return " | ".join(seen) if seen else "Any"


def _py_type(schema: Any, root: dict[str, Any], depth: int = 0) -> str:
    """A Python-like type name for a JSON Schema (best effort, for humans and models)."""
    if depth > 8 or not isinstance(schema, dict):
        return "Any"
    if "$ref" in schema:
        return _py_type(_resolve_ref(schema, root), root, depth + 1)
    if "const" in schema:
        return f"Literal[{schema['const']!r}]"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "Literal[" + ", ".join(repr(v) for v in enum) + "]"
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _union([_py_type(o, root, depth + 1) for o in options])
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1:
        return _py_type(all_of[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([_py_type({**schema, "type": k}, root, depth + 1) for k in kind])
    if kind == "array":
        items = schema.get("items")
        if isinstance(items, dict) and items:
            return f"list[{_py_type(items, root, depth + 1)}]"
        return "list"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra and not schema.get("properties"):
            return f"dict[str, {_py_type(extra, root, depth + 1)}]"
        return "dict"
    if isinstance(kind, str):
        return _JSON_TO_PY.get(kind, "Any")
    return "Any"


def schema_signature(name: str, schema: dict[str, Any]) -> str:
    """A Python-like signature for a tool taking keyword arguments described by ``schema``.

    Required parameters come first (in schema order), then optional ones with ``= default``
    (the JSON default as a Python literal) or ``= None``. E.g.
    ``list_commits(repo: str, limit: int = 10, branch: str | None = None)``.
    """
    props = schema.get("properties")
    properties: dict[str, Any] = props if isinstance(props, dict) else {}
    req = schema.get("required")
    required = [r for r in req if isinstance(r, str)] if isinstance(req, list) else []
    params: list[str] = []
    for pname in [*(p for p in properties if p in required), *(r for r in required if r not in properties)]:
        params.append(f"{pname}: {_py_type(properties.get(pname), schema)}")
    for pname, pschema in properties.items():
        if pname in required:
            continue
        default = pschema.get("default") if isinstance(pschema, dict) else None
        params.append(f"{pname}: {_py_type(pschema, schema)} = {default!r}")
    return f"{name}({', '.join(params)})"


# --------------------------------------------------------------------------- results


def _content_to_data(item: Any) -> Any:
    if isinstance(item, TextContent):
        return item.text
    if isinstance(item, ImageContent | AudioContent):
        return {"type": item.type, "mime_type": item.mime_type, "data": item.data}
    if isinstance(item, EmbeddedResource):
        res = item.resource
        out: dict[str, Any] = {"type": "resource", "uri": str(res.uri), "mime_type": res.mime_type}
        if isinstance(res, BlobResourceContents):
            out["blob"] = res.blob
        else:
            out["text"] = res.text
        return out
    if isinstance(item, ResourceLink):
        return {
            "type": "resource_link",
            "uri": str(item.uri),
            "name": item.name,
            "mime_type": item.mime_type,
            "description": item.description,
        }
    if hasattr(item, "model_dump"):  # a content type newer than this code
        return item.model_dump(mode="json", exclude_none=True)
    return item


def _is_result_wrapper(output_schema: dict[str, Any] | None) -> bool:
    if output_schema is None:
        return True
    props = output_schema.get("properties")
    return isinstance(props, dict) and set(props) == {"result"}


def call_result_to_data(result: CallToolResult, output_schema: dict[str, Any] | None = None) -> Any:
    """Plain data for a successful ``CallToolResult`` (the rules are in the module docstring)."""
    structured = result.structured_content
    if structured is not None:
        if isinstance(structured, dict) and set(structured) == {"result"} and _is_result_wrapper(output_schema):
            return structured["result"]
        return structured
    items = [_content_to_data(c) for c in result.content]
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    return items


def error_text(result: CallToolResult) -> str:
    """The text of an ``is_error`` result (its text items, one per line)."""
    texts = [c.text for c in result.content if isinstance(c, TextContent) and c.text]
    return "\n".join(texts)
