"""MCP `checkpoint` and `fork_session`, and the one line a model reads after a restore."""

from __future__ import annotations

import re

from mcp_types import CallToolResult, TextContent

from .conftest import Connect


def _text(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


async def test_checkpoint_restore_and_fork_over_mcp(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        await c.call_tool("run_python", {"code": "import threading\nkept = [1, 2, 3]\nth = threading.Thread()"})
        ck = await c.call_tool("checkpoint", {})
        text = _text(ck)
        assert not ck.is_error and "kept" in text and "th (thread" in text, text
        checkpoint_id = re.search(r"Checkpoint ([0-9a-f]{32})", text).group(1)  # type: ignore[union-attr]
        died = await c.call_tool("run_python", {"code": "import os\nos._exit(1)", "timeout_seconds": 60})
        assert died.is_error
        back = _text(await c.call_tool("run_python", {"code": "sum(kept)"}))
        assert "6" in back and f"restored from checkpoint {checkpoint_id}" in back
        assert "these are gone: th" in back, back

        fork = _text(await c.call_tool("fork_session", {"checkpoint_id": checkpoint_id}))
        fork_id = re.search(r"New session (\S+),", fork).group(1)  # type: ignore[union-attr]
        await c.call_tool("run_python", {"code": "kept.append(4)", "session_id": fork_id})
        assert "[1, 2, 3]" in _text(await c.call_tool("run_python", {"code": "kept"}))
        assert "[1, 2, 3, 4]" in _text(await c.call_tool("run_python", {"code": "kept", "session_id": fork_id}))
        await c.call_tool("close_session", {"session_id": fork_id})
        unknown = await c.call_tool("fork_session", {"checkpoint_id": "0" * 32})
        assert unknown.is_error and unknown.structured_content["error"]["code"] == "checkpoint_not_found"
