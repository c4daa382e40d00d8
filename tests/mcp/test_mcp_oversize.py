"""An MCP request over /mcp's body cap (mcp.max_request_bytes, 32 MiB by default) is answered
inside the protocol (issue 32): the official SDK client gets an ``isError`` tool result naming the
cap and the REST upload route, and its connection, with the session's variables, goes on working.
(A transport-level 413 made the client drop the whole MCP connection.)"""

from __future__ import annotations

import base64

from mcp_types import CallToolResult, TextContent

from .conftest import Connect

CAP = 32 * 1024 * 1024  # the default mcp.max_request_bytes


def text_of(result: CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_an_oversized_upload_is_an_error_result_and_the_connection_stays(mcp_connect: Connect) -> None:
    async with mcp_connect() as client:
        first = await client.call_tool("run_python", {"code": "kept = 41 + 1\nkept"})
        assert not first.is_error and "42" in text_of(first), text_of(first)
        # 25 MiB of file: 33.3 MB of base64, over the 32 MiB cap.
        big = base64.b64encode(b"\x00" * (25 << 20)).decode()
        refused = await client.call_tool("upload_file", {"filename": "big.bin", "content_base64": big})
        assert refused.is_error
        text = text_of(refused)
        assert f"{CAP} bytes" in text and "upload_file was not run" in text, text
        assert "PUT /v1/sessions/{session_id}/files/{path}" in text
        # The same client session: still connected, same kernel, nothing written.
        again = await client.call_tool("run_python", {
            "code": "import os\nprint(kept, os.path.exists('big.bin'))"})
        assert not again.is_error and "42 False" in text_of(again), text_of(again)
