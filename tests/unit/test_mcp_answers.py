"""A run's MCP answer without a kernel: its structured content leaves defaults out and still
validates against the tool's outputSchema; the message cap measures a size the caller gives;
a run's wait ends at its timeout."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jsonschema import Draft202012Validator

from kernelmode.config import McpFrontSettings
from kernelmode.gateway.execution import OutputCollector
from kernelmode.mcp.answers import RunAnswers
from kernelmode.mcp.budget import McpRunResult, fit_message, wire_bytes
from kernelmode.models import EgressUse, RunResult
from kernelmode.sessions.runs import LiveRun

RUN = "a" * 32
SESSION = "b" * 32


async def _answer(result: RunResult) -> dict[str, Any]:
    answer = await RunAnswers(McpFrontSettings()).result("conn", result, None)
    assert answer.structured_content is not None
    return answer.structured_content


async def test_structured_content_leaves_defaults_out_and_keeps_the_schema() -> None:
    plain = await _answer(RunResult(run_id=RUN, session_id=SESSION, status="ok", result="2",
                                    execution_count=1, duration_ms=3.5))
    assert plain == {"run_id": RUN, "session_id": SESSION, "status": "ok", "result": "2",
                     "execution_count": 1, "duration_ms": 3.5}
    printed = await _answer(RunResult(run_id=RUN, session_id=SESSION, status="ok", stdout="hi\n"))
    assert printed["stdout"] == "hi\n" and printed["stdout_total"] == 3 and "stdout_offset" not in printed
    schema = McpRunResult.model_json_schema()
    for sc in (plain, printed):
        assert not list(Draft202012Validator(schema).iter_errors(sc))
        # A reader gets the whole record back from the schema's defaults.
        full = McpRunResult.model_validate(sc).model_dump(mode="json")
        assert full["stderr"] == "" and full["outputs"] == [] and full["more_output"] is False


async def test_fit_message_takes_the_callers_measure() -> None:
    run = {"content": [{"type": "text", "text": "x" * 5000}],
           "structuredContent": {"run_id": RUN, "session_id": SESSION, "status": "ok", "stdout": "y" * 5000}}
    assert await fit_message(run, 100_000, size=len(json.dumps(run))) is run  # fits: itself, untouched
    cut = await fit_message(run, 65_536, size=70_000)  # the caller measured more than the cap
    assert cut is not run and wire_bytes(cut) <= 65_536
    # A run's record without a `cut` list (left out at its default) still says what was cut.
    assert cut["structuredContent"]["cut"][-1].startswith("this answer's structured content was cut")
    assert cut["content"][0]["text"].startswith("NOTE: this answer was over the MCP message cap")


async def test_a_runs_wait_ends_at_its_timeout_or_its_change() -> None:
    run = LiveRun(run_id=RUN, session_id=SESSION, collector=OutputCollector(1000))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await run.wait_changed(0, 0.05)  # nothing happens: back after the timeout
    assert loop.time() - t0 >= 0.04
    waiting = asyncio.create_task(run.wait_changed(0, 60))
    await asyncio.sleep(0)
    run.collector.events.append({"type": "stream", "name": "stdout", "text": "x"})
    run.changed.set()
    await asyncio.wait_for(waiting, 10)


async def test_refused_egress_hosts_are_named_in_one_line() -> None:
    used = [EgressUse(host="api.github.com", port=443, allowed=True, requests=2, bytes=900),
            EgressUse(host="evil.test", port=443, allowed=False, requests=1, bytes=0),
            EgressUse(host="files.test", port=8443, allowed=False, requests=3, bytes=0)]
    result = RunResult(run_id=RUN, session_id=SESSION, status="ok", stdout="done\n", egress=used)
    answer = await RunAnswers(McpFrontSettings()).result("conn", result, None)
    text = answer.content[0].text  # type: ignore[union-attr]
    lines = [line for line in text.splitlines() if "egress refused" in line]
    assert len(lines) == 1 and "evil.test, files.test:8443" in lines[0] and "api.github.com" not in lines[0], text
    assert answer.structured_content is not None and len(answer.structured_content["egress"]) == 3
    quiet = RunResult(run_id=RUN, session_id=SESSION, status="ok", egress=used[:1])
    assert "egress refused" not in (await RunAnswers(McpFrontSettings()).result("c", quiet, None)).content[0].text  # type: ignore[union-attr]
