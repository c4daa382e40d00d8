"""The OpenAPI document: every route of the REST app is documented, every operation has a unique
operationId and a tag, and a 429 documents its Retry-After header."""

from __future__ import annotations

import re

from kernelmode.api.handlers import all_routes
from kernelmode.api.jupyter_api import jupyter_routes
from kernelmode.api.openapi import openapi_document


def _operations() -> list[tuple[str, str, dict]]:
    return [(path, method, op) for path, item in openapi_document()["paths"].items()
            for method, op in item.items() if isinstance(op, dict) and "responses" in op]


def test_every_operation_has_a_unique_operation_id_and_a_declared_tag() -> None:
    ops = _operations()
    ids = [op["operationId"] for _, _, op in ops]
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", i) for i in ids), ids
    assert len(ids) == len(set(ids)), ids
    declared = {t["name"] for t in openapi_document()["tags"]}
    for path, method, op in ops:
        assert op["tags"] and set(op["tags"]) <= declared, (method, path)


def test_every_route_is_documented() -> None:
    """Each URL pattern of the app matches a documented path (its {params} as regex groups)."""
    samples = {"run_id": "0" * 32, "call_id": "0" * 32, "kernel_id": "00000000-0000-0000-0000-000000000000"}
    documented = [re.sub(r"\{([^}]+)\}", lambda m: samples.get(m.group(1), "x"), p)
                  for p in openapi_document()["paths"]]
    for pattern, _handler in [*all_routes(), *jupyter_routes()]:
        assert any(re.fullmatch(pattern, p) for p in documented), pattern


def test_public_artifact_links_are_documented() -> None:
    item = openapi_document()["paths"]["/v1/artifacts/{key}"]
    op = item["get"]
    assert op["security"] == []  # signed links work without the bearer token
    assert {p["name"] for p in op["parameters"]} == {"expires", "sig"}
    assert {"200", "403", "404"} <= set(op["responses"])


def test_429_has_retry_after() -> None:
    with_429 = [(m, p, op) for p, m, op in _operations() if "429" in op["responses"]]
    assert {("post", "/v1/sessions"), ("post", "/v1/execute"), ("post", "/v1/sessions/{session_id}/execute")} \
        <= {(m, p) for m, p, _ in with_429}
    for _m, _p, op in with_429:
        assert "Retry-After" in op["responses"]["429"]["headers"]
