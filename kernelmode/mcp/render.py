"""Turn a RunResult into the compact text a model reads: the whole text within one budget."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..models import Artifact, RunResult

_SECTION_GAP = "\n\n"


def clip(text: str, budget: int, what: str) -> str:
    """The head and tail of ``text`` in at most ``budget`` characters (the cut note included)."""
    if len(text) <= budget:
        return text
    note = f"\n[... {what}: {{}} of {len(text):,} characters left out here ...]\n"
    keep = budget - len(note.format(f"{len(text):,}"))
    if keep < 40:  # too small for a useful head and tail: the note alone, or a bare cut
        marker = f"[... {what}: {len(text):,} characters left out ...]"
        return marker if len(marker) <= budget else text[:budget]
    head = keep * 2 // 3
    tail = keep - head
    return f"{text[:head]}{note.format(f'{len(text) - keep:,}')}{text[len(text) - tail:]}"


def size_text(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def artifact_line(a: Artifact) -> str:
    return f"- {a.path} ({a.mime_type}, {size_text(a.size_bytes)}): {a.download_url}"


@dataclass
class Page:
    """The part of a run's output that one answer carries; the rest waits for the next get_run.

    Offsets count characters of the run's whole stdout/stderr and items of its outputs.
    """

    stdout: str = ""
    stdout_offset: int = 0
    stdout_total: int = 0
    stderr: str = ""
    stderr_offset: int = 0
    stderr_total: int = 0
    outputs: list[dict[str, Any]] = field(default_factory=list)
    outputs_offset: int = 0
    outputs_total: int = 0

    @property
    def stdout_end(self) -> int:
        return self.stdout_offset + len(self.stdout)

    @property
    def stderr_end(self) -> int:
        return self.stderr_offset + len(self.stderr)

    @property
    def outputs_end(self) -> int:
        return self.outputs_offset + len(self.outputs)

    @property
    def more(self) -> bool:
        """Output already made that this answer does not carry."""
        return (self.stdout_end < self.stdout_total or self.stderr_end < self.stderr_total
                or self.outputs_end < self.outputs_total)

    def waiting(self) -> str:
        """What waits for the next get_run, e.g. 'stdout characters 16,000-1,048,576'."""
        parts = [f"{name} characters {end:,}-{total:,}" for name, end, total in (
            ("stdout", self.stdout_end, self.stdout_total), ("stderr", self.stderr_end, self.stderr_total))
            if end < total]
        if self.outputs_end < self.outputs_total:
            parts.append(f"displayed outputs {self.outputs_end + 1}-{self.outputs_total}")
        return ", ".join(parts)


def whole_page(r: RunResult) -> Page:
    """All of a finished run's output as one page (for readers that do not page, e.g. adapters)."""
    return Page(stdout=r.stdout, stdout_total=len(r.stdout), stderr=r.stderr, stderr_total=len(r.stderr),
                outputs=list(r.outputs), outputs_total=len(r.outputs))


def where_whole(run_id: str) -> str:
    """Where a reader gets all of a run that an answer cut."""
    return (f"get_run(run_id={run_id!r}) pages through it, REST GET /v1/runs/{run_id} returns it "
            "whole (up to the server's output cap), export_notebook keeps every run; or write large "
            "output to a file in /mnt/data")


def _status_line(r: RunResult) -> str:
    return {
        "ok": "status: ok",
        "error": "status: ERROR (the code raised an exception; the session and its variables are intact)",
        "timeout": "status: TIMEOUT",
        "kernel_died": "status: KERNEL DIED (the Python process was lost; variables are gone)",
        "interrupted": "status: INTERRUPTED",
        "running": "status: RUNNING (still going in the background)",
        "awaiting_approval": "status: AWAITING APPROVAL (paused until a person allows or denies a call)",
    }[r.status]


def restore_line(r: RunResult) -> str | None:
    """One line on a restore after the kernel died (None when there was none)."""
    lost = ", ".join(r.lost_variables[:30]) + (" ..." if len(r.lost_variables) > 30 else "")
    if r.restore_error:
        return (f"NOTE: the kernel had died and its checkpoint could not be restored ({r.restore_error}); "
                "the kernel started empty: variables and imports are gone.")
    if r.restored_from is None:
        return None
    head = (f"NOTE: the kernel had died; a fresh kernel was restored from checkpoint "
            f"{r.restored_from.checkpoint_id} ({r.restored_from.age_seconds:.0f} s old)")
    if not r.state_lost:
        return f"{head}: all variables are back."
    if lost:
        return f"{head}: {len(r.restored_variables)} variables are back, these are gone: {lost}."
    return f"{head}: {len(r.restored_variables)} variables are back; what later runs made is gone."


def egress_refused_line(r: RunResult) -> str | None:
    """One line naming the hosts the run's code was refused by the egress proxy (None: none)."""
    hosts = [e.host if e.port in (80, 443) else f"{e.host}:{e.port}" for e in r.egress if not e.allowed]
    if not hosts:
        return None
    shown = ", ".join(hosts[:10]) + (f" and {len(hosts) - 10} more" if len(hosts) > 10 else "")
    return (f"NOTE: egress refused: {shown} (not in this session's egress policy; the proxy's 403 "
            "says why, and the session's info lists the hosts it may reach).")


