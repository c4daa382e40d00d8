"""Settings of what kernels can use: host tools, upstream MCP servers, the tool broker and its
approvals, the code policy, artifacts, the MCP front door, packages, the kernel environment.

The descriptions are the configuration reference's (docs/reference/settings.md is generated from
these models by scripts/gen_docs.py): say what a key does in a sentence or two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import _Section


class ToolSettings(_Section):
    """A Python callable of the manager's environment, callable from kernels as tools.NAME."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """The name in kernels (`tools.word_count`). Must be unique among `tools` and `mcp_servers`
    names (checked by `serve` at start)."""
    function: str = Field(description="'package.module:callable'", pattern=r"^[\w.]+:[\w.]+$")
    description: str | None = None
    """Shown in `tools.help()`, `GET /v1/tools` and MCP `list_tools`; `null`: the function's
    docstring."""
    requires_approval: bool = Field(False, description="Each call waits for a person's yes/no "
                                    "(REST approvals route or MCP elicitation); no answer: denied.")


class McpServerSettings(_Section):
    """An upstream MCP server whose tools kernels call as tools.NAME.TOOL: stdio or HTTP."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """Namespace of the server's tools in kernels (`tools.github.list_commits`) and in session
    allow-lists. Unique among `tools` and `mcp_servers`."""
    command: str | None = None
    """Stdio: the program to start (looked up on the `PATH` below). A server that exits is
    restarted."""
    args: list[str] = Field(default_factory=list)
    """Stdio: its arguments."""
    env: dict[str, str] = Field(default_factory=dict)
    """Stdio: its environment, added to `PATH`, `HOME` and `LANG` of the manager (the MCP SDK
    also passes `LOGNAME`, `SHELL`, `TERM`, `USER`). Nothing else of the manager's environment
    is passed: put the server's secrets here as `${VAR}`."""
    cwd: str | None = None
    """Stdio: its working directory; `null`: the manager's."""
    url: str | None = None
    """Streamable HTTP: the endpoint, e.g. `http://127.0.0.1:9000/mcp`."""
    headers: dict[str, str] = Field(default_factory=dict)
    """HTTP: headers sent with every request, e.g. `Authorization: "Bearer ${SEARCH_TOKEN}"`.
    Ignored for `command`."""
    connect_timeout_seconds: float = Field(30.0, gt=0)
    """Bound on connecting, initializing and listing the server's tools (`serve` waits at most
    about this long per server at start); for HTTP also the connect timeout of each request
    (reads may take up to 300 s, each call being bounded by `tool_calls.call_timeout_seconds`)."""
    requires_approval: bool | list[str] = Field(
        False, description="true: every tool of this server waits for approval; a list: only the "
        "named tools (the server's own names, without the 'NAME.' prefix).")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either 'command' (stdio) or 'url' (streamable HTTP), not both")
        return self


class ToolBrokerSettings(_Section):
    call_timeout_seconds: float = Field(30.0, gt=0)
    """Per call: a tool that has not returned by then gives `ToolError` in the kernel (a sync
    Python tool keeps running in its thread; its result is dropped)."""
    rate_per_second: float = Field(200.0, gt=0, description="Per-session tool calls per second.")
    rate_burst: int = Field(1000, ge=1)
    """Bucket size: calls a session may make at once before the rate applies."""
    max_argument_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest JSON request (arguments) of one call."""
    max_result_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest JSON reply of one call. Values above ~10 MiB do not help: the reply travels to the
    kernel over the Kernel Gateway's websocket, whose message limit is 10 MiB."""
    max_recorded_calls: int = Field(1000, ge=1, description="Calls listed in one RunResult.")
    approval_timeout_seconds: float = Field(
        300.0, gt=0, le=86_400, description="A call that requires approval and gets no answer within "
        "this long is denied.")
    max_pending_approvals_per_session: int = Field(
        8, ge=1, description="Calls (and runs) of one session awaiting approval at once; more are denied at once.")
    max_pending_approvals_per_tenant: int = Field(
        32, ge=1, description="Calls (and runs) of one tenant's sessions awaiting approval at once.")
    max_pending_approval_bytes_per_session: int = Field(
        8 * 1024 * 1024, ge=1024, description="Bytes of the arguments of one session's calls awaiting approval.")
    max_pending_approval_bytes_per_tenant: int = Field(
        32 * 1024 * 1024, ge=1024, description="Bytes of the arguments of one tenant's calls awaiting approval.")


class PolicySettings(_Section):
    """The code policy hook, called before each run (REST, MCP, and console and Jupyter cells)."""

    module: str | None = Field(
        None, pattern=r"^[\w.]+:[\w.]+$", description="'package.module:callable' given code, "
        "session_id and tenant; answers 'allow', ('deny', reason) or ('ask', reason). Null: off.")
    timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="A policy that has not answered within this long denies the "
        "run (it holds the session's lock while it decides).")


