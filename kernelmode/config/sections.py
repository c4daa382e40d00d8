"""The settings models: every key of kernelmode.yaml, its type, default, range and description.

The descriptions here are the configuration reference's (docs/reference/settings.md is generated
from these models by scripts/gen_docs.py): say what a key does in a sentence or two.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..models import LimitCeilings, Limits, LimitsPatch

ENV_PREFIX = "KERNELMODE_"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Shipped inside the package (package data), so that `pip install .` works without a checkout.
GATEWAY_CONFIG_DIR = Path(str(importlib.resources.files("kernelmode.gateway") / "config"))


def default_kernel_env() -> Path:
    """Where the kernel environment (a venv with ipykernel) is by default: the checkout's
    .kernel-venv (what `make setup` builds) when kernelmode runs from a checkout; otherwise
    where `kernelmode setup` builds it: /opt/kernelmode/kernel-venv as root (readable by the
    sandbox uids, unlike /root), else the user's data dir."""
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / ".kernel-venv"
    if os.geteuid() == 0:
        return Path("/opt/kernelmode/kernel-venv")
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "kernelmode" / "kernel-venv"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
ADMIN_TENANT = "admin"  # the tenant of the admin token (server.token); no configured tenant may take it


class TenantSettings(_Section):
    """A client with its own token: it sees and manages only its own sessions."""

    name: str = Field(pattern=TENANT_NAME_PATTERN, description="Shown in session info, logs and metrics.")
    token: str = Field(min_length=16, description="This tenant's bearer token (at least 16 characters).")
    max_sessions: int | None = Field(None, ge=1, description="Live sessions this tenant may hold.")
    runs_per_minute: int | None = Field(
        None, ge=1, description="Runs (REST, MCP, one-shot) this tenant may start per minute.")
    max_limits: LimitsPatch | None = Field(
        None, description="This tenant's ceilings, each at most sandbox.max_limits' (absent keys: "
        "the server's); its sessions' defaults are lowered to them.")

    @field_validator("name", mode="after")
    @classmethod
    def _not_admin(cls, v: str) -> str:
        if v == ADMIN_TENANT:
            raise ValueError(f"{ADMIN_TENANT!r} is the admin token's tenant (server.token)")
        return v


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    """Address the REST API and `/mcp` listen on. `0.0.0.0` (or `::`) for every interface. Also
    the host of download links of the local artifact store unless `artifacts.public_url` is set.
    Flag: `--host`."""
    port: int = Field(8888, ge=0, le=65535)
    """TCP port; `0` picks a free one (printed in `kernelmode serving on http://...`). Flag:
    `--port`. `kernelmode mcp` (embedded) uses 0 unless given `--port`."""
    data_dir: Path = Path("./.kernelmode")
    """Where the service keeps everything it writes: the session store, workspaces, the local
    artifact store and its link key, kernels' run directories and logs, the gateway's log."""
    token: str | None = Field(None, description="Admin bearer token (sees every session); generated "
                              "and printed when unset.")
    tenants: list[TenantSettings] = Field(
        default_factory=list, description="Tenant tokens; each tenant sees only its own sessions.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body the HTTP server accepts, for every route except file uploads (`PUT
    /v1/sessions/{id}/files/...`, capped by `artifacts.max_upload_bytes`) and `/mcp` (capped by
    `mcp.max_request_bytes`), which raise their own limit."""
    log_format: Literal["auto", "text", "json"] = Field(
        "auto", description="Log lines on stderr: text, json, or auto (text on a terminal, else json).")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="The event loop of the manager and its gateway: uvloop (less CPU per message), "
        "asyncio, or auto (uvloop when installed, else asyncio).")

    @field_validator("data_dir", mode="after")
    @classmethod
    def _home(cls, v: Path) -> Path:
        return v.expanduser()  # `data_dir: ~/km` is the home's km, not a directory named "~"

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, v: Any) -> Any:
        # An empty token would lock every client out: treat it as unset (generated, printed).
        return None if v is None or str(v).strip() == "" else str(v)

    @model_validator(mode="after")
    def _distinct_tenants(self) -> ServerSettings:
        names = [t.name for t in self.tenants]
        tokens = [t.token for t in self.tenants] + ([self.token] if self.token else [])
        if len(set(names)) != len(names):
            raise ValueError("tenants: two tenants have the same name")
        if len(set(tokens)) != len(tokens):
            raise ValueError("tenants: two tokens (of tenants, or a tenant's and server.token) are equal")
        return self


class SandboxSettings(_Section):
    backend: Literal["auto", "docker", "bwrap", "none"] = Field(
        "auto", description="auto: docker when an engine answers and the kernel image exists, "
        "else bwrap. none: NO isolation (development only).")
    docker_image: str = Field("kernelmode/kernel:latest", description="Kernel image (docker backend).")
    docker_cpus: float = Field(1.0, gt=0, le=1024, description="CPUs per kernel container (--cpus).")
    limits: Limits = Field(default_factory=Limits)
    """Default resource limits of every kernel."""
    max_limits: LimitCeilings = Field(default_factory=LimitCeilings)
    """Ceilings: the most a session may ask for."""
    kernel_python: Path = Field(
        default_factory=lambda: default_kernel_env() / "bin" / "python",
        description="Python of the kernel environment (has ipykernel).",
    )
    bwrap_path: str = "bwrap"
    """The bubblewrap executable: a name looked up on `PATH`, or a path."""
    uid_base: int = Field(
        200_000, ge=1000, description="When run as root, kernel N runs as host uid uid_base+N."
    )
    uid_count: int = Field(65_536, ge=1)
    """As root: how many uids from `uid_base` kernels may use, i.e. how many kernels can exist at
    once (sessions **and** warm-pool kernels; a uid is freed when its kernel is shut down)."""
    cgroups: Literal["auto", "off"] = "auto"
    """`auto`: with `backend: bwrap`, cap memory and processes with a cgroup per kernel when the
    machine lets the service write cgroups (cgroup v2 with the memory and pids controllers, or
    v1 memory+pids hierarchies; in practice root), else fall back to rlimits."""
    workspace_quota: Literal["auto", "off"] = Field(
        "auto", description="'auto': each workspace a loop-mounted ext4 volume of disk_mb, when "
        "the machine allows (root, loop devices); 'off': plain directories.")

    @field_validator("cgroups", "workspace_quota", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @field_validator("kernel_python", mode="after")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        # Kernels start from other directories: a relative path is taken from where serve starts.
        return v.expanduser().absolute()

    @model_validator(mode="after")
    def _defaults_under_ceilings(self) -> SandboxSettings:
        for name, default in self.limits:
            ceiling = getattr(self.max_limits, name)
            if default > ceiling:
                raise ValueError(f"sandbox.limits.{name} ({default}) is above its ceiling "
                                 f"sandbox.max_limits.{name} ({ceiling}): raise the ceiling or lower "
                                 "the default")
        return self


class CheckpointSettings(_Section):
    """Checkpoints of a session's variables and files (README "Checkpoints, forks and hibernation")."""

    auto: bool = Field(False, description="Checkpoint in the background after a successful run that "
                       "changed the namespace (at most every min_interval_seconds).")
    min_interval_seconds: float = Field(60.0, ge=0, description="Least time between two automatic checkpoints.")
    max_bytes: int = Field(1024 * 1024 * 1024, ge=1024, description="Size cap of one session's checkpoint: "
                           "variables that do not fit are skipped (and listed).")
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept per session (the oldest go first).")
    timeout_seconds: float = Field(600.0, gt=0, description="Longest a checkpoint or a restore may take.")


class SessionSettings(_Section):
    ttl_seconds: int = Field(1800, ge=10)
    """Idle time after which a session is deleted (kernel and workspace). Each run resets it (from
    its end); a running session is never reaped. A session may ask for its own (`ttl_seconds` in
    `POST /v1/sessions`, 10 s to 30 days)."""
    max_sessions: int = Field(50, ge=1)
    """Live sessions at once (those being created included; `lost` sessions of a previous run of
    the server are not). At the limit, creating one is `429 too_many_sessions` (REST) or an
    error (MCP, whose sessions count too)."""
    pool_size: int = Field(2, ge=0, description="Warm kernels kept ready (not counted in max_sessions).")
    pool_refill_delay_seconds: float = Field(0.5, ge=0, description="Wait after a take before refilling.")
    max_workspace_files: int = Field(10_000, ge=1, description="Files a workspace may hold (uploads).")
    files_timeout_seconds: float = Field(
        60.0, gt=0, le=3600, description="How long the kernel's file agent may take to answer one "
        "message of a file operation (upload, download, listing, delete, harvest) before it fails "
        "with 503 files_timeout: the kernel is dead or stuck.")
    reap_interval_seconds: float = Field(15.0, gt=0)
    """How often expired sessions are looked for: a session lives up to `ttl_seconds` + this."""
    default_timeout_seconds: float = Field(60.0, gt=0)
    """Wall-clock limit of a run that does not give `timeout_seconds` (REST `execute`, MCP
    `run_python`). Must be ≤ `max_timeout_seconds`: a larger value is refused when the settings
    load."""
    max_timeout_seconds: float = Field(3600.0, gt=0)
    """Largest `timeout_seconds` a run may ask for; above is `422 invalid_request`. (The REST body
    itself accepts at most 86400.)"""
    interrupt_grace_seconds: float = Field(3.0, gt=0)
    """When a run times out it is interrupted (`KeyboardInterrupt`); if it has not ended this long
    after, the kernel is restarted and the session's variables are lost (`state_lost: true`)."""
    max_output_bytes: int = Field(1024 * 1024, ge=1024, description="Cap per stream (stdout, stderr).")
    max_display_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Cap on a run's rich outputs (images, HTML...) together.")
    max_code_bytes: int = Field(1024 * 1024, ge=16)
    """Largest code of one run, in UTF-8 bytes; beyond is `413 payload_too_large` (upload data as a
    file instead)."""
    kernel_start_timeout_seconds: float = Field(60.0, gt=0)
    """Bound on starting a kernel, connecting to it and installing its preamble (also on restarts);
    the manager's HTTP requests to the gateway time out after this + 10 s."""
    run_retention_seconds: float = Field(
        3600.0, gt=0, description="How long a finished run's output stays pollable (GET /v1/runs/{id}).")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Checkpoints of variables and files: see `sessions.checkpoint` below."""
    hibernate_after_seconds: float | None = Field(
        None, gt=0, description="Idle sessions are checkpointed and their kernel stopped after this long "
        "(status hibernated; the next run resumes them). null: off (idle sessions are reaped at their TTL).")
    hibernated_ttl_seconds: float = Field(
        7 * 24 * 3600.0, gt=0, description="A hibernated session is deleted after this long unused.")

    @model_validator(mode="after")
    def _timeouts(self) -> SessionSettings:
        if self.default_timeout_seconds > self.max_timeout_seconds:
            raise ValueError(f"default_timeout_seconds ({self.default_timeout_seconds:g}) is above "
                             f"max_timeout_seconds ({self.max_timeout_seconds:g})")
        return self


class GatewaySettings(_Section):
    config_dir: Path = GATEWAY_CONFIG_DIR
    """Directory holding `kernel_gateway_config.py` (the gateway's traitlets config) and
    `kernelspec.json` (the kernelspec template); the default ships inside the installed package
    (`kernelmode/gateway/config/`)."""
    startup_timeout_seconds: float = Field(60.0, gt=0)
    """How long `serve` waits for the gateway to answer before giving up (exit 1)."""
    # How often the gateway checks that a kernel is alive; bounds how fast a death is seen.
    poll_interval_seconds: float = Field(0.5, gt=0)
    """How often the gateway checks that each kernel is alive (`KernelRestarter.time_to_dead`): a
    kernel's death is noticed, and reported as `kernel_died`, up to this long after it happens."""
    orphan_timeout_seconds: float = Field(
        120.0, ge=2, description="A gateway whose manager died shuts down (with its kernels) after "
        "this long unless a restarted manager adopts it.")
    # An external gateway (README "External gateway"): serve starts none of its own.
    url: str | None = Field(None, pattern=r"^https?://[^\s]+$", description="URL of a gateway kernelmode "
                            "did not start (http[s]://host:port); unset: serve starts its own.")
    auth_token: str | None = Field(None, description="Token the external gateway expects "
                                   "(sent as 'Authorization: token ...' on every request and websocket).")
    kernel_name: str = Field("kernelmode", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                             description="Kernelspec to launch on the external gateway.")
    launch_timeout_seconds: float = Field(60.0, gt=0, description="How long a kernel start on the "
                                          "external gateway may take.")
    validate_cert: bool = Field(True, description="Verify the external gateway's TLS certificate (https).")
    # Manager-owned liveness (sessions/liveness.py): the gateway's own view is not trusted.
    probe_interval_seconds: float = Field(5.0, gt=0, description="How often every kernel is asked "
                                          "kernel_info on its control channel (one probe per kernel).")
    probe_timeout_seconds: float = Field(10.0, gt=0, description="How long one liveness probe waits "
                                         "for its answer.")
    probe_misses: int = Field(3, ge=1, le=100, description="Probes in a row without an answer after "
                              "which a kernel is lost (its run ends as kernel_died, cause 'lost').")
    launch_attempts: int = Field(3, ge=1, le=20, description="Kernel starts tried (the gateway may "
                                 "pick another node each time) before a create answers 503.")
    shutdown_timeout_seconds: float = Field(15.0, gt=0, description="Bound on the background DELETE "
                                            "of a lost or failed kernel (nothing waits for it).")

    @field_validator("config_dir", mode="after")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        v = v.expanduser().absolute()  # the gateway runs in another directory
        missing = [name for name in ("kernel_gateway_config.py", "kernelspec.json") if not (v / name).is_file()]
        if missing:  # said here, naming the key, rather than as a traceback when serve starts
            raise ValueError(f"{v} lacks {' and '.join(missing)} (the package ships them in "
                             f"{GATEWAY_CONFIG_DIR})")
        return v


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


class Settings(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    """The HTTP server: address, port, data directory, tokens and tenants."""
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    """How kernels are isolated (docker, bwrap or none) and their resource limits."""
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    """Sessions' lifetimes, timeouts, output caps, the warm pool, checkpoints and hibernation."""
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    """The Kernel Gateway: the one serve starts, or an external one (url)."""
    tools: list[ToolSettings] = Field(default_factory=list)
    """Python callables of the manager's environment that kernel code calls as tools.NAME(...)."""
    mcp_servers: list[McpServerSettings] = Field(default_factory=list)
    """Upstream MCP servers whose tools kernel code calls as tools.SERVER.TOOL(...)."""
    tool_calls: ToolBrokerSettings = Field(default_factory=ToolBrokerSettings)
    """The tool broker: timeouts, rates, size caps and approvals of tool calls from kernels."""
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    """Where harvested files and rich outputs go (local folder or S3) and their links."""
    mcp: McpFrontSettings = Field(default_factory=McpFrontSettings)
    """The MCP front door (/mcp and kernelmode mcp): caps and answers."""
    policy: PolicySettings = Field(default_factory=PolicySettings)
    """A code policy hook that allows, denies or asks about each run's code."""
    packages: PackageSettings = Field(default_factory=PackageSettings)
    """Packages on demand: the index, allow/deny lists and download caps."""
    kernel: KernelSettings = Field(default_factory=KernelSettings)
    """The kernel environment: extra requirements installed into every kernel."""

    @model_validator(mode="after")
    def _tenant_ceilings(self) -> Settings:
        # A tenant's ceilings can only lower the server's.
        for i, tenant in enumerate(self.server.tenants):
            for name, ceiling in (tenant.max_limits or LimitsPatch()).model_dump(exclude_none=True).items():
                server = getattr(self.sandbox.max_limits, name)
                if ceiling > server:
                    raise ValueError(f"server.tenants.{i}.max_limits.{name} ({ceiling}) is above "
                                     f"sandbox.max_limits.{name} ({server}): a tenant's ceiling can "
                                     "only lower the server's")
        return self
