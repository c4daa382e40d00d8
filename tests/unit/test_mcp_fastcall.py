"""Which bodies the direct MCP route (kernelmode/mcp/fastcall.py) takes: exactly one tools/call of
run_python or get_run without a progress token; everything else is left to the SDK."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kernelmode.mcp.fastcall import parse_call


def body(msg: Any) -> bytes:
    return json.dumps(msg).encode()


def call(**params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "run_python", "arguments": {"code": "1+1"}, **params}}


def test_a_run_python_call_is_taken() -> None:
    assert parse_call(body(call())) == (7, "run_python", {"code": "1+1"})
    assert parse_call(body({**call(), "id": "a"})) == ("a", "run_python", {"code": "1+1"})
    assert parse_call(body(call(name="get_run", arguments={"run_id": "x"}))) == (7, "get_run", {"run_id": "x"})
    assert parse_call(body(call(_meta={"other": 1}))) is not None
    no_args = call()
    del no_args["params"]["arguments"]
    assert parse_call(body(no_args)) == (7, "run_python", {})


@pytest.mark.parametrize("msg", [
    call(_meta={"progressToken": 1}),                     # wants progress: an SSE answer
    call(name="list_sessions"),                           # another tool
    call(arguments=["1+1"]),                              # arguments not an object
    call(extra=1),                                        # a params key the route does not know
    {**call(), "id": True},                               # a bool is not an id
    {**call(), "id": None},
    {k: v for k, v in call().items() if k != "id"},       # a notification
    {**call(), "jsonrpc": "1.0"},
    {**call(), "method": "tools/list"},
    {**call(), "more": 1},
    [call()],                                             # a batch
    "tools/call",
])
def test_anything_else_goes_to_the_sdk(msg: Any) -> None:
    assert parse_call(body(msg)) is None


def test_bodies_that_are_not_json() -> None:
    assert parse_call(b"") is None
    assert parse_call(b"{") is None
    assert parse_call(b"\xff\xfe") is None