def run_text(r: RunResult, page: Page, budget: int, page_chars: int) -> str:
    """The run for a model, in at most ``budget`` characters: fixed lines (status, notes) whole,
    the variable parts (streams, value, traceback, calls, files) sharing what is left."""
    fixed = [f"{_status_line(r)}\nsession_id: {r.session_id}\nrun_id: {r.run_id}"]
    if r.status == "running":
        fixed.append(f"Call get_run(run_id={r.run_id!r}) to wait for more output and the result, "
                     "or interrupt() to stop it.")
    for p in r.pending_approvals:
        fixed.append(f"waiting for approval: {p.tool} {clip(json.dumps(p.arguments, default=str), 1_000, 'arguments')}"
                     f"\n  (call_id {p.call_id}: a person approves it with POST /v1/runs/{r.run_id}/approvals/"
                     f"{p.call_id} {{\"approve\": true}}; no answer in time means denied, raising ToolDenied)")
    if r.pending_approvals:
        fixed.append(f"Call get_run(run_id={r.run_id!r}) to follow the run once it is decided.")
    restore = restore_line(r)
    if restore:
        fixed.append(restore)
    elif r.state_lost and r.status != "kernel_died":
        fixed.append("NOTE: the kernel was restarted, so variables and imports from earlier runs are gone.")
    if r.cause is not None:
        detail = {"oom": "it ran out of memory", "signal": f"it was killed by signal {r.cause.signal}",
                  "exit": f"it exited with code {r.cause.exit_code}"}.get(r.cause.kind, "cause unknown")
        fixed.append(f"cause: {detail}" + (f" ({r.cause.detail})" if r.cause.detail else ""))

    parts: list[tuple[str, str, str]] = []  # (label, body, what): bodies may be clipped
    for name, text, offset in (("stdout", page.stdout, page.stdout_offset),
                               ("stderr", page.stderr, page.stderr_offset)):
        if text:
            parts.append((f"[{name}{' (continued)' if offset else ''}]\n", text, name))
    if r.result is not None:
        parts.append(("[result]\n", r.result, "result"))
    if r.error is not None:
        parts.append((f"[error] {r.error.ename}: ", f"{r.error.evalue}\n{r.error.traceback}".rstrip(), "error"))
    if r.tool_calls:
        listed = [f"{c.tool}({'ok' if c.ok else 'failed'})" for c in r.tool_calls]
        if len(listed) > 10:  # the first and last few; the whole record is behind REST
            listed = [*listed[:5], f"... {len(listed) - 10} more ...", *listed[-5:]]
        failed = sum(not c.ok for c in r.tool_calls)
        more = " and more, not recorded" if r.tool_calls_truncated else ""
        parts.append((f"[tool calls: {len(r.tool_calls)}{more}, {failed} failed] ", ", ".join(listed), "tool calls"))
    if r.artifacts:
        lines = "\n".join(artifact_line(a) for a in r.artifacts)
        parts.append(("[files saved by this run]\n", lines, "file list"))

    tail: list[str] = []
    if r.outputs_dropped:
        tail.append(f"NOTE: {r.outputs_dropped} displayed output(s) (e.g. images) were over the "
                    "server's display cap and left out: save large images to /mnt/data and look at "
                    "them with read_artifact.")
    elif r.truncated:
        tail.append("NOTE: the server cut some output at its cap; write large output to a file.")
    if page.more:
        tail.append(f"NOTE: more output waits ({page.waiting()}): call get_run(run_id={r.run_id!r}) "
                    f"for the next part (up to {page_chars:,} characters per stream each time), or "
                    f"read it all from REST GET /v1/runs/{r.run_id}.")
    if r.artifact_error:
        tail.append(f"NOTE: files could not be kept: {r.artifact_error}")
    refused = egress_refused_line(r)
    if refused:
        tail.append(refused)
    if r.status == "ok" and not parts and len(fixed) == 1 and not page.more:
        fixed.append("(no output)")

    text = _fit(fixed, parts, tail, budget, None)
    if len(text) > budget:  # cut it, and say where the whole is, within the same budget
        text = _fit(fixed, parts, tail, budget, f"NOTE: this answer was cut to {budget:,} characters; "
                    f"the whole run: {where_whole(r.run_id)}.")
    return text


def _fit(fixed: list[str], parts: list[tuple[str, str, str]], tail: list[str], budget: int,
         note: str | None) -> str:
    """Join the sections, clipping the bodies (largest first) so that the whole fits ``budget``."""
    notes = [*tail, *([note] if note else [])]
    frame = sum(len(s) for s in [*fixed, *notes]) + sum(len(label) for label, _, _ in parts)
    frame += len(_SECTION_GAP) * (len(fixed) + len(parts) + len(notes) - 1)
    room = max(budget - frame, 0)
    sizes = [len(body) for _, body, _ in parts]
    if note is not None and sum(sizes) > room:
        # Water-filling: small parts whole, the big ones an equal share of the rest.
        shares = [0] * len(parts)
        left = room
        for n, i in enumerate(sorted(range(len(parts)), key=lambda j: sizes[j])):
            shares[i] = min(sizes[i], left // (len(parts) - n))
            left -= shares[i]
        bodies = [clip(body, share, what) for (_, body, what), share in zip(parts, shares, strict=True)]
    else:
        bodies = [body for _, body, _ in parts]
    sections = [*fixed, *(label + body for (label, _, _), body in zip(parts, bodies, strict=True)), *notes]
    text = _SECTION_GAP.join(sections)
    if note is not None and len(text) > budget:  # the fixed lines alone were over: cut the whole
        text = clip(text, budget, "answer")
    return text
