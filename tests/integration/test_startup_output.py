"""What `kernelmode serve` tells a newcomer: the start-up block on stdout (URL, MCP URL, token,
lines to paste), and its logs on stderr (JSON lines with ts and level, or readable text)."""

from __future__ import annotations

import json
import re

import httpx

from tests.conftest import Server, start_server

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) +[\w.]+: ")


def block_of(server: Server) -> list[str]:
    """The block's lines after the `serving on` line (which start_server read)."""
    assert server.proc.stdout is not None
    lines: list[str] = []
    for _ in range(20):
        line = server.proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if "claude mcp add" in line:
            break
    return lines


def test_block_with_a_token_from_the_environment_and_json_logs(server: Server) -> None:
    block = "\n".join(block_of(server))
    assert f"MCP       {server.url}/mcp" in block
    assert f"export KERNELMODE_URL={server.url}" in block
    assert (f'claude mcp add --transport http kernelmode {server.url}/mcp '
            f'--header "Authorization: Bearer $KERNELMODE_TOKEN"') in block
    assert server.token not in block and "from $KERNELMODE_TOKEN" in block
    # stderr is a file: JSON lines, every one with ts and level.
    with server.client() as api:
        assert api.post("/v1/execute", json={"code": "1"}).status_code == 200  # a few more lines
    lines = [x for x in server.log().splitlines() if x.strip()]
    assert len(lines) >= 5
    for line in lines:
        record = json.loads(line)  # nothing but JSON
        assert record["ts"] and record["level"] in ("debug", "info", "warning", "error", "critical"), line


def test_block_shows_a_generated_token_that_works_and_text_logs() -> None:
    srv = start_server(env_extra={"KERNELMODE_TOKEN": ""}, args=["--log-format", "text"])
    try:
        lines = block_of(srv)
        shown = next(x for x in lines if x.startswith("  export KERNELMODE_URL="))
        m = re.fullmatch(rf"  export KERNELMODE_URL={re.escape(srv.url)} KERNELMODE_TOKEN=(\S+)", shown)
        assert m, shown
        token = m.group(1)
        assert any(f'--header "Authorization: Bearer {token}"' in x and f"{srv.url}/mcp" in x for x in lines)
        assert httpx.get(srv.url + "/v1/sessions", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert httpx.get(srv.url + "/v1/sessions", headers={"Authorization": "Bearer nope"}).status_code == 401
        log = srv.log().splitlines()
        assert any("kernel gateway ready" in x for x in log)
        # Each record's first line is a timestamped, readable line (a traceback may follow one).
        assert all(TEXT_LINE.match(x) for x in log if x and not x.startswith((" ", "Traceback")))
        assert not any(x.startswith("{") for x in log)
    finally:
        srv.discard()
