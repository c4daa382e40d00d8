"""MCP answers within their budgets, for any output: no message over the cap (the SDK client
rejects an event over 1 MiB), the text a model reads within its budget, structured content lean,
and get_run paging through a long output with nothing repeated or lost.

The official SDK client over streamable HTTP (against `kernelmode serve`) and over stdio (the
embedded `kernelmode mcp`), real sandboxed kernels, a real host tool.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, ImageContent, TextContent

from kernelmode.config import McpFrontSettings
from tests.conftest import REPO, Server, start_server

from .conftest import mcp_client, run_record

DEFAULTS = McpFrontSettings()
CAP = DEFAULTS.max_message_bytes  # 900,000
TEXT_BUDGET = DEFAULTS.max_text_chars  # 8,000
PAGE = DEFAULTS.max_structured_chars
OUTPUT_CAP = 1024 * 1024  # sessions.max_output_bytes default
ENVELOPE = 100  # {"jsonrpc":"2.0","id":N,"result":...}

CONFIG = 'tools:\n  - {name: add, function: "tests.integration.host_tools:add"}\n'

PRINT_5MB = "for _ in range(50_000):\n    print('x' * 99)\n"
STDERR_2MB = "import sys\nfor _ in range(20_000):\n    print('e' * 99, file=sys.stderr)\n"
IMAGE_4000 = """
import io, numpy as np
from PIL import Image as PILImage
from IPython.display import Image, display
x = np.arange(4000, dtype=np.uint32)[None, :]
y = np.arange(4000, dtype=np.uint32)[:, None]
rgb = np.empty((4000, 4000, 3), dtype=np.uint8)
rgb[..., 0], rgb[..., 1], rgb[..., 2] = (x * 7 + y) % 256, (x ^ y) % 256, (x * y // 97) % 256
buf = io.BytesIO()
PILImage.fromarray(rgb).save(buf, 'PNG')
display(Image(data=buf.getvalue()))
len(buf.getvalue())
"""
DISPLAYS_50 = """
import io, numpy as np
from PIL import Image as PILImage
from IPython.display import Image, display, HTML
rng = np.random.default_rng(1)
for i in range(50):
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8)).save(buf, 'PNG')
    display(Image(data=buf.getvalue()))
    display(HTML('<b>%d</b>' % i + '<i>cell</i>' * 2000))
"""
EXCEPTION_1MB = "raise ValueError('v' * 1_000_000)\n"
ALL_AT_ONCE = "\n".join([PRINT_5MB, STDERR_2MB, IMAGE_4000, DISPLAYS_50, EXCEPTION_1MB])

CASES = {"5 MB print": PRINT_5MB, "2 MB stderr": STDERR_2MB, "4000x4000 image": IMAGE_4000,
         "50 displays": DISPLAYS_50, "1 MB exception": EXCEPTION_1MB, "all at once": ALL_AT_ONCE}


@pytest.fixture(scope="module")
def config() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="km-limits-") as d:
        path = Path(d) / "kernelmode.yaml"
        path.write_text(CONFIG)
        yield path


@pytest.fixture(scope="module")
def tool_server(config: Path) -> Iterator[Server]:
    srv = start_server(args=["--config", str(config)])
    yield srv
    srv.discard()


@contextlib.asynccontextmanager
async def connect(transport: str, server: Server, config: Path) -> AsyncIterator[Client]:
    if transport == "http":
        async with mcp_client(server) as client:
            yield client
    else:  # the embedded service: its own gateway and kernels, gone with the client
        params = StdioServerParameters(command=sys.executable,
                                       args=["-m", "kernelmode.cli", "mcp", "--config", str(config)],
                                       env=dict(os.environ), cwd=str(REPO))
        async with Client(stdio_client(params)) as client:
            yield client


def text_of(r: CallToolResult) -> str:
    return "\n".join(b.text for b in r.content if isinstance(b, TextContent))


def message_bytes(r: CallToolResult) -> int:
    """The answer's size as the server serialized it (compact JSON, UTF-8), with the envelope."""
    return len(r.model_dump_json(by_alias=True, exclude_none=True).encode()) + ENVELOPE


def check_within_budgets(name: str, r: CallToolResult) -> dict[str, Any]:
    size, text = message_bytes(r), text_of(r)
    sc = r.structured_content
    assert sc is not None, name
    print(f"{name}: {size:,} bytes, text {len(text):,} characters, structured "
          f"{len(json.dumps(sc)):,} characters, {sum(isinstance(b, ImageContent) for b in r.content)} images")
    assert size <= CAP, (name, size)
    assert len(text) <= TEXT_BUDGET, (name, len(text))
    return sc


