"""Answers about runs: a page of a run's output since the reader's previous look, as text within
the text budget, a lean structured record, and the run's images inline (budget.py, render.py
and images.py do the measuring)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from ..config import McpFrontSettings
from ..errors import ImageTooLarge
from ..models import RunResult
from .budget import lean_record, take_page, wire_bytes
from .images import fit_image
from .render import clip, run_text, size_text

if TYPE_CHECKING:  # types only: `initialize` is answered before the session layer is imported
    from ..sessions.runs import LiveRun
    from ..tools.approvals import Asker

_MAX_FOLLOWED = 10_000  # runs whose shown output is remembered for get_run (per connection)


class RunAnswers:
    """What each reader was shown of each run, and the answers that show it the rest."""

    def __init__(self, cfg: McpFrontSettings) -> None:
        self.cfg = cfg
        self._seen: dict[tuple[str, str], tuple[int, int, int]] = {}  # (conn, run) -> chars/outputs shown

    def backlog(self, key: str | None, run: RunResult) -> bool:
        """More than a page of ``run`` (its snapshot) waits for this reader (the next get_run
        answers at once)."""
        return take_page(run, self._seen.get((key or "", run.run_id), (0, 0, 0)),
                         self.cfg.max_structured_chars).more

    @staticmethod
    def _image_mime(out: dict[str, Any]) -> str | None:
        return next((m for m in ("image/png", "image/jpeg", "image/gif", "image/webp") if m in out.get("data", {})), None)

    async def _images(self, outputs: list[dict[str, Any]],
                      room: Callable[[], int]) -> tuple[list[ContentBlock], list[str]]:
        """Inline images of ``outputs``: at most ``max_images``, each within its share of
        ``room()`` bytes of the message (base64 makes 4 characters of 3 bytes; measured only when
        there is an image)."""
        shown = [(out, mime) for out in outputs if (mime := self._image_mime(out)) is not None]
        notes = [f"{len(shown) - self.cfg.max_images} more image(s) were left out (see the files of this run)"
                 ] if len(shown) > self.cfg.max_images else []
        shown = shown[:self.cfg.max_images]
        blocks: list[ContentBlock] = []
        if not shown:
            return blocks, notes
        share = min(self.cfg.max_image_bytes, room() // len(shown) * 3 // 4 - 1_024)
        for out, mime in shown:
            try:
                if share < 10_000:
                    raise ImageTooLarge("no room left in this answer")
                raw = base64.b64decode(out["data"][mime])
                # Decoding and resizing a big image takes a while: not on the event loop.
                small, kind = await asyncio.to_thread(fit_image, raw, mime, share)
            except (ValueError, binascii.Error, ImageTooLarge) as e:
                notes.append(f"an image could not be shown: {e}")
                continue
            if len(small) < len(raw):
                notes.append(f"an image is shown downscaled ({size_text(len(raw))} -> {size_text(len(small))}); "
                             "the original is among the files of this run")
            blocks.append(ImageContent(data=base64.b64encode(small).decode(), mime_type=kind))
        return blocks, notes

    def room(self, blocks: list[ContentBlock], structured: dict[str, Any]) -> int:
        """Bytes of the message cap left after these blocks and this structured content."""
        dumped = CallToolResult(content=blocks, structured_content=structured).model_dump(
            by_alias=True, mode="json", exclude_none=True)
        return self.cfg.max_message_bytes - wire_bytes(dumped)

    async def result(self, key: str | None, result: RunResult, note: str | None) -> CallToolResult:
        """One answer about a run: the page of output since this reader's previous look (the rest
        stays for the next get_run), as text within the text budget, a lean record, and images.
        ``result``: the run's final result or its snapshot (here, or from its owner: remote.py)."""
        follow = (key or "", result.run_id)
        page = take_page(result, self._seen.pop(follow, (0, 0, 0)), self.cfg.max_structured_chars)
        # Kept after the end too: a later look gets only what came since (nothing, once all was given).
        while len(self._seen) >= _MAX_FOLLOWED:  # the least recently looked at go first
            self._seen.pop(next(iter(self._seen)))
        self._seen[follow] = (page.stdout_end, page.stderr_end, page.outputs_end)
        # Fields at their default are left out (the outputSchema gives each default): every
        # client checks the structured content against that schema, field by field, and some
        # hand it to the model; a plain `1+1` answer is 6 fields instead of 36.
        structured = lean_record(result, page, self.cfg.max_structured_chars).model_dump(
            mode="json", exclude_defaults=True)
        budget = self.cfg.max_text_chars
        # Notes (the session's, the images') come first; the run's text gets the rest of the budget.
        images, image_notes = await self._images(
            page.outputs, lambda: self.room([TextContent(text="x" * budget)], structured))
        extra = "\n\n".join(n for n in [note, *image_notes] if n)
        text = run_text(result, page, max(budget - len(extra) - 2, 200) if extra else budget,
                        self.cfg.max_structured_chars)
        if extra:
            text = clip(f"{extra}\n\n{text}", budget, "answer")
        return CallToolResult(
            content=[TextContent(text=text), *images],
            structured_content=structured,
            is_error=result.status in ("error", "timeout", "kernel_died"),
        )

    @staticmethod
    async def follow(ctx: Context[Any], run: LiveRun, wait: float, ask: Asker | None = None) -> RunResult:
        """Wait up to ``wait`` seconds for the run to end, sending its output as progress.

        ``ask``: puts the run's approvals to the client meanwhile (elicit.py); while one is being
        asked, the wait goes on past ``wait`` (the person's answer decides what comes next). An
        approval nobody asks ends the wait as soon as it comes (status awaiting_approval)."""
        gate = run.gate if ask is not None else None
        if gate is not None and ask is not None:
            gate.attach(ask)
        try:
            return await RunAnswers._follow(ctx, run, wait)
        finally:
            if gate is not None and ask is not None:
                gate.detach(ask)

    @staticmethod
    async def _follow(ctx: Context[Any], run: LiveRun, wait: float) -> RunResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        offset = len(run.collector.events)
        # An approval that waits unasked is news once it came after the call started; one that
        # already waited (a get_run of such a run) waits like output would, for ``wait``.
        seen = run.gate.version if run.gate is not None else 0
        while not run.done and not (run.awaiting and run.gate is not None and run.gate.version != seen):
            remaining = deadline - loop.time()
            if remaining <= 0:
                if run.gate is None or not run.gate.asking:
                    break
                remaining = 1.0  # a person is being asked: wait for the answer
            # Output wakes the wait only when it can go somewhere (a progress notification).
            await run.wait_changed(offset if getattr(ctx, "sends_progress", True) else None, remaining)
            new = run.collector.events[offset:]
            offset += len(new)
            text = "".join(e["text"] for e in new if e["type"] == "stream")
            if text:
                with contextlib.suppress(Exception):  # a client that asked for no progress, or left
                    await ctx.report_progress(float(offset), None, clip(text, 2000, "progress"))
        if run.failure is not None:
            raise run.failure  # a KernelmodeError: answered by the tools' one translation point
        return run.result if run.result is not None else run.snapshot()
