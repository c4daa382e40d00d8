"""The OpenAPI document, generated from the pydantic models.

Every operation has an ``operationId`` (what client generators name methods after) and a tag.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic.json_schema import models_json_schema

from .. import __version__
from ..models import (
    SESSION_ID_PATTERN,
    ApprovalAnswer,
    ApprovalRequest,
    ArtifactList,
    CheckpointInfo,
    CheckpointList,
    ErrorBody,
    ExecuteRequest,
    FileDeleted,
    FileList,
    Health,
    OneShotRequest,
    PackagesRequest,
    PackagesResult,
    RunProgress,
    RunResult,
    SessionCreate,
    SessionInfo,
    SessionList,
    ToolList,
    ToolMatches,
    UploadResult,
)
from ..sessions.listing import DEFAULT_LIMIT, MAX_LIMIT
from . import jupyter_openapi

_MODELS = [SessionCreate, SessionInfo, SessionList, ExecuteRequest, RunResult, ErrorBody, Health, ToolList,
           FileList, ToolMatches, ArtifactList, UploadResult, FileDeleted, RunProgress, OneShotRequest, ApprovalRequest,
           ApprovalAnswer, PackagesRequest, PackagesResult, CheckpointInfo, CheckpointList]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again",
                                "schema": {"type": "integer", "minimum": 1}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Bad JSON", 401: "Missing or wrong token", 403: "Forbidden", 404: "Unknown session or run", 409: "Conflict",
            413: "Too large", 422: "Invalid request",
            429: "Too many sessions (too_many_sessions), or a tenant's quota is spent (quota_exceeded)",
            502: "The kernel's file agent answered wrongly (file_transfer_failed)",
            503: "Kernel or gateway unavailable; or, creating a session in a burst, too many kernel "
                 "starts queued (server_busy, with Retry-After)"}
    out = {str(c): _json("ErrorBody", text[c]) for c in codes}
    for c in (429, 503):
        if c in codes:
            out[str(c)]["headers"] = _RETRY_AFTER
    return out


# (path, method) -> (operationId, tag)
_OPERATIONS = {
    ("/healthz", "get"): ("getHealth", "health"),
    ("/readyz", "get"): ("getReadiness", "health"),
    ("/metrics", "get"): ("getMetrics", "health"),
    ("/openapi.json", "get"): ("getOpenAPI", "health"),
    ("/v1/tools", "get"): ("listTools", "tools"),
    ("/v1/sessions", "get"): ("listSessions", "sessions"),
    ("/v1/sessions", "post"): ("createSession", "sessions"),
    ("/v1/execute", "post"): ("executeOneShot", "runs"),
    ("/v1/sessions/{session_id}", "get"): ("getSession", "sessions"),
    ("/v1/sessions/{session_id}", "delete"): ("deleteSession", "sessions"),
    ("/v1/sessions/{session_id}/execute", "post"): ("execute", "runs"),
    ("/v1/runs/{run_id}", "get"): ("getRun", "runs"),
    ("/v1/runs/{run_id}/approvals/{call_id}", "post"): ("decideApproval", "runs"),
    ("/v1/sessions/{session_id}/interrupt", "post"): ("interruptSession", "sessions"),
    ("/v1/sessions/{session_id}/restart", "post"): ("restartSession", "sessions"),
    ("/v1/sessions/{session_id}/files", "get"): ("listFiles", "files"),
    ("/v1/sessions/{session_id}/files/{path}", "put"): ("uploadFile", "files"),
    ("/v1/sessions/{session_id}/files/{path}", "get"): ("downloadFile", "files"),
    ("/v1/sessions/{session_id}/files/{path}", "delete"): ("deleteFile", "files"),
    ("/v1/sessions/{session_id}/artifacts", "get"): ("listArtifacts", "artifacts"),
    ("/v1/artifacts/{key}", "get"): ("downloadArtifact", "artifacts"),
    ("/v1/sessions/{session_id}/notebook", "get"): ("exportNotebook", "sessions"),
    ("/v1/sessions/{session_id}/channels", "get"): ("connectChannels", "console"),
    ("/v1/sessions/{session_id}/packages", "post"): ("installPackages", "sessions"),
    ("/v1/sessions/{session_id}/checkpoint", "post"): ("checkpointSession", "sessions"),
    ("/v1/sessions/{session_id}/checkpoints", "get"): ("listCheckpoints", "sessions"),
}
_TAGS = [
    {"name": "sessions", "description": "Stateful sessions: one sandboxed kernel each"},
    {"name": "runs", "description": "Running code, and following long runs"},
    {"name": "files", "description": "The session's workspace (/mnt/data in the kernel)"},
    {"name": "artifacts", "description": "Files and outputs that runs produced, with download links"},
    {"name": "tools", "description": "Host tools callable from kernel code"},
    {"name": "console", "description": "A person's console on a live session"},
    {"name": "health", "description": "Probes, metrics and this document"},
    jupyter_openapi.TAG,
]


_TOOL_SEARCH = [
    {"name": "q", "in": "query", "required": False, "description": "An intent in words, e.g. 'list the "
     "commits of a repository': answers the tools that best fit it, ranked (BM25)",
     "schema": {"type": "string", "minLength": 1, "maxLength": 1000}},
    {"name": "limit", "in": "query", "required": False, "description": "How many matches at most (with q)",
     "schema": {"type": "integer", "minimum": 1, "maximum": 50, "default": 8}},
]

_SESSION_PAGE = [
    {"name": "limit", "in": "query", "required": False, "description": "Sessions per page at most",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT}},
    {"name": "cursor", "in": "query", "required": False, "description": "The previous page's next_cursor "
     "(opaque, bound to the listing tenant); omitted: the first page",
     "schema": {"type": "string", "minLength": 1, "maxLength": 512}},
]


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
        "/readyz": {"get": {"summary": "Readiness (gateway up, sandbox usable, workspaces can be made, pool not failing)", "security": [],
                            "responses": {"200": _json("Health", "Ready"), "503": _json("Health", "Not ready")}}},
        "/openapi.json": {"get": {"summary": "This document",
                                  "responses": {"200": {"description": "OpenAPI 3.1",
                                                        "content": {"application/json": {"schema": {"type": "object"}}}},
                                                **_errors(401)}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format), behind the token",
                             "responses": {"200": {"description": "Prometheus text exposition format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors(401)}}},
        "/v1/tools": {"get": {"summary": "Host tools callable from kernel code as tools.NAME(...); with q, "
                                         "the ones that best fit an intent (search_tools)",
                              "parameters": _TOOL_SEARCH,
                              "responses": {"200": {"description": "Without q: every tool (ToolList); with q: "
                                                    "the best matches, best first (ToolMatches)",
                                                    "content": {"application/json": {"schema": {"anyOf": [
                                                        _ref("ToolList"), _ref("ToolMatches")]}}}},
                                            **_errors(401, 422)}}},
        "/v1/sessions": {
            "get": {"summary": "List sessions, a page at a time (creation order, then id)",
                    "parameters": _SESSION_PAGE,
                    "responses": {"200": _json("SessionList", "A page of sessions; next_cursor when more remain"),
                                  **_errors(401, 422)}},
            "post": {"summary": "Create a session", "requestBody": body("SessionCreate"),
                     "responses": {"201": _json("SessionInfo", "Created"), **_errors(400, 401, 409, 422, 429, 503),
                                   "403": _json("ErrorBody", "A package refused by the policy, or a request pip "
                                                "could read as a file, path, URL or option (package_refused, "
                                                "details.rule)"),
                                   "404": _json("ErrorBody", "Unknown fork_of session or from_checkpoint "
                                                "checkpoint (session_not_found, checkpoint_not_found)"),
                                   "502": _json("ErrorBody", "The package index or pip failed (package_fetch_failed)")}},
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
                                                "output so far; poll GET /v1/runs/{run_id}. Or status="
                                                "awaiting_approval: see pending_approvals"),
                                   **_errors(400, 401, 404, 413, 422, 429, 503)}},
        },
        "/v1/runs/{run_id}": {
            "parameters": [{"name": "run_id", "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}],
            "get": {"summary": "A run's output since offset, and its result once it ended",
                    "parameters": [
                        {"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                        {"name": "wait_seconds", "in": "query",
                         "schema": {"type": "number", "minimum": 0, "maximum": 60},
                         "description": "Hold the answer until there is new output or the run ends"},
                        {"name": "approvals_version", "in": "query", "schema": {"type": "integer"},
                         "description": "The approvals_version of the previous answer: a wait also ends "
                                        "on any change of the pending approvals since then"}],
                    "responses": {"200": _json("RunProgress", "Progress"), **_errors(401, 404, 422)}},
        },
        "/v1/runs/{run_id}/approvals/{call_id}": {
            "parameters": [{"name": n, "in": "path", "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}} for n in ("run_id", "call_id")],
            "post": {"summary": "Approve or deny a call listed in the run's pending_approvals (status "
                                "awaiting_approval); a denied call raises ToolDenied in the code",
                     "requestBody": {**body("ApprovalRequest"), "required": True},
                     "responses": {"200": _json("ApprovalAnswer", "Decided"),
                                   "409": _json("ErrorBody", "Already decided (or timed out, or the run ended)"),
                                   **_errors(400, 401, 404, 422)}},
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
                    "responses": {"201": _json("UploadResult", "Stored"), **_errors(401, 404, 409, 413, 422, 502, 503)}},
            "get": {"summary": "Download a workspace file",
                    "responses": {"200": {"description": "The bytes"}, **_errors(401, 404, 422, 502, 503)}},
            "delete": {"summary": "Delete a workspace file (through the kernel's channels)",
                       "responses": {"200": _json("FileDeleted", "Deleted"), **_errors(401, 404, 422, 502, 503)}},
        },
        "/v1/sessions/{session_id}/artifacts": {
            "parameters": [sid],
            "get": {"summary": "Artifacts of the session's runs (also after it was deleted)",
                    "responses": {"200": _json("ArtifactList", "Artifacts"), **_errors(401, 404)}},
        },
        "/v1/artifacts/{key}": {
            "parameters": [{"name": "key", "in": "path", "required": True, "schema": {"type": "string"},
                            "description": "The artifact's key, {session_id}/{run_id}/..."}],
            "get": {"summary": "Download an artifact through a signed, expiring link of the local store "
                               "(the download_url of an artifact); needs no token",
                    "security": [],
                    "parameters": [{"name": "expires", "in": "query", "required": True, "schema": {"type": "string"},
                                    "description": "Expiry, Unix seconds (part of the link)"},
                                   {"name": "sig", "in": "query", "required": True, "schema": {"type": "string"},
                                    "description": "The link's signature"}],
                    "responses": {"200": {"description": "The artifact's bytes, with its own Content-Type"},
                                  "403": _json("ErrorBody", "Invalid or expired link: ask for a fresh one "
                                               "(GET /v1/sessions/{session_id}/artifacts)"),
                                  "404": _json("ErrorBody", "No such artifact, or the store is S3 (its "
                                               "links point at S3 itself)")}},
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
        "/v1/sessions/{session_id}/packages": {
            "parameters": [sid],
            "post": {"summary": "Install packages into the session (wheels fetched by the manager; the "
                                "kernel stays offline)", "requestBody": {**body("PackagesRequest"), "required": True},
                     "responses": {"200": _json("PackagesResult", "Installed (or already there)"),
                                   **_errors(401, 404, 429, 503),
                                   "403": _json("ErrorBody", "Refused by the policy or a conflict with the "
                                                "kernel's own packages (package_refused, naming the rule)"),
                                   "422": _json("ErrorBody", "No wheel for the kernel's platform (no_wheel), "
                                                "or a bad requirement (invalid_request)"),
                                   "502": _json("ErrorBody", "The index or pip failed (package_fetch_failed)")}},
        },
        "/v1/sessions/{session_id}/checkpoint": {
            "parameters": [sid],
            "post": {"summary": "Save the session's variables and workspace files (restored after a kernel's "
                               "death; fork with POST /v1/sessions {\"from_checkpoint\": ID})",
                     "responses": {"200": _json("CheckpointInfo", "Saved (skipped names with their reasons)"),
                                   **_errors(401, 404, 409, 503)}},
        },
        "/v1/sessions/{session_id}/checkpoints": {
            "parameters": [sid],
            "get": {"summary": "The session's checkpoints, newest first",
                    "responses": {"200": _json("CheckpointList", "Checkpoints"), **_errors(401, 404)}},
        },
    }
    paths.update(jupyter_openapi.jupyter_paths(_errors))
    # Handlers stream their bodies, so no form body is parsed before the token check (nor at all);
    # a 400 on any route is a request tornado cannot parse (its framing, a bad Content-Length).
    for path, item in paths.items():
        for method, op in item.items():
            if isinstance(op, dict) and "responses" in op:
                op["operationId"], tag = {**_OPERATIONS, **jupyter_openapi.OPERATIONS}[(path, method)]
                op["tags"] = [tag]
                op["responses"].setdefault("400", _json("ErrorBody", "Malformed request"))
    return {
        "openapi": "3.1.0",
        "info": {"title": "kernelmode", "version": __version__,
                 "description": "Stateful, sandboxed Python sessions for AI agents and automation."},
        "tags": _TAGS,
        "paths": paths,
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
