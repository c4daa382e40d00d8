"""Log output of the CLI's long-running commands (`serve`, `mcp`): JSON lines or readable text.

JSON (the default when stderr is not a terminal): one object per line, each with ``ts`` (UTC,
ISO 8601) and ``level``. Audit lines (``kernelmode.audit``) begin with ``ts`` and carry ``event``
and their fields; other lines begin with ``level`` and carry ``logger`` and ``message`` (and
``exc`` with a traceback). Text (the default on a terminal): ``TIME LEVEL LOGGER: message``, audit
events as ``event key=value ...``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, Literal, TextIO

from .audit import AUDIT_FIELDS

LogFormat = Literal["auto", "text", "json"]


def _ts(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an audit record's fields as they are, with ``level`` added."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] | None = getattr(record, AUDIT_FIELDS, None)
        if fields is not None:
            return json.dumps({"ts": fields["ts"], "level": record.levelname.lower(),
                               **{k: v for k, v in fields.items() if k != "ts"}}, default=str)
        line: dict[str, Any] = {"level": record.levelname.lower(), "ts": _ts(record),
                                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """``2025-01-31 12:00:00.123 INFO  kernelmode: message`` (local time, for people)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M:%S")
        head = f"{when}.{int(record.msecs):03d} {record.levelname:<7} {record.name}:"
        fields: dict[str, Any] | None = getattr(record, AUDIT_FIELDS, None)
        if fields is not None:
            rest = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if k not in ("ts", "event"))
            text = f"{head} {fields['event']} {rest}".rstrip()
        else:
            text = f"{head} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _short(value: Any) -> str:
    s = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(s) if (not s or " " in s) and isinstance(value, str) else s


def resolve_format(fmt: LogFormat, stream: TextIO) -> Literal["text", "json"]:
    """``auto``: text on a terminal, JSON otherwise (a service manager, a file, a log shipper)."""
    if fmt != "auto":
        return fmt
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


def setup_logging(level: str, fmt: LogFormat = "auto", stream: TextIO | None = None) -> None:
    """Every record of the process to ``stream`` (stderr) in the chosen format."""
    out = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter() if resolve_format(fmt, out) == "text" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("tornado.access").setLevel(logging.WARNING)
