"""Gather the Jupyter messages of one execute_request into the parts of a RunResult."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..models import RunError, RunResult, RunStatus
from ..protocol import CHANGES_COMM, NOTE_KEY

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


class OutputCollector:
    """Accumulates stream, result, display and error messages, with a byte cap per stream.

    ``max_bytes`` caps stdout and stderr each, ``max_display_bytes`` the rich outputs together;
    beyond them the rest is dropped and ``truncated`` is set, so a flood costs bounded memory.

    ``events`` keeps what was kept in arrival order (stream chunks, displays, the error), so a
    poller can read a run's output while it is still going; ``on_change`` is called after each.
    """

    def __init__(self, max_bytes: int, on_change: Callable[[], None] | None = None,
                 max_display_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_display_bytes = max_bytes if max_display_bytes is None else max_display_bytes
        self.on_change = on_change
        self.dropped_outputs = 0  # displays (images...) left out at the cap
        self.events: list[dict[str, Any]] = []
        self._sizes = {"stdout": 0, "stderr": 0, "outputs": 0}
        self.outputs: list[dict[str, Any]] = []
        self.result: str | None = None
        self.error: RunError | None = None
        self.execution_count: int | None = None
        self.truncated = False
        self.reply_status: str | None = None
        # The file agent's note of the files the cell changed (kernel/file_agent.py): its JSON, from
        # the execute_reply's metadata (or, for a large note, a comm_msg's buffer).
        self.file_changes: bytes | None = None

    def _take(self, kind: str, text: str) -> str:
        room = self.max_bytes - self._sizes[kind]
        if len(text) > room:  # a character is at least a byte: never encode more than fits
            text = text[: max(room, 0)]
            self.truncated = True
        data = text.encode("utf-8", errors="replace")
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
            text = data.decode("utf-8", errors="ignore")
        self._sizes[kind] += len(data)
        return text

    def _add_output(self, output: dict[str, Any]) -> None:
        size = sum(len(str(v)) for v in output.get("data", {}).values())
        if self._sizes["outputs"] + size > self.max_display_bytes:
            self.truncated = True
            self.dropped_outputs += 1
            return
        self._sizes["outputs"] += size
        self.outputs.append(output)
        self.events.append(output)

    def _dropped(self, kind: str, note: dict[str, Any]) -> None:
        """A message too large to read (frames.decode_frame left its content out): say so."""
        self.truncated = True
        text = (f"[kernelmode: a {kind} message of {note.get('bytes', 0):,} bytes was not read: "
                f"{note.get('reason', 'over the limit')}]\n")
        if kind in ("display_data", "update_display_data", "execute_result"):
            self.dropped_outputs += 1
        if kind in ("error", "execute_reply"):
            if kind == "execute_reply":
                self.reply_status = "error"
            if self.error is None:
                self.error = RunError(ename="MessageTooLarge", evalue=text.strip(), traceback="")
        if self._sizes["stderr"] < self.max_bytes:
            self.events.append({"type": "stream", "name": "stderr", "text": self._take("stderr", text)})

    def add(self, msg: dict[str, Any]) -> None:
        kind = msg.get("msg_type")
        content = msg.get("content", {})
        if msg.get("dropped") and kind in ("stream", "execute_result", "display_data",
                                           "update_display_data", "error", "execute_reply"):
            self._dropped(str(kind), msg["dropped"])
            if self.on_change is not None:
                self.on_change()
            return
        if kind == "stream":
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            if self._sizes[name] < self.max_bytes:
                self.events.append({"type": "stream", "name": name, "text": self._take(name, content.get("text", ""))})
            else:
                self.truncated = True
        elif kind == "execute_result":
            data = content.get("data", {})
            self.result = data.get("text/plain")
            self.execution_count = content.get("execution_count", self.execution_count)
            rich = {k: v for k, v in data.items() if k != "text/plain"}
            if rich:
                self._add_output({"type": "execute_result", "data": data, "metadata": content.get("metadata", {})})
            else:
                self.events.append({"type": "execute_result", "data": {"text/plain": self.result or ""},
                                    "metadata": {}})
        elif kind in ("display_data", "update_display_data"):
            self._add_output({"type": kind, "data": content.get("data", {}), "metadata": content.get("metadata", {})})
        elif kind == "error":
            self.error = RunError(
                ename=content.get("ename", ""),
                evalue=content.get("evalue", ""),
                traceback=strip_ansi("\n".join(content.get("traceback", []))),
            )
            self.events.append({"type": "error", **self.error.model_dump()})
        elif kind == "execute_reply":
            self.reply_status = content.get("status")
            self.execution_count = content.get("execution_count", self.execution_count)
            metadata = msg.get("metadata")
            note = metadata.get(NOTE_KEY) if isinstance(metadata, dict) else None
            if isinstance(note, str):  # checked with the rest when harvested (artifacts/channel.py)
                self.file_changes = note.encode("utf-8", "replace")
            if content.get("status") == "error" and self.error is None:
                self.error = RunError(
                    ename=content.get("ename", ""),
                    evalue=content.get("evalue", ""),
                    traceback=strip_ansi("\n".join(content.get("traceback", []))),
                )
        elif kind == "comm_msg" and content.get("comm_id") == CHANGES_COMM and msg.get("buffers"):
            self.file_changes = bytes(msg["buffers"][0])  # harvested after the run (artifacts/channel.py)
            return
        else:
            return
        if self.on_change is not None:
            self.on_change()

    def _stream(self, name: str) -> str:
        return "".join(e["text"] for e in self.events if e["type"] == "stream" and e["name"] == name)

    @property
    def stdout(self) -> str:
        return self._stream("stdout")

    @property
    def stderr(self) -> str:
        return self._stream("stderr")

    def to_result(self, run_id: str, session_id: str, status: RunStatus, **extra: Any) -> RunResult:
        """The RunResult of what was collected (``extra``: the fields the collector does not know,
        such as ``state_lost``, ``cause``, ``tool_calls`` or ``duration_ms``)."""
        fields: dict[str, Any] = {
            "stdout": self.stdout, "stderr": self.stderr, "result": self.result, "outputs": list(self.outputs),
            "error": self.error, "execution_count": self.execution_count, "truncated": self.truncated,
            "outputs_dropped": self.dropped_outputs}
        return RunResult(run_id=run_id, session_id=session_id, status=status, **(fields | extra))
