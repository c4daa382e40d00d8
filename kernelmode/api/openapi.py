"""The OpenAPI document, generated from the pydantic models."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic.json_schema import models_json_schema

from .. import __version__
from ..models import (
    SESSION_ID_PATTERN,
    ArtifactList,
    ErrorBody,
    ExecuteRequest,
    FileList,
    Health,
    OneShotRequest,
    RunProgress,
    RunResult,
    SessionCreate,
    SessionInfo,
    SessionList,
    ToolList,
    UploadResult,
)

_MODELS = [SessionCreate, SessionInfo, SessionList, ExecuteRequest, RunResult, ErrorBody, Health, ToolList,
           FileList, ArtifactList, UploadResult, RunProgress, OneShotRequest]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Bad JSON", 401: "Missing or wrong token", 403: "Forbidden", 404: "Unknown session or run", 409: "Conflict",
            413: "Too large", 422: "Invalid request", 429: "Too many sessions", 503: "Kernel or gateway unavailable"}
    return {str(c): _json("ErrorBody", text[c]) for c in codes}


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    pairs: list[tuple[Any, Any]] = [(m, "validation") for m in _MODELS]
    _, defs = models_json_schema(pairs,
                                 ref_template="#/components/schemas/{model}")
    sid = {"name": "session_id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": SESSION_ID_PATTERN}}
    body = lambda name: {"required": False, "content": {"application/json": {"schema": _ref(name)}}}  # noqa: E731
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "Liveness", "security": [], "responses": {"200": _json("Health", "Up")}}},
        "/readyz": {"get": {"summary": "Readiness (gateway up, sandbox usable)", "security": [],
                            "responses": {"200": _json("Health", "Ready"), "503": _json("Health", "Not ready")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format), behind the token",
                             "responses": {"200": {"description": "Prometheus text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors(401)}}},
        "/v1/tools": {"get": {"summary": "Host tools callable from kernel code as tools.NAME(...)",
                              "responses": {"200": _json("ToolList", "Tools"), **_errors(401)}}},
        "/v1/sessions": {
            "get": {"summary": "List sessions", "responses": {"200": _json("SessionList", "Sessions"), **_errors(401)}},
            "post": {"summary": "Create a session", "requestBody": body("SessionCreate"),
                     "responses": {"201": _json("SessionInfo", "Created"), **_errors(400, 401, 409, 422, 429, 503)}},
        },
        "/v1/execute": {
            "post": {"summary": "One-shot run in a fresh kernel that is discarded afterwards",
                     "requestBody": {**body("OneShotRequest"), "required": True},
                     "responses": {"200": _json("RunResult", "The run, with its artifacts"),
                                   "409": _json("ErrorBody", "Two files at one path, or a file where "
                                                "another needs a folder"),
                                   **_errors(400, 401, 413, 422, 429, 503)}},
        },
        "/v1/sessions/{session_id}": {
            "parameters": [sid],
            "get": {"summary": "Get a session", "responses": {"200": _json("SessionInfo", "Session"), **_errors(401, 404)}},
            "delete": {"summary": "Delete a session (kernel, sandbox, workspace)",
                       "responses": {"204": {"description": "Deleted"}, **_errors(401, 404)}},
        },
        "/v1/sessions/{session_id}/execute": {
            "parameters": [sid],
            "post": {"summary": "Run code in the session", "requestBody": {**body("ExecuteRequest"), "required": True},
                     "responses": {"200": _json("RunResult", "The run (user-code errors are status=error)"),
                                   "202": _json("RunResult", "Still running after wait_seconds: status=running, "
                                                "output so far; poll GET /v1/runs/{run_id}"),
                                   **_errors(400, 401, 404, 413, 422, 503)}},
        },
        "/v1/runs/{run_id}": {
            "parameters": [{"name": "run_id", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}],
            "get": {"summary": "A run's output since offset, and its result once it ended",
                    "parameters": [
                        {"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                        {"name": "wait_seconds", "in": "query",
                         "schema": {"type": "number", "minimum": 0, "maximum": 60},
                         "description": "Hold the answer until there is new output or the run ends"}],
                    "responses": {"200": _json("RunProgress", "Progress"), **_errors(401, 404, 422)}},
        },
        "/v1/sessions/{session_id}/interrupt": {
            "parameters": [sid],
            "post": {"summary": "Interrupt the running code",
                     "responses": {"200": _json("SessionInfo", "Interrupt sent"), **_errors(401, 404, 503)}},
        },
        "/v1/sessions/{session_id}/files": {
            "parameters": [sid],
            "get": {"summary": "Files in the session's workspace (/mnt/data)",
                    "responses": {"200": _json("FileList", "Files"), **_errors(401, 404, 503)}},
        },
        "/v1/sessions/{session_id}/files/{path}": {
            "parameters": [sid, {"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}],
            "put": {"summary": "Upload a file (raw body); ?overwrite=true to replace",
                    "parameters": [{"name": "overwrite", "in": "query", "schema": {"type": "boolean"}}],
                    "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                    "responses": {"201": _json("UploadResult", "Stored"), **_errors(401, 404, 409, 413, 422, 503)}},
            "get": {"summary": "Download a workspace file",
                    "responses": {"200": {"description": "The bytes"}, **_errors(401, 404, 422)}},
        },
        "/v1/sessions/{session_id}/artifacts": {
            "parameters": [sid],
            "get": {"summary": "Artifacts of the session's runs (also after it was deleted)",
                    "responses": {"200": _json("ArtifactList", "Artifacts"), **_errors(401, 404)}},
        },
        "/v1/sessions/{session_id}/notebook": {
            "parameters": [sid],
            "get": {"summary": "The session's runs as a Jupyter notebook (also after it was deleted)",
                    "responses": {"200": {"description": "nbformat v4 notebook",
                                          "content": {"application/x-ipynb+json": {"schema": {"type": "object"}}}},
                                  **_errors(401, 404)}},
        },
        "/v1/sessions/{session_id}/channels": {
            "parameters": [sid],
            "get": {"summary": "Websocket to the session's kernel channels (v1.kernel.websocket.jupyter.org), "
                               "for consoles: `kernelmode console`",
                    "responses": {"101": {"description": "Switching protocols"},
                                  "400": _json("ErrorBody", "Not a websocket upgrade request"),
                                  **_errors(401, 404, 503)}},
        },
        "/v1/sessions/{session_id}/restart": {
            "parameters": [sid],
            "post": {"summary": "Restart the kernel (variables are lost)",
                     "responses": {"200": _json("SessionInfo", "Restarted"), **_errors(401, 404, 503)}},
        },
    }
    # Tornado parses a form body (urlencoded, multipart) before any handler code runs, the token
    # check included: one it cannot parse is answered 400 on every route.
    for item in paths.values():
        for op in item.values():
            if isinstance(op, dict) and "responses" in op:
                op["responses"].setdefault("400", _json("ErrorBody", "Malformed request body"))
    return {
        "openapi": "3.1.0",
        "info": {"title": "kernelmode", "version": __version__,
                 "description": "Stateful, sandboxed Python sessions for AI agents and automation."},
        "paths": paths,
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