class ArtifactSettings(_Section):
    """Where harvested files and outputs go: ``local`` (under the data dir) or ``s3``."""

    store: Literal["local", "s3"] = "local"
    """`local`: files under `DATA_DIR/artifacts`, links served by this server at
    `/v1/artifacts/...`, signed (HMAC) and expiring. `s3`: any S3-compatible service (AWS S3,
    MinIO, ...), links presigned by it."""
    link_ttl_seconds: int = Field(7 * 24 * 3600, ge=60, le=7 * 24 * 3600)
    """Lifetime of download links (both stores; 7 days is S3's presigning maximum). `GET
    /v1/sessions/{id}/artifacts` gives fresh links."""
    public_url: str | None = Field(None, description="Base URL of this server as clients reach it "
                                   "(for local-store links); default http://HOST:PORT.")
    max_artifact_bytes: int = Field(100 * 1024 * 1024, ge=1024)
    """A larger file is not kept (`artifacts_truncated: true`)."""
    max_upload_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="Largest file upload.")
    max_artifacts_per_run: int = Field(50, ge=1)
    """Artifacts kept per run (files first, then outputs); beyond, `artifacts_truncated: true`."""
    # s3
    endpoint: str | None = Field(None, description="host:port of the S3 API, e.g. minio:9000")
    secure: bool = False
    """S3 only: HTTPS to the endpoint (and `https://` links)."""
    access_key: str | None = None
    """S3 only (required there): access key; use `${VAR}`."""
    secret_key: str | None = None
    """S3 only (required there): secret key; use `${VAR}`."""
    bucket: str = "kernelmode"
    """S3 only: bucket for artifacts (keys `{session_id}/{run_id}/...`); created at start if
    missing."""
    region: str | None = None
    """S3 only: region for the client and for creating the bucket; `null`: the client's default."""

    @model_validator(mode="after")
    def _s3_complete(self) -> ArtifactSettings:
        if self.store == "s3":
            missing = [k for k in ("endpoint", "access_key", "secret_key") if not getattr(self, k)]
            if missing:
                raise ValueError(f"store s3 needs {', '.join(missing)}")
        return self


class McpFrontSettings(_Section):
    """The MCP front door (`/mcp` and `kernelmode mcp`)."""

    enabled: bool = Field(True, description="Serve MCP at /mcp on the REST port.")
    wait_seconds: float = Field(
        20.0, ge=0, description="How long run_python waits before returning status 'running' "
        "(below common MCP client time-outs of 30-60 s).")
    max_text_chars: int = Field(
        8_000, ge=500, description="Budget for the whole text of a tool result (what a model reads): "
        "head and tail of each part kept, the cut marked.")
    max_structured_chars: int = Field(
        16_000, ge=1_000, description="Characters of each stream (stdout, stderr) one run_python or "
        "get_run answer carries in its structured content; the rest waits for the next get_run.")
    max_message_bytes: int = Field(
        900_000, ge=65_536, le=1_000_000, description="Cap on one serialized MCP message (the SDK "
        "client rejects events over 1 MiB): larger answers are cut, saying what and where the whole is.")
    max_image_bytes: int = Field(
        1_000_000, ge=10_000, description="Images returned inline are downscaled below this size "
        "(and below their share of max_message_bytes).")
    max_images: int = Field(4, ge=0, description="Images returned inline per result.")
    max_request_bytes: int = Field(
        32 * 1024 * 1024, ge=65_536, description="Largest MCP request (upload_file sends base64).")
    max_sessions: int = Field(
        10_000, ge=1, description="Open MCP connections (Mcp-Session-Id) at /mcp, all tenants together.")
    max_sessions_per_tenant: int = Field(
        1_000, ge=1, description="Open MCP connections at /mcp per tenant (token); beyond, opening "
        "another answers 503 until one closes or idles out (30 min).")
    json_answers: bool = Field(
        True, description="Answer a call at /mcp as plain JSON when its SSE stream would carry only "
        "the answer (no progress token asked, no elicitation or sampling declared by the client): the "
        "client keeps its connection instead of opening one per call. false: always SSE.")
    fast_calls: bool = Field(
        True, description="Answer run_python and get_run calls that get a plain JSON answer "
        "(json_answers) on a direct route instead of through the MCP SDK's per-message machinery: "
        "the same checks and the same answer, a fraction of the server's CPU per call. false: "
        "every call goes through the SDK.")


class PackageSettings(_Section):
    """Packages on demand (kernelmode/packages/): the manager downloads wheels, never runs them."""

    index_url: str | None = Field(None, description="Index to download wheels from (pip's "
                                  "--index-url); unset: the host's global pip configuration (/etc/pip.conf; "
                                  "PIP_* variables and per-user configuration are ignored).")
    extra_index_urls: list[str] = Field(default_factory=list, description="More indexes (--extra-index-url).")
    allow: list[str] | None = Field(None, description="Only these may be installed (names, globs, "
                                    "version specifiers: 'requests', 'django-*', 'numpy<3'); "
                                    "unset: any not denied.")
    deny: list[str] = Field(default_factory=list, description="Never installed, even as a dependency "
                            "(same forms as allow).")
    max_download_mb: int = Field(200, ge=1, description="Largest total download of one install.")
    cache_dir: Path | None = Field(None, description="The wheel cache shared by all sessions; unset: "
                                   "DATA_DIR/package-cache.")
    installs_per_minute: int = Field(30, ge=1, description="Install requests per tenant per minute.")
    timeout_seconds: float = Field(300.0, gt=0, description="Deadline of one download (pip).")


class KernelSettings(_Section):
    extra_requirements: list[str] = Field(
        default_factory=list, description="Packages baked into every kernel by `kernelmode setup` "
        "(`make setup`) and the image build, on top of kernel-image/requirements.txt.")
