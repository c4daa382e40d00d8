"""The log formats of `serve` / `kernelmode mcp` (logs.py) and the start-up block (banner.py)."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from kernelmode.audit import audit
from kernelmode.banner import startup_block
from kernelmode.logs import resolve_format, setup_logging

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) +[\w.]+: ")


@pytest.fixture()
def captured() -> Iterator[None]:
    """setup_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit(fmt: str) -> list[str]:
    out = io.StringIO()
    setup_logging("info", fmt, out)  # type: ignore[arg-type]
    logging.getLogger("kernelmode.test").info("plain %s", "message")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("kernelmode.test").exception("with a traceback")
    audit("session_created", session_id="s1", tenant="admin", from_pool=True)
    return out.getvalue().splitlines()


def test_every_json_line_has_ts_and_level(captured: None) -> None:
    lines = [json.loads(x) for x in _emit("json")]
    assert len(lines) == 3
    assert all("ts" in x and "level" in x for x in lines)
    plain, failed, event = lines
    assert plain["message"] == "plain message" and plain["level"] == "info"
    assert failed["level"] == "error" and "ValueError: boom" in failed["exc"]
    assert event["event"] == "session_created" and event["session_id"] == "s1" and event["from_pool"] is True


def test_audit_lines_begin_with_ts_so_readers_can_pick_them_out(captured: None) -> None:
    raw = _emit("json")
    assert [x.startswith('{"ts"') for x in raw] == [False, False, True]


def test_text_lines_are_readable_with_timestamps(captured: None) -> None:
    lines = _emit("text")
    assert TEXT_LINE.match(lines[0]) and lines[0].endswith("kernelmode.test: plain message")
    assert TEXT_LINE.match(lines[1]) and "Traceback" in lines[2]
    event = lines[-1]
    assert TEXT_LINE.match(event) and "session_created session_id=s1 tenant=admin from_pool=true" in event
    assert not any(x.startswith("{") for x in lines)


def test_auto_is_text_on_a_terminal_and_json_elsewhere() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert resolve_format("auto", Tty()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", Tty()) == "json"


def test_block_shows_a_generated_token_and_the_lines_that_use_it() -> None:
    block = startup_block("http://127.0.0.1:8888", "generated-token-1234567890", "generated", "bwrap", True)
    lines = block.splitlines()
    assert lines[0] == "kernelmode serving on http://127.0.0.1:8888  (sandbox: bwrap)"
    assert "  export KERNELMODE_URL=http://127.0.0.1:8888 KERNELMODE_TOKEN=generated-token-1234567890" in lines
    assert ('  claude mcp add --transport http kernelmode http://127.0.0.1:8888/mcp '
            '--header "Authorization: Bearer generated-token-1234567890"') in lines


@pytest.mark.parametrize("source", ["KERNELMODE_TOKEN", "config", "--token"])
def test_block_never_prints_a_chosen_token_in_full(source: str) -> None:
    token = "a-secret-the-user-chose-0123456789"
    block = startup_block("http://127.0.0.1:8888", token, source, "docker", True)  # type: ignore[arg-type]
    assert token not in block and token[:4] + "…" in block
    assert 'Bearer $KERNELMODE_TOKEN"' in block and "http://127.0.0.1:8888/mcp" in block


def test_block_says_when_mcp_is_off() -> None:
    block = startup_block("http://[::1]:8888", "t" * 24, "generated", "bwrap", False)
    assert "MCP       off" in block and "claude mcp add" not in block


def test_an_audit_line_is_encoded_once_and_stays_json_for_other_handlers(captured: None) -> None:
    """Our formatters read the record's fields (one JSON encoding a line); a handler of its own
    (library mode) still gets the JSON line as the message."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    out = io.StringIO()
    setup_logging("info", "json", out)  # type: ignore[arg-type]
    logging.getLogger().addHandler(Keep())
    audit("run", session_id="s1", run_id="r1", status="ok", cause=None, odd={1, 2})
    [ours] = [json.loads(x) for x in out.getvalue().splitlines()]
    theirs = json.loads(records[0].getMessage())
    assert theirs["ts"] == ours["ts"] and theirs["event"] == ours["event"] == "run"
    assert {k: v for k, v in ours.items() if k != "level"} == theirs
    assert theirs["odd"] == "{1, 2}" and theirs["cause"] is None  # what JSON cannot hold, as a string
