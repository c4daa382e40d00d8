"""Every MCP tool's errors come out one way (``tool_errors``, the one translation point): an
``isError`` result whose text is ``Error executing tool NAME: message`` and whose structured
content is the error as REST gives it, ``{"error": {"code", "message"}}``."""

from __future__ import annotations

from typing import Any

import pytest
from mcp_types import TextContent

from .conftest import Connect

GONE = "no-such-session-r2"
# (tool, arguments, the error's code, the start of its message)
FAILING_CALLS: list[tuple[str, dict[str, Any], str, str]] = [
    ("run_python", {"code": "1", "session_id": GONE}, "session_not_found", f"unknown session {GONE!r}"),
    ("get_run", {"run_id": "0" * 32}, "run_not_found", ""),
    ("upload_file", {"filename": "a.txt", "content_base64": "%%%"}, "invalid_request",
     "content_base64 is not valid base64"),
    ("list_files", {"session_id": GONE}, "session_not_found", f"unknown session {GONE!r}"),
    ("read_artifact", {"path_or_artifact": "a.png", "session_id": GONE}, "session_not_found",
     f"unknown session {GONE!r}"),
    ("interrupt", {"session_id": GONE}, "session_not_found", f"unknown session {GONE!r}"),
    ("close_session", {"session_id": GONE}, "session_not_found", f"unknown session {GONE!r}"),
    ("export_notebook", {"session_id": GONE}, "session_not_found", f"unknown session {GONE!r}"),
]


@pytest.mark.parametrize(("tool", "args", "code", "starts"), FAILING_CALLS, ids=[c[0] for c in FAILING_CALLS])
async def test_each_tool_gives_its_error_one_way(mcp_connect: Connect, tool: str, args: dict[str, Any],
                                                 code: str, starts: str) -> None:
    async with mcp_connect(close=False) as client:
        r = await client.call_tool(tool, args)
    assert r.is_error
    assert r.structured_content is not None and set(r.structured_content) == {"error"}, r.structured_content
    error = r.structured_content["error"]
    assert error["code"] == code, error
    assert error["message"].startswith(starts), error
    assert [b.text for b in r.content if isinstance(b, TextContent)] == [
        f"Error executing tool {tool}: {error['message']}"]