async def run(c: Client, code: str) -> CallToolResult:
    return await c.call_tool("run_python", {"code": code, "wait_seconds": 240, "timeout_seconds": 240})


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_no_message_over_the_cap(transport: str, tool_server: Server, config: Path) -> None:
    async with connect(transport, tool_server, config) as c:
        results = {name: await run(c, code) for name, code in CASES.items()}
    for name, r in results.items():
        sc = check_within_budgets(name, r)
        text = text_of(r)
        assert sc["status"] != "running", name
        if name != "4000x4000 image":  # that one is downscaled, nothing is cut
            # Whatever was cut says so, with how much and where the whole is.
            assert "left out" in text, (name, text[-2000:])
            assert f"GET /v1/runs/{sc['run_id']}" in text, (name, text[-2000:])

    big = results["5 MB print"].structured_content
    assert big["stdout_total"] == OUTPUT_CAP  # the server keeps 1 MiB (ASCII: characters = bytes)
    assert big["stdout"] == ("x" * 99 + "\n") * (PAGE // 100) + ("x" * 99 + "\n")[:PAGE % 100]
    assert big["more_output"] and "get_run" in text_of(results["5 MB print"])
    text = text_of(results["5 MB print"])
    assert text.count("x" * 99) > 40  # the head and tail of the output, not only notes

    err = results["2 MB stderr"].structured_content
    assert err["stderr_total"] == OUTPUT_CAP and len(err["stderr"]) == PAGE

    image = results["4000x4000 image"]
    assert int(image.structured_content["result"]) > CAP  # the PNG alone would not fit
    shown = [b for b in image.content if isinstance(b, ImageContent)]
    assert len(shown) == 1, text_of(image)  # downscaled into the answer
    assert "shown downscaled" in text_of(image)
    assert image.structured_content["artifacts"][0]["download_url"] in text_of(image)  # the original

    displays = results["50 displays"]
    assert 1 <= sum(isinstance(b, ImageContent) for b in displays.content) <= DEFAULTS.max_images
    assert displays.structured_content["outputs_total"] == 100
    assert displays.structured_content["more_output"]

    exc = results["1 MB exception"]
    assert exc.is_error and "ValueError" in text_of(exc)
    assert exc.structured_content["error"]["ename"] == "ValueError"
    assert len(exc.structured_content["error"]["evalue"]) < 20_000

    everything = results["all at once"]
    assert everything.is_error and "ValueError" in text_of(everything)


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_many_tool_calls_keep_structured_content_lean(transport: str, tool_server: Server,
                                                            config: Path) -> None:
    code = "total = 0\nfor i in range(500):\n    total = tools.add(a=total, b=1)\ntotal\n"
    async with connect(transport, tool_server, config) as c:
        r = await run(c, code)
    sc = check_within_budgets("500 tool calls", r)
    assert sc["status"] == "ok" and sc["result"] == "500", text_of(r)
    assert sc["tool_calls_total"] == 500 and sc["tool_calls_truncated"]
    assert len(sc["tool_calls"]) == 10  # the first and last five
    assert len(json.dumps(sc)) < 10_000  # was 54,000 characters with every call listed
    text = text_of(r)
    assert "[tool calls: 500, 0 failed]" in text and "490 more" in text
    if transport == "http":  # the full record stays behind REST
        with tool_server.client() as api:
            whole = api.get(f"/v1/runs/{sc['run_id']}").json()["result"]
        assert len(whole["tool_calls"]) == 500


async def test_get_run_pages_through_a_long_output(tool_server: Server, config: Path) -> None:
    # 1.2 MB of numbered lines: more than the server keeps (1 MiB), many pages.
    code = "for i in range(60_000):\n    print(f'{i:07d}' + '.' * 12)\n"
    async with connect("http", tool_server, config) as c:
        first = await run(c, code)
        pages = [first]
        while pages[-1].structured_content.get("more_output"):
            assert "call get_run" in text_of(pages[-1])
            pages.append(await c.call_tool("get_run", {"run_id": first.structured_content["run_id"]}))
            assert len(pages) < 200
        again = await c.call_tool("get_run", {"run_id": first.structured_content["run_id"]})
    for i, p in enumerate(pages):
        check_within_budgets(f"page {i}", p)
    scs = [run_record(p.structured_content) for p in pages]
    with tool_server.client() as api:
        whole = api.get(f"/v1/runs/{scs[0]['run_id']}").json()["result"]["stdout"]
    assert len(whole.encode()) == OUTPUT_CAP
    # Nothing repeated, nothing lost: the pages put together are REST's whole stdout.
    assert "".join(sc["stdout"] for sc in scs) == whole
    assert [sc["stdout_offset"] for sc in scs] == [i * PAGE for i in range(len(scs))]
    assert len(scs) == -(-len(whole) // PAGE)
    assert not scs[-1]["more_output"] and "more output waits" not in text_of(pages[-1])
    # Once all was given, a further look has nothing new.
    assert "stdout" not in again.structured_content  # nothing new: left out, as every default


async def test_a_huge_listing_fits_the_text_budget(tool_server: Server, config: Path) -> None:
    code = ("import os\nos.makedirs('/mnt/data/many', exist_ok=True)\n"
            "for i in range(3000):\n    open(f'/mnt/data/many/{i:05d}-' + 'n' * 150, 'w').close()\n")
    async with connect("http", tool_server, config) as c:
        made = await run(c, code)
        assert made.structured_content["status"] == "ok", text_of(made)
        r = await c.call_tool("list_files", {})
        sessions = await c.call_tool("list_sessions", {})
    text = text_of(r)
    print(f"listing: {message_bytes(r):,} bytes, {len(text):,} characters")
    assert not r.is_error and len(text) <= TEXT_BUDGET and message_bytes(r) <= CAP
    assert message_bytes(r) < 3 * TEXT_BUDGET  # the structured copy of the text is cut as well
    assert "/mnt/data/many/00000-" in text and "left out" in text
    assert len(text_of(sessions)) <= TEXT_BUDGET
