"""Budgets of MCP answers: what one answer about a run carries, and the cap on every message.

The mcp 2.x client rejects a streamed event over 1 MiB ("Server-sent event exceeded the 1048576
byte limit"), and some clients hand structured content to the model. So an answer about a run
carries a *page* of its output (what came since this reader's previous look, at most
``max_structured_chars`` per stream; the rest waits for the next get_run) and a lean record
(counts and the first/last tool calls). ``fit_message`` is the one point that measures every
outgoing answer as the SDK serializes it and shrinks it under ``max_message_bytes``, in a fixed
order: structured streams, then images (downscaled further, or dropped), then text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Any

from pydantic import Field

from ..errors import ImageTooLarge, MessageTooLarge
from ..models import RunResult
from .images import fit_image
from .render import Page, clip, where_whole

# {"jsonrpc":"2.0","id":...,"result":...} around the result, and an SSE frame's "event:"/"id:"
# lines around that: generous, the ids are short.
_ENVELOPE_BYTES = 512
_KEPT_CALLS = 5  # first and last tool calls listed in structured content
_KEPT_ARTIFACTS = 20
_PAGE_OUTPUTS = 20  # displayed outputs per answer


class McpRunResult(RunResult):
    """A RunResult as one MCP answer carries it: the output since this reader's previous look,
    within bounds, with where each part starts. The whole run: REST ``GET /v1/runs/{run_id}``."""

    stdout_offset: int = Field(0, description="Where `stdout` starts in the run's whole stdout (characters).")
    stdout_total: int = Field(0, description="Characters of the run's stdout so far.")
    stderr_offset: int = Field(0, description="Where `stderr` starts in the run's whole stderr (characters).")
    stderr_total: int = Field(0, description="Characters of the run's stderr so far.")
    outputs_offset: int = Field(0, description="Index of the first of `outputs` among the run's outputs.")
    outputs_total: int = Field(0, description="Displayed outputs of the run so far.")
    tool_calls_total: int = Field(0, description="Tool calls recorded for the run (`tool_calls` lists "
                                  "the first and last few).")
    artifacts_total: int = Field(0, description="Files and outputs kept (`artifacts` may list fewer).")
    more_output: bool = Field(False, description="Output this answer does not carry waits: call get_run.")
    cut: list[str] = Field(default_factory=list, description="What this answer left out, and where the whole is.")


def take_page(r: RunResult, seen: tuple[int, int, int], page_chars: int) -> Page:
    """The output after ``seen`` (stdout chars, stderr chars, outputs), at most a page of it."""
    so, se, oo = (min(s, n) for s, n in zip(seen, (len(r.stdout), len(r.stderr), len(r.outputs)), strict=True))
    outputs: list[dict[str, Any]] = []
    size = 0
    for out in r.outputs[oo:oo + _PAGE_OUTPUTS]:
        # As lean_record will carry it: a value over a page becomes a short note.
        n = sum(len(v) if len(v) <= page_chars else 120 for v in map(str, out.get("data", {}).values()))
        if outputs and size + n > 2 * page_chars:
            break
        outputs.append(out)
        size += n
    return Page(stdout=r.stdout[so:so + page_chars], stdout_offset=so, stdout_total=len(r.stdout),
                stderr=r.stderr[se:se + page_chars], stderr_offset=se, stderr_total=len(r.stderr),
                outputs=outputs, outputs_offset=oo, outputs_total=len(r.outputs))


def _lean_output(out: dict[str, Any], limit: int, run_id: str) -> dict[str, Any]:
    """A display bundle with each value over ``limit`` replaced by a note (images travel as image
    content and artifacts; a clipped HTML or JSON value would be broken anyway)."""
    def size(value: Any) -> int:
        return len(value) if isinstance(value, str) else len(json.dumps(value))

    data = {mime: value if size(value) <= limit else
            f"<{size(value):,} characters left out: see the run's artifacts, or REST GET /v1/runs/{run_id}>"
            for mime, value in out.get("data", {}).items()}
    metadata = out.get("metadata", {})
    return {**out, "data": data, "metadata": metadata if size(metadata) <= limit else {}}


def lean_record(r: RunResult, page: Page, page_chars: int) -> McpRunResult:
    """The structured content of an answer about ``r``: its page and a bounded record."""
    cut: list[str] = []
    calls = r.tool_calls
    if len(calls) > 2 * _KEPT_CALLS:
        calls = [*calls[:_KEPT_CALLS], *calls[-_KEPT_CALLS:]]
        cut.append(f"tool_calls lists the first and last {_KEPT_CALLS} of {len(r.tool_calls)} calls")
    artifacts = r.artifacts[:_KEPT_ARTIFACTS]
    if len(artifacts) < len(r.artifacts):
        cut.append(f"artifacts lists {len(artifacts)} of {len(r.artifacts)}")
    result = r.result
    if result is not None and len(result) > page_chars:
        result = clip(result, page_chars, "result")
        cut.append(f"result: {len(r.result or ''):,} characters, clipped")
    error = r.error
    if error is not None and len(error.evalue) + len(error.traceback) > page_chars:
        error = error.model_copy(update={"evalue": clip(error.evalue, page_chars // 4, "evalue"),
                                         "traceback": clip(error.traceback, page_chars, "traceback")})
        cut.append("error: evalue and traceback clipped")
    if page.more:
        cut.append(f"waiting for the next get_run: {page.waiting()}")
    if cut:
        cut.append(f"the whole run: {where_whole(r.run_id)}")
    return McpRunResult(
        **r.model_dump(exclude={"stdout", "stderr", "outputs", "tool_calls", "artifacts", "result", "error",
                                "tool_calls_truncated", "artifacts_truncated"}),
        stdout=page.stdout, stderr=page.stderr, result=result, error=error,
        outputs=[_lean_output(o, page_chars, r.run_id) for o in page.outputs],
        tool_calls=calls, artifacts=artifacts,
        tool_calls_truncated=r.tool_calls_truncated or len(calls) < len(r.tool_calls),
        artifacts_truncated=r.artifacts_truncated or len(artifacts) < len(r.artifacts),
        stdout_offset=page.stdout_offset, stdout_total=page.stdout_total,
        stderr_offset=page.stderr_offset, stderr_total=page.stderr_total,
        outputs_offset=page.outputs_offset, outputs_total=page.outputs_total,
        tool_calls_total=len(r.tool_calls), artifacts_total=len(r.artifacts),
        more_output=page.more, cut=cut,
    )


def wire_bytes(result: dict[str, Any]) -> int:
    """Bytes of the JSON-RPC message that carries ``result`` (compact JSON, UTF-8, as the SDK
    writes it with pydantic), envelope included."""
    text = json.dumps(result, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode("utf-8", errors="replace")) + _ENVELOPE_BYTES


def fit_text(result: dict[str, Any], budget: int) -> dict[str, Any]:
    """A tool result whose text blocks together hold at most ``budget`` characters (the largest
    clipped first, head and tail kept, the cut marked). Run answers are built to fit already;
    this bounds the rest (a listing of 100,000 files, a long file)."""
    content = result.get("content")
    if not isinstance(content, list):
        return result
    texts = [i for i, b in enumerate(content) if isinstance(b, dict) and b.get("type") == "text"]
    total = sum(len(str(content[i].get("text", ""))) for i in texts)
    if total <= budget:
        return result
    content = list(content)
    # A tool that returns a string also sends it as structured content {"result": text}.
    sc = result.get("structuredContent")
    mirrored = len(texts) == 1 and isinstance(sc, dict) and sc == {"result": content[texts[0]].get("text")}
    for _ in range(len(texts)):
        over = total - budget
        if over <= 0:
            break
        i = max(texts, key=lambda j: len(str(content[j].get("text", ""))))
        text = str(content[i].get("text", ""))
        keep = max(len(text) - over, 0)
        content[i] = {**content[i], "text": clip(text, keep, "this answer (the REST API has all of it)")}
        total -= len(text) - len(content[i]["text"])
    if mirrored:
        return {**result, "content": content, "structuredContent": {"result": content[texts[0]]["text"]}}
    return {**result, "content": content}


async def fit_message(result: dict[str, Any], cap: int, size: int | None = None) -> dict[str, Any]:
    """``result`` (a serialized answer) if it fits ``cap`` bytes, else a tool result shrunk to
    fit with a note of what was cut; MessageTooLarge for any other answer. ``size``: the
    message's bytes when the caller measured them (the encoded JSON-RPC message)."""
    size = wire_bytes(result) if size is None else size
    if size <= cap:
        return result
    content = result.get("content")
    if not isinstance(content, list):
        raise MessageTooLarge(f"the answer is {size:,} bytes, over this server's MCP message cap of {cap:,}")
    result = {**result, "content": list(content)}
    sc = result.get("structuredContent")
    run_id = sc.get("run_id") if isinstance(sc, dict) else None
    where = where_whole(run_id) if isinstance(run_id, str) else "ask for less at a time"
    notes: list[str] = []

    # 1. Structured content: its streams and lists, down to nothing.
    if isinstance(sc, dict):
        sc = result["structuredContent"] = dict(sc)
        for limit in (4_000, 0):
            for key in ("stdout", "stderr", "result"):
                if isinstance(sc.get(key), str) and len(sc[key]) > limit:
                    sc[key] = clip(sc[key], limit, key) if limit else ""
            if isinstance(sc.get("error"), dict):
                sc["error"] = {**sc["error"], **{k: clip(str(sc["error"].get(k, "")), limit, k)
                                                 for k in ("evalue", "traceback")}}
            for key in ("outputs", "tool_calls", "artifacts"):
                if isinstance(sc.get(key), list) and len(sc[key]) > (limit and 5):
                    sc[key] = sc[key][:limit and 5]
            if isinstance(sc.get("cut"), list) or isinstance(run_id, str):  # a run's record
                cut: list[Any] = sc["cut"] if isinstance(sc.get("cut"), list) else []
                sc["cut"] = [*cut[-1:], "this answer's structured content was cut to fit the "
                             f"MCP message cap of {cap:,} bytes"]
            if wire_bytes(result) <= cap:
                break
        notes.append("its structured content (streams, outputs, lists) was cut")

    # 2. Images: a share of what is left each, downscaled further or dropped.
    images = [i for i, b in enumerate(content) if isinstance(b, dict) and b.get("type") == "image"]
    if images and wire_bytes(result) > cap:
        without = wire_bytes({**result, "content": [b for i, b in enumerate(result["content"]) if i not in images]})
        share = max((cap - without) // len(images) * 3 // 4 - 1_024, 0)  # base64: 4 characters per 3 bytes
        for i in images:
            block = result["content"][i]
            try:
                raw = base64.b64decode(block.get("data", ""))
                if share < 10_000:
                    raise ImageTooLarge("no room left in this answer")
                small, kind = await asyncio.to_thread(fit_image, raw, str(block.get("mimeType")), share)
                result["content"][i] = {**block, "data": base64.b64encode(small).decode(), "mimeType": kind}
            except (ValueError, binascii.Error, ImageTooLarge) as e:
                result["content"][i] = {"type": "text", "text": f"[an image was left out: {e}; see the run's files]"}
        notes.append("images were downscaled or left out")

    # 3. Text: the largest block clipped until the whole fits.
    texts = [i for i, b in enumerate(result["content"]) if isinstance(b, dict) and b.get("type") == "text"]
    for _ in range(8):
        over = wire_bytes(result) + 400 - cap  # 400: the note added below
        if over <= 0 or not texts:
            break
        i = max(texts, key=lambda j: len(result["content"][j].get("text", "")))
        text = str(result["content"][i].get("text", ""))
        # A character is at least one byte: dropping ``over`` of them drops at least ``over`` bytes.
        result["content"][i] = {**result["content"][i], "text": clip(text, max(len(text) - over - 200, 0), "text")}
        if "text was clipped" not in notes:
            notes.append("text was clipped")

    note = {"type": "text", "text": f"NOTE: this answer was over the MCP message cap of {cap:,} bytes, so "
            f"{'; '.join(notes) or 'it was cut'}. The whole: {where}."}
    result["content"] = [note, *result["content"]]
    if wire_bytes(result) > cap:  # only a pathological answer gets here: keep the note alone
        result["content"] = [note]
        if isinstance(sc, dict):
            result["structuredContent"] = {k: v for k, v in sc.items()
                                           if k in ("run_id", "session_id", "status")}
    return result
