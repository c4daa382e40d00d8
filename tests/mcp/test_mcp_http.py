"""The MCP front door over streamable HTTP (/mcp), driven by the official `mcp` SDK client
against a real `kernelmode serve` (real kernels in the real sandbox)."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any

import httpx
import httpx2
import pytest
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ImageContent, TextContent

from tests.conftest import Server

from .conftest import Connect, run_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_BYTES = 1_000_000  # McpFrontSettings.max_image_bytes default

ALL_TOOLS = {"run_python", "get_run", "upload_file", "list_files", "read_artifact", "list_tools", "search_tools",
             "interrupt", "close_session", "list_sessions", "export_notebook", "checkpoint", "fork_session",
             "install_packages"}


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def images_of(result: CallToolResult) -> list[ImageContent]:
    return [b for b in result.content if isinstance(b, ImageContent)]


async def call(client: Client, tool: str, **args: Any) -> CallToolResult:
    return await client.call_tool(tool, args)


async def run_ok(client: Client, code: str, **args: Any) -> CallToolResult:
    r = await call(client, "run_python", code=code, **args)
    assert not r.is_error, text_of(r)
    assert r.structured_content is not None
    assert r.structured_content["status"] == "ok", text_of(r)
    return r


async def follow(client: Client, run_id: str, wait: float = 1.0, limit: int = 60) -> list[CallToolResult]:
    """get_run until the run is no longer running; every result, in order."""
    results = []
    for _ in range(limit):
        r = await call(client, "get_run", run_id=run_id, wait_seconds=wait)
        results.append(r)
        assert r.structured_content is not None, text_of(r)
        if r.structured_content["status"] != "running":
            return results
    raise AssertionError(f"run {run_id} still running after {limit} get_run calls")


async def expect_failure(client: Client, tool: str, args: dict[str, Any]) -> str:
    """The text of a refused call, whether the SDK gives an is_error result or raises an MCP error."""
    try:
        r = await client.call_tool(tool, args)
    except Exception as e:  # an MCP protocol error (e.g. invalid params)
        print(f"{tool}({args}) raised {e!r}")
        return str(e)
    assert r.is_error, f"{tool}({args}) did not fail: {text_of(r)}"
    print(f"{tool}({args}) -> {text_of(r)!r}")
    return text_of(r)


# -- 1 ---------------------------------------------------------------------------------------------
async def test_tool_list_and_schemas(mcp_connect: Connect) -> None:
    async with mcp_connect(close=False) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    assert set(tools) == ALL_TOOLS
    for t in tools.values():
        assert t.description and t.description.strip(), t.name

    schema = tools["run_python"].input_schema
    props = schema["properties"]
    assert schema.get("required") == ["code"]
    assert {"code", "session_id", "timeout_seconds", "wait_seconds"} <= set(props)

    for name in ("run_python", "get_run"):
        out = tools[name].output_schema
        assert out is not None, name
        assert {"run_id", "status", "stdout"} <= set(out["properties"]), name


# -- 2 ---------------------------------------------------------------------------------------------
async def test_variables_persist_on_one_connection(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        r1 = await run_ok(c, "x = 41")
        r2 = await run_ok(c, "x + 1")
        r3 = await run_ok(c, "print('hi')")
    sc = r2.structured_content
    assert sc is not None
    assert sc["status"] == "ok"
    assert sc["result"] == "42"
    assert re.fullmatch(r"[0-9a-f]{32}", sc["run_id"])
    assert sc["session_id"] == r1.structured_content["session_id"]
    text = text_of(r2)
    assert f"session_id: {sc['session_id']}" in text
    assert "42" in text
    # Lean: fields at their default are left out (the outputSchema names each default); the
    # client already checked what is left against that schema.
    assert set(sc) == {"run_id", "session_id", "status", "result", "execution_count", "duration_ms"}, sc
    assert run_record(sc)["stdout"] == "" and run_record(sc)["artifacts"] == []
    printed = r3.structured_content
    assert printed["stdout"] == "hi\n" and printed["stdout_total"] == 3 and "result" not in printed, printed


# -- 3 ---------------------------------------------------------------------------------------------
async def test_code_error_keeps_session(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        await run_ok(c, "kept = 'still here'")
        r = await call(c, "run_python", code="1/0")
        assert r.is_error
        assert "ZeroDivisionError" in text_of(r)
        assert r.structured_content is not None
        assert r.structured_content["status"] == "error"
        after = await run_ok(c, "kept")
    assert after.structured_content["result"] == "'still here'"


# -- 4 ---------------------------------------------------------------------------------------------
async def test_two_connections_are_isolated(mcp_connect: Connect) -> None:
    async with mcp_connect() as a, mcp_connect() as b:
        ra = await run_ok(a, "secret_a = 1234")
        sid_a = ra.structured_content["session_id"]

        rb = await call(b, "run_python", code="secret_a")
        assert rb.is_error
        assert "NameError" in text_of(rb)
        sid_b = rb.structured_content["session_id"]
        assert sid_a != sid_b

        shared = await run_ok(b, "secret_a", session_id=sid_a)
        assert shared.structured_content["session_id"] == sid_a
        assert shared.structured_content["result"] == "1234"

        # b's own session is still its own
        again = await call(b, "run_python", code="secret_a")
        assert again.is_error and again.structured_content["session_id"] == sid_b


# -- 5 ---------------------------------------------------------------------------------------------
CSV = "region,amount\nnorth,120\nsouth,80\neast,45\nwest,99\n"

CHART_CODE = """
import pandas as pd
import matplotlib.pyplot as plt
df = pd.read_csv('/mnt/data/sales.csv')
fig, ax = plt.subplots(figsize=(4, 3))
ax.bar(df['region'], df['amount'])
ax.set_title('sales')
plt.savefig('/mnt/data/chart.png')
plt.show()
int(df['amount'].sum())
"""


async def test_upload_analyse_chart_read_artifact(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        up = await call(c, "upload_file", filename="sales.csv",
                        content_base64=base64.b64encode(CSV.encode()).decode())
        assert not up.is_error, text_of(up)
        assert "sales.csv" in text_of(up)

        r = await run_ok(c, CHART_CODE)
        assert r.structured_content["result"] == "344"
        imgs = images_of(r)
        assert imgs, text_of(r)
        assert imgs[0].type == "image"
        assert imgs[0].mime_type == "image/png"
        assert base64.b64decode(imgs[0].data).startswith(PNG_MAGIC)
        saved = [a["path"] for a in r.structured_content["artifacts"]]
        assert any(p.endswith("chart.png") for p in saved), saved
        assert "chart.png" in text_of(r)

        chart = await call(c, "read_artifact", path_or_artifact="chart.png")
        assert not chart.is_error, text_of(chart)
        chart_imgs = images_of(chart)
        assert len(chart_imgs) == 1
        assert chart_imgs[0].mime_type == "image/png"
        assert base64.b64decode(chart_imgs[0].data).startswith(PNG_MAGIC)

        also = await call(c, "read_artifact", path_or_artifact="/mnt/data/chart.png")
        assert images_of(also) and images_of(also)[0].data == chart_imgs[0].data

        csv = await call(c, "read_artifact", path_or_artifact="sales.csv")
        assert not csv.is_error, text_of(csv)
        assert not images_of(csv)
        assert CSV.strip() in text_of(csv)

        files = await call(c, "list_files")
        assert not files.is_error
        listing = text_of(files)
    assert "- /mnt/data/sales.csv (text/csv, 49 bytes)" in listing
    assert "- /mnt/data/chart.png (image/png, " in listing


# -- 6 ---------------------------------------------------------------------------------------------
BIG_IMAGE_CODE = """
import numpy as np
from PIL import Image as PILImage
from IPython.display import Image, display
rng = np.random.default_rng(0)
PILImage.fromarray(rng.integers(0, 256, (1500, 1500, 3), dtype=np.uint8)).save('/mnt/data/big.png')
display(Image(filename='/mnt/data/big.png'))
import os
os.path.getsize('/mnt/data/big.png')
"""


def _artifact(result: CallToolResult, name: str) -> dict[str, Any]:
    assert result.structured_content is not None
    found = [a for a in result.structured_content["artifacts"] if a["path"].endswith(name)]
    assert found, result.structured_content["artifacts"]
    return found[0]


async def test_read_artifact_downscales_big_image(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        r = await run_ok(c, BIG_IMAGE_CODE, timeout_seconds=120, wait_seconds=120)
        size = int(r.structured_content["result"])
        assert size > MAX_IMAGE_BYTES
        assert _artifact(r, "big.png")["size_bytes"] == size
        for img in images_of(r):  # whatever run_python shows inline fits the budget
            assert len(base64.b64decode(img.data)) <= MAX_IMAGE_BYTES

        shown = await call(c, "read_artifact", path_or_artifact="big.png")
        assert not shown.is_error, text_of(shown)
        imgs = images_of(shown)
        assert len(imgs) == 1, text_of(shown)
        raw = base64.b64decode(imgs[0].data)
        assert len(raw) <= MAX_IMAGE_BYTES
        assert raw.startswith(PNG_MAGIC) or raw.startswith(b"\xff\xd8")  # re-encoded PNG or JPEG
        assert imgs[0].mime_type in ("image/png", "image/jpeg")
        assert "big.png (image/png" in text_of(shown)


async def test_run_python_shows_big_image_downscaled(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        r = await run_ok(c, BIG_IMAGE_CODE, timeout_seconds=120, wait_seconds=120)
    size = int(r.structured_content["result"])
    assert size > MAX_IMAGE_BYTES
    imgs = images_of(r)
    assert len(imgs) == 1, text_of(r)
    assert len(base64.b64decode(imgs[0].data)) <= MAX_IMAGE_BYTES


# -- 7 ---------------------------------------------------------------------------------------------
TICKS_CODE = "import time\nfor i in range(6):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.5)\n"


async def test_long_run_followed_with_get_run(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        first = await call(c, "run_python", code=TICKS_CODE, wait_seconds=1)
        assert not first.is_error, text_of(first)
        sc = first.structured_content
        assert sc is not None
        assert sc["status"] == "running"
        run_id = sc["run_id"]
        text = text_of(first)
        assert "RUNNING" in text
        assert run_id in text
        assert "get_run" in text

        rest = await follow(c, run_id)
    final = rest[-1]
    assert final.structured_content["status"] == "ok", text_of(final)
    ticks = [f"tick {i}" for i in range(6)]
    # Each answer carries the output since the previous look: together, all of it, once.
    pages = [run_record(r.structured_content) for r in [first, *rest]]
    assert "".join(p["stdout"] for p in pages) == "".join(t + "\n" for t in ticks)
    assert [p["stdout_offset"] for p in pages] == [sum(len(q["stdout"]) for q in pages[:i]) for i in range(len(pages))]

    texts = [text_of(r) for r in [first, *rest]]
    for t in ticks:
        shown = sum(len(re.findall(rf"^{t}$", x, re.M)) for x in texts)
        assert shown == 1, (t, texts)
    # the first result with output shows the stream from its start, later ones mark it as a
    # continuation of what this connection has already seen
    with_ticks = [x for x in texts if "tick" in x]
    assert "[stdout]\ntick 0" in with_ticks[0]
    for x in with_ticks[1:]:
        assert "[stdout (continued)]" in x and "[stdout]\n" not in x


# -- 8 ---------------------------------------------------------------------------------------------
async def test_progress_notifications_carry_output(mcp_connect: Connect) -> None:
    messages: list[str] = []
    values: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        values.append(progress)
        if message:
            messages.append(message)

    code = "import time\nfor i in range(4):\n    print(f'step-{i}', flush=True)\n    time.sleep(0.3)\n"
    async with mcp_connect() as c:
        r = await c.call_tool("run_python", {"code": code, "wait_seconds": 30}, progress_callback=on_progress)
    assert not r.is_error, text_of(r)
    assert r.structured_content["status"] == "ok"
    joined = "".join(messages)
    for i in range(4):
        assert f"step-{i}" in joined, messages
    assert values == sorted(values)


# -- 9 ---------------------------------------------------------------------------------------------
async def test_interrupt_a_running_loop(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        await run_ok(c, "survivor = 7")
        first = await call(c, "run_python", code="import time\nwhile True:\n    time.sleep(0.05)\n",
                           wait_seconds=0.5)
        assert first.structured_content["status"] == "running", text_of(first)
        run_id = first.structured_content["run_id"]

        intr = await call(c, "interrupt")
        assert not intr.is_error, text_of(intr)
        assert "Interrupt sent" in text_of(intr)

        final = (await follow(c, run_id))[-1]
        assert final.structured_content["status"] == "interrupted", text_of(final)
        assert "INTERRUPTED" in text_of(final)

        after = await run_ok(c, "survivor * 6")
    assert after.structured_content["result"] == "42"


# -- 10 --------------------------------------------------------------------------------------------
async def test_bad_arguments_are_refused(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        msg = await expect_failure(c, "run_python", {})
        assert "code" in msg and "required" in msg.lower()

        msg = await expect_failure(c, "run_python", {"code": "1", "session_id": "../etc"})
        assert "session_id" in msg and "pattern" in msg

        msg = await expect_failure(c, "run_python", {"code": "1", "timeout_seconds": -1})
        assert "timeout_seconds" in msg and "greater than 0" in msg

        msg = await expect_failure(c, "run_python", {"code": "1", "session_id": "nope"})
        assert "unknown session" in msg

        missing_run = "0123456789abcdef" * 2
        msg = await expect_failure(c, "get_run", {"run_id": missing_run})
        assert "run" in msg.lower() and missing_run in msg

        msg = await expect_failure(c, "read_artifact", {"path_or_artifact": "no-such-file.txt"})
        assert "no-such-file.txt" in msg

        msg = await expect_failure(c, "upload_file", {"filename": "x.bin", "content_base64": "!!not base64!!"})
        assert "base64" in msg

        ok = await run_ok(c, "6 * 7")
    assert ok.structured_content["result"] == "42"


# -- 11 --------------------------------------------------------------------------------------------
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token"])
def test_http_requires_the_token(server: Server, auth: str | None) -> None:
    headers = dict(MCP_HEADERS)
    if auth:
        headers["Authorization"] = auth
    r = httpx.post(server.url + "/mcp", json=INIT, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "unauthorized"
    assert r.headers["content-type"] == "application/json"
    assert r.headers["www-authenticate"].startswith("Bearer")


async def test_sdk_client_with_wrong_token_fails(server: Server) -> None:
    # Repeated: a refusal that hung up before reading the body failed with a bare ReadError ~1 in 50.
    for _ in range(30):
        http = httpx2.AsyncClient(headers={"Authorization": "Bearer wrong-token"},
                                  timeout=httpx2.Timeout(10, read=30))
        try:
            with pytest.raises(Exception) as info:  # noqa: PT011 (the SDK wraps it in groups)
                async with Client(streamable_http_client(server.url + "/mcp", http_client=http)) as c:
                    await c.list_tools()
            assert any(isinstance(e, MCPError) for e in _leaves(info.value)), repr(info.value)
        finally:
            await http.aclose()


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)  # an (anyio task group's) exception group
    if inner:
        return [leaf for e in inner for leaf in _leaves(e)]
    return [exc]


# -- 12 --------------------------------------------------------------------------------------------
async def test_close_session_starts_fresh(mcp_connect: Connect) -> None:
    async with mcp_connect() as c:
        first = await run_ok(c, "gone_soon = 1")
        old = first.structured_content["session_id"]

        closed = await call(c, "close_session")
        assert not closed.is_error, text_of(closed)
        assert old in text_of(closed)

        r = await call(c, "run_python", code="gone_soon")
        assert r.is_error
        new = r.structured_content["session_id"]
        assert new != old
        assert "NameError" in text_of(r)

        listing = text_of(await call(c, "list_sessions"))
    assert f"- {new}: " in listing
    assert re.search(rf"- {new}: .*<- this connection's session", listing), listing
    assert f"- {old}: " not in listing


def _listed(text: str) -> list[str]:
    return re.findall(r"^- (\S+):", text, re.M)


async def test_list_sessions_is_newest_first_and_names_its_own(
        mcp_connect: Connect, api: httpx.Client, session_factory: Any) -> None:
    """An agent finds its latest sessions on the first page (REST keeps creation order), and its
    connection's own session even when newer ones push it off that page."""
    async with mcp_connect() as c:
        own = (await run_ok(c, "1")).structured_content["session_id"]
        newer = [await asyncio.to_thread(session_factory, session_id=f"mcp-newer-{i}") for i in range(2)]
        first = text_of(await call(c, "list_sessions", limit=2))
        assert _listed(first) == newer[::-1], first
        assert first.startswith(f"This connection's session (older than this page): {own}, idle\n"), first
        cursor = re.search(r"cursor='([^']+)'", first)
        assert cursor is not None, first
        second = text_of(await call(c, "list_sessions", limit=1, cursor=cursor.group(1)))
        assert _listed(second) == [own] and "<- this connection's session" in second, second
        assert "older than this page" not in second
        both = text_of(await call(c, "list_sessions", limit=3))
        assert _listed(both) == [*newer[::-1], own] and "older than this page" not in both, both
        rest = (await asyncio.to_thread(api.get, "/v1/sessions", params={"limit": 1000})).json()
        assert [s for s in (i["session_id"] for i in rest["sessions"]) if s in (own, *newer)] == [own, *newer]
        # A REST cursor is no position in this listing (nor the reverse): refused by name.
        rest_cursor = (await asyncio.to_thread(api.get, "/v1/sessions", params={"limit": 1})).json()["next_cursor"]
        refused = await call(c, "list_sessions", cursor=rest_cursor)
        assert refused.is_error and "other order" in text_of(refused), text_of(refused)
        r = await asyncio.to_thread(api.get, "/v1/sessions", params={"cursor": cursor.group(1)})
        assert r.status_code == 422 and "other order" in r.json()["error"]["message"], r.text


# -- 13 --------------------------------------------------------------------------------------------
async def test_list_tools_without_host_tools(mcp_connect: Connect) -> None:
    async with mcp_connect(close=False) as c:
        r = await call(c, "list_tools")
    assert not r.is_error
    assert text_of(r) == "No host tools are configured on this server."
