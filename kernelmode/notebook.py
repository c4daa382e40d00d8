"""A session's history as a Jupyter notebook (nbformat v4, validated against its schema).

Each run is a code cell with its outputs in the order they came (streams, displays, the
result, the error), runs typed in an attached console included; a first markdown cell says
which session this was. Runs that ended without a Python error of their own (timeout, kernel
death) get an error output that says so, so a reader sees where the story broke.

The notebook is written cell by cell (``write_notebook``): a long history with big outputs is
never held whole in memory, only one run's cell at a time, each validated before it is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any, BinaryIO

import nbformat
from nbformat import v4

from . import __version__
from .models import RunResult, SessionInfo

MIME = "application/x-ipynb+json"


def _outputs(events: list[dict[str, Any]], execution_count: int | None) -> list[Any]:
    outs: list[Any] = []
    for e in events:
        kind = e.get("type")
        if kind == "stream":
            last = outs[-1] if outs else None
            if last is not None and last.output_type == "stream" and last.name == e["name"]:
                last.text += e["text"]
            else:
                outs.append(v4.new_output("stream", name=e["name"], text=e["text"]))
        elif kind in ("display_data", "update_display_data"):
            outs.append(v4.new_output("display_data", data=e.get("data", {}), metadata=e.get("metadata", {})))
        elif kind == "execute_result":
            outs.append(v4.new_output("execute_result", data=e.get("data", {}), metadata=e.get("metadata", {}),
                                      execution_count=execution_count))
        elif kind == "error":
            outs.append(v4.new_output("error", ename=e.get("ename", ""), evalue=e.get("evalue", ""),
                                      traceback=str(e.get("traceback", "")).split("\n")))
    return outs


def _events_of(result: RunResult) -> list[dict[str, Any]]:
    """A run stored without its event order (older stores): streams, displays, result, error."""
    events: list[dict[str, Any]] = []
    if result.stdout:
        events.append({"type": "stream", "name": "stdout", "text": result.stdout})
    if result.stderr:
        events.append({"type": "stream", "name": "stderr", "text": result.stderr})
    events += [o for o in result.outputs if o.get("type") != "execute_result"]
    if result.result is not None:
        rich = next((o for o in result.outputs if o.get("type") == "execute_result"), None)
        events.append(rich or {"type": "execute_result", "data": {"text/plain": result.result}, "metadata": {}})
    if result.error is not None:
        events.append({"type": "error", **result.error.model_dump()})
    return events


def _ending(result: RunResult) -> dict[str, Any] | None:
    """An error output for runs that ended without one of their own."""
    if result.error is not None and result.status in ("error", "interrupted", "timeout"):
        return None
    if result.status == "timeout":
        return {"type": "error", "ename": "Timeout", "evalue": "the run exceeded its timeout", "traceback": ""}
    if result.status == "kernel_died":
        cause = result.cause
        detail = "" if cause is None else {
            "oom": "out of memory", "signal": f"killed by signal {cause.signal}",
            "exit": f"exit code {cause.exit_code}"}.get(cause.kind, "cause unknown")
        return {"type": "error", "ename": "KernelDied",
                "evalue": f"the kernel died ({detail}); variables were lost", "traceback": ""}
    return None


History = Iterable[tuple[str, RunResult, list[dict[str, Any]] | None]]


def _header(session_id: str, info: SessionInfo | None, runs: int) -> Any:
    lines = [f"# kernelmode session `{session_id}`", ""]
    if info is not None:
        lines += [f"- created: {info.created_at:%Y-%m-%d %H:%M:%S} UTC",
                  f"- status when exported: {info.status}",
                  f"- sandbox: {info.sandbox}; limits: " + ", ".join(
                      f"{k}={v}" for k, v in info.limits.model_dump().items())]
    lines += [f"- runs: {runs}",
              f"- exported: {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC by kernelmode {__version__}",
              "", "Each cell below is one run, with the outputs it produced. Files the code wrote "
              "were in `/mnt/data`; the session's artifacts keep them."]
    return v4.new_markdown_cell("\n".join(lines))


def _cell(code: str, result: RunResult, events: list[dict[str, Any]] | None) -> Any:
    evs = list(events) if events is not None else _events_of(result)
    ending = _ending(result)
    if ending is not None:
        evs.append(ending)
    cell = v4.new_code_cell(source=code, execution_count=result.execution_count,
                            outputs=_outputs(evs, result.execution_count))
    cell.metadata["kernelmode"] = {
        "run_id": result.run_id, "status": result.status, "duration_ms": result.duration_ms,
        "state_lost": result.state_lost, "artifacts": [a.path for a in result.artifacts],
    }
    return cell


def _json(obj: Any) -> bytes:
    # nbformat's own layout (indent 1, sorted keys, UTF-8); a lone surrogate becomes "?", never
    # an encoding error halfway through a download.
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode("utf-8", errors="replace")


def write_notebook(out: BinaryIO, session_id: str, info: SessionInfo | None, history: History,
                   runs: int) -> None:
    """Write the notebook to ``out`` one cell at a time; ``runs``: how many ``history`` yields
    (said in the first cell). Each cell is validated in a notebook of its own before it is
    written, so the file is valid without ever being in memory whole."""
    nb = v4.new_notebook(cells=[], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3 (kernelmode)", "language": "python"},
        "language_info": {"name": "python"},
        "kernelmode": {"session_id": session_id},
    })
    nbformat.validate(nb)
    tail = _json(nb)  # '{\n "cells": [],\n "metadata": ...}': what follows the cells
    out.write(b'{\n "cells": [\n')
    for i, cell in enumerate(_cells(session_id, info, history, runs)):
        nb.cells = [cell]
        nbformat.validate(nb)
        if i:
            out.write(b",\n")
        out.write(_json(cell))
    out.write(b"\n ]," + tail[tail.index(b"\n", tail.index(b'"cells"')):])


def _cells(session_id: str, info: SessionInfo | None, history: History, runs: int) -> Iterable[Any]:
    yield _header(session_id, info, runs)
    for code, result, events in history:
        yield _cell(code, result, events)
