"""Turn a RunResult into the compact text a model reads, each part within a budget."""

from __future__ import annotations

from ..models import Artifact, RunResult


def clip(text: str, budget: int, what: str) -> str:
    """The head and tail of ``text`` within ``budget`` characters, with a note when cut."""
    if len(text) <= budget:
        return text
    head = budget * 2 // 3
    tail = budget - head
    return (f"{text[:head]}\n[... {what} truncated: {len(text) - budget} of {len(text)} characters "
            f"left out here; write large output to a file in /mnt/data instead ...]\n{text[-tail:]}")


def size_text(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def artifact_line(a: Artifact) -> str:
    return f"- {a.path} ({a.mime_type}, {size_text(a.size_bytes)}): {a.download_url}"


def run_text(r: RunResult, budget: int, seen_stdout: int = 0, seen_stderr: int = 0) -> str:
    """The run for a model. ``seen_*``: characters of each stream already shown to this reader."""
    head = {
        "ok": "status: ok",
        "error": "status: ERROR (the code raised an exception; the session and its variables are intact)",
        "timeout": "status: TIMEOUT",
        "kernel_died": "status: KERNEL DIED (the Python process was lost; variables are gone)",
        "interrupted": "status: INTERRUPTED",
        "running": "status: RUNNING (still going in the background)",
    }[r.status]
    parts = [f"{head}\nsession_id: {r.session_id}\nrun_id: {r.run_id}"]
    if r.status == "running":
        parts.append(f"Call get_run(run_id={r.run_id!r}) to wait for more output and the result, "
                     "or interrupt() to stop it.")
    if r.state_lost and r.status != "kernel_died":
        parts.append("NOTE: the kernel was restarted, so variables and imports from earlier runs are gone.")
    if r.cause is not None:
        detail = {"oom": "it ran out of memory", "signal": f"it was killed by signal {r.cause.signal}",
                  "exit": f"it exited with code {r.cause.exit_code}"}.get(r.cause.kind, "cause unknown")
        parts.append(f"cause: {detail}")
    for name, text, seen in (("stdout", r.stdout, seen_stdout), ("stderr", r.stderr, seen_stderr)):
        text = text[seen:]
        if text:
            label = f"[{name}{' (continued)' if seen else ''}]"
            parts.append(f"{label}\n{clip(text, budget, name)}")
    if r.result is not None:
        parts.append(f"[result]\n{clip(r.result, budget, 'result')}")
    if r.error is not None:
        tb = clip(r.error.traceback, budget, "traceback")
        parts.append(f"[error] {r.error.ename}: {r.error.evalue}\n{tb}".rstrip())
    if r.outputs_dropped:
        parts.append(f"NOTE: {r.outputs_dropped} displayed output(s) (e.g. images) were over the "
                     "server's display cap and left out: save large images to /mnt/data and look at "
                     "them with read_artifact.")
    elif r.truncated:
        parts.append("NOTE: the server cut some output at its cap; write large output to a file.")
    if r.tool_calls:
        calls = ", ".join(f"{c.tool}({'ok' if c.ok else 'failed'})" for c in r.tool_calls[:20])
        parts.append(f"[tool calls] {calls}")
    if r.artifacts:
        lines = "\n".join(artifact_line(a) for a in r.artifacts[:50])
        more = f"\n(and {len(r.artifacts) - 50} more)" if len(r.artifacts) > 50 else ""
        parts.append(f"[files saved by this run]\n{lines}{more}")
    if r.artifact_error:
        parts.append(f"NOTE: files could not be kept: {r.artifact_error}")
    if r.status == "ok" and len(parts) == 1:
        parts.append("(no output)")
    return "\n\n".join(parts)
