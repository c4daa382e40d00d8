"""Pydantic models shared by every front door: what crosses a boundary is one of these."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from .egress.patterns import check_patterns
from .tools.base import ToolInfo, ToolMatch

SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

RunStatus = Literal["ok", "error", "timeout", "kernel_died", "running", "interrupted", "awaiting_approval"]
SessionStatus = Literal["starting", "idle", "busy", "restarting", "dead", "lost", "hibernated"]


class _Model(BaseModel):
    """What crosses a boundary. Each model's validator is built at its first use, not at import:
    the settings import this module, and the embedded `kernelmode mcp` answers ``initialize``
    before the session layer uses the API's models (validation is the same either way)."""

    model_config = ConfigDict(defer_build=True)


class _Strict(_Model):
    """Request bodies: unknown fields are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    """Resource limits of one sandboxed kernel."""

    memory_mb: int = Field(1024, ge=128, le=1_048_576, description="Memory cap (cgroup, else RLIMIT_AS); a kernel needs ~60 MB to start.")
    cpu_seconds: int = Field(600, ge=1, le=31_536_000, description="CPU time cap (RLIMIT_CPU).")
    pids: int = Field(128, ge=32, le=65_536, description="Process/thread cap (cgroup pids, else RLIMIT_NPROC); a kernel runs ~10 threads.")
    disk_mb: int = Field(1024, ge=1, le=1_048_576, description="Largest file a kernel may write (RLIMIT_FSIZE).")
    open_files: int = Field(1024, ge=128, le=65_536, description="Open file descriptors (RLIMIT_NOFILE); a kernel needs ~70 to start.")


class LimitsPatch(_Strict):
    """Some limits, each optional: a session's overrides of the defaults (absent keys keep the
    default), or a tenant's ceilings (absent keys: the server's)."""

    memory_mb: int | None = Field(None, ge=128, le=1_048_576, description="Memory (MiB); null: unchanged.")
    cpu_seconds: int | None = Field(None, ge=1, le=31_536_000, description="CPU seconds; null: unchanged.")
    pids: int | None = Field(None, ge=32, le=65_536, description="Processes/threads; null: unchanged.")
    disk_mb: int | None = Field(None, ge=1, le=1_048_576, description="Workspace disk (MiB); null: unchanged.")
    open_files: int | None = Field(None, ge=128, le=65_536, description="Open files; null: unchanged.")


class LimitCeilings(_Strict):
    """The most a session may ask for (``sandbox.max_limits``), set by the operator within the
    API's ranges; `serve` has the Docker engine grant them once at start."""

    memory_mb: int = Field(4096, ge=128, le=1_048_576, description="Most memory (MiB) a session may ask for.")
    cpu_seconds: int = Field(86_400, ge=1, le=31_536_000, description="Most CPU seconds a session may ask for.")
    pids: int = Field(1024, ge=32, le=65_536, description="Most processes/threads a session may ask for.")
    disk_mb: int = Field(4096, ge=1, le=1_048_576, description="Most workspace disk (MiB) a session may ask for.")
    open_files: int = Field(4096, ge=128, le=65_536, description="Most open files a session may ask for.")


class EgressNarrowing(_Strict):
    """Egress narrowed by a tenant (`server.tenants[].egress`) or a session (`POST /v1/sessions`
    `egress`): it can only narrow the policy above it (a wider `allow` is 403 `egress_refused`)."""

    allow: list[str] | None = Field(None, max_length=1000, description=(
        "Host patterns (`api.github.com`, `*.example.com`, `host:8443`); each must be covered by the\n"
        "level above's `allow`, else it is refused naming the host. `null`: the level above's list;\n"
        "`[]`: no egress."))
    deny: list[str] = Field(default_factory=list, max_length=1000,
                            description="Host patterns refused on top of the level above's `deny`.")
    max_bytes_per_session: int | None = Field(None, ge=0, description="Lowers `egress.max_bytes_per_session`.")
    max_connections_per_session: int | None = Field(
        None, ge=0, description="Lowers `egress.max_connections_per_session`.")

    @field_validator("allow", "deny", mode="after")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else check_patterns(v)


class EgressSecretInfo(_Model):
    host: str
    header: str = Field(description="The header the proxy adds for this host (its value is never shown).")


class EgressInfo(_Model):
    """A session's effective egress policy, without secret values."""

    allow: list[str] = Field(description="Host patterns the session's kernel may reach.")
    deny: list[str] = Field(default_factory=list, description="Host patterns refused although allowed.")
    secrets: list[EgressSecretInfo] = Field(
        default_factory=list, description="Hosts whose requests get a header added by the proxy (TLS intercepted).")
    max_bytes_per_session: int
    max_connections_per_session: int


class EgressUse(_Model):
    """One host a run's code reached (or was refused) through the egress proxy."""

    host: str
    port: int
    allowed: bool
    requests: int = Field(description="Requests (or tunnels, for HTTPS without interception).")
    bytes: int = Field(description="Bytes up and down.")


class SessionCreate(_Strict):
    """Body of ``POST /v1/sessions`` (every field optional)."""

    session_id: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="Your id for the session; generated when omitted."
    )
    ttl_seconds: int | None = Field(
        None, ge=10, le=30 * 24 * 3600, description="Idle time after which the session is reaped."
    )
    limits: LimitsPatch | None = None
    tools: list[str] | None = Field(
        None, max_length=1000,
        description="Allow-list of host tools (names, or MCP server names for all their tools); "
        "default: all.",
    )
    packages: list[str] | None = Field(
        None, max_length=100,
        description="Packages installed before the first run (requirement strings, as for "
        "POST /v1/sessions/{id}/packages).",
    )
    fork_of: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="Start as a copy of this session's variables and "
        "files (checkpointed now); the two are independent afterwards.")
    from_checkpoint: str | None = Field(
        None, pattern=r"^[0-9a-f]{32}$", description="Start from this checkpoint's variables and files.")
    egress: EgressNarrowing | None = Field(
        None, description="Narrow the tenant's egress for this session, e.g. {\"allow\": [\"api.github.com\"]} "
        "(a host it may not use is 403 egress_refused; [] : none). Default: the tenant's policy; a fork: "
        "its source's.")


class SessionInfo(_Model):
    session_id: str
    status: SessionStatus
    created_at: datetime
    expires_at: datetime | None = Field(None, description="When the session is reaped if it stays idle.")
    last_activity: datetime
    ttl_seconds: int
    limits: Limits
    execution_count: int = 0
    sandbox: str = Field(description="Sandbox backend of the kernel: docker, bwrap or none.")
    tools: list[str] | None = Field(None, description="Tool allow-list (None: all tools).")
    from_pool: bool = Field(False, description="The kernel came ready from the warm pool.")
    kernel_id: str | None = Field(
        None, description="The session's Jupyter kernel (docker backend: container kernelmode-<kernel_id>).")
    memory_bytes: int | None = Field(
        None, description="Memory the kernel's processes use now (from its cgroup; None without cgroups).")
    tenant: str | None = Field(
        None, description="The tenant that owns the session: its token's tenant name ('admin' for the "
        "admin token).")
    cause: DeathCause | None = Field(
        None, description="Why its kernel was lost or died, while status is 'dead' (its next run "
        "starts a fresh kernel); null otherwise.")
    egress: EgressInfo | None = Field(
        None, description="The hosts its kernel may reach through the egress proxy (secret values "
        "never shown); null: no egress.")


class SessionList(_Model):
    """One page of a session listing, in creation order (then id)."""

    sessions: list[SessionInfo]
    next_cursor: str | None = Field(
        None, description="More sessions remain: pass this as `cursor` for the next page (opaque; "
        "bound to the listing tenant). Null on the last page.")


class ExecuteRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/execute``."""

    code: str = Field(description="Python source to run in the session's kernel.")
    timeout_seconds: float | None = Field(
        None, gt=0, le=86_400, description="Wall-clock limit of this run (default 60 s)."
    )
    wait_seconds: float | None = Field(
        None, ge=0, le=86_400,
        description="Answer after at most this long: a run still going then returns status "
        "'running' (HTTP 202) and keeps running; poll GET /v1/runs/{run_id}. Default: wait for the end.",
    )


class InlineFile(_Strict):
    path: str = Field(min_length=1, max_length=1024, description="Where in /mnt/data, e.g. 'data/sales.csv'.")
    content_base64: str = Field(description="The file's bytes, base64-encoded.")


class OneShotRequest(_Strict):
    """Body of ``POST /v1/execute``: a run in a fresh kernel that is discarded afterwards."""

    code: str = Field(description="Python source to run.")
    files: list[InlineFile] = Field(
        default_factory=list, max_length=1000, description="Files put into /mnt/data before the run.")
    timeout_seconds: float | None = Field(
        None, gt=0, le=86_400, description="Wall-clock limit of the run (default 60 s).")
    tools: list[str] | None = Field(None, max_length=1000, description="Allow-list of host tools; default: all.")
    egress: EgressNarrowing | None = Field(
        None, description="Narrow the tenant's egress for this run (as in POST /v1/sessions).")


class RunError(_Model):
    ename: str
    evalue: str
    traceback: str = Field(description="Plain text, without ANSI colour codes.")


class DeathCause(_Model):
    """Why a kernel died, so that programs need not parse prose."""

    kind: Literal["exit", "signal", "oom", "lost", "unknown"] = Field(
        description="'lost': no answer within the liveness deadline, or the gateway no longer has the "
        "kernel (node, network or gateway gone); 'unknown': it died and nothing said how.")
    exit_code: int | None = None
    signal: int | None = None
    detail: str | None = Field(None, description="What is known, in words (set for 'lost'; for 'oom' the limit and how to raise it).")

    @model_serializer(mode="wrap")
    def _without_empty_detail(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # ``detail`` is left out when empty: the older shape, which clients compare whole.
        data = dict(handler(self))
        if data.get("detail") is None:
            data.pop("detail", None)
        return data


class ToolCall(_Model):
    """One host-tool call made by kernel code during a run."""

    tool: str
    ok: bool
    error: str | None = None
    duration_ms: float
    bytes_in: int = Field(description="Size of the request (arguments).")
    bytes_out: int = Field(description="Size of the reply (result or error).")


class PendingApproval(_Model):
    """A call (or, for the code policy, a whole run) waiting for a person's yes/no."""

    call_id: str = Field(description="POST /v1/runs/{run_id}/approvals/{call_id} decides it.")
    tool: str = Field(description="The tool's name; 'policy:run' when the code policy asks about the run.")
    arguments: dict[str, Any] = Field(description="The call's arguments (cut when very large).")


class ApprovalRequest(_Model):
    """``POST /v1/runs/{run_id}/approvals/{call_id}``."""

    model_config = ConfigDict(extra="forbid")
    approve: bool
    reason: str | None = Field(None, max_length=2000, description="Shown to the code (ToolDenied) and audited.")


class ApprovalAnswer(_Model):
    run_id: str
    call_id: str
    approved: bool
    reason: str | None = None
    by: str = Field(description="Who decided: rest, mcp, timeout, run_ended, policy.")


class Artifact(_Model):
    """A file the run created or changed, or a rich output it displayed, kept in the store."""

    path: str = Field(description="/mnt/data/... for files; outputs/output-N.ext for displays.")
    name: str
    size_bytes: int
    mime_type: str
    sha256: str
    download_url: str = Field(description="Absolute link that works without the API token.")


class WorkspaceFile(_Model):
    name: str
    path: str
    size_bytes: int
    mime_type: str
    modified: datetime


class FileList(_Model):
    files: list[WorkspaceFile]
    truncated: bool = Field(False, description="The walk stopped at its bound: not every file is listed.")
    note: str | None = Field(None, description="Where and why the walk stopped, when it did.")


class ArtifactList(_Model):
    artifacts: list[Artifact]


class UploadResult(_Model):
    path: str = Field(description="Where kernel code finds the file, e.g. /mnt/data/sales.csv.")
    size_bytes: int


class FileDeleted(_Model):
    """The answer to ``DELETE /v1/sessions/{id}/files/{path}``."""

    path: str = Field(description="The file removed, e.g. /mnt/data/sales.csv.")
    deleted: bool = True


class RestoredFrom(_Model):
    checkpoint_id: str
    age_seconds: float = Field(description="How old the checkpoint was when it was restored.")


class RunResult(_Model):
    run_id: str
    session_id: str
    status: RunStatus
    stdout: str = ""
    stderr: str = ""
    result: str | None = Field(None, description="text/plain of the last expression, if any.")
    outputs: list[dict[str, Any]] = Field(
        default_factory=list, description="Rich display data as Jupyter MIME bundles."
    )
    error: RunError | None = None
    execution_count: int | None = None
    duration_ms: float = 0.0
    truncated: bool = Field(False, description="Some output was cut at the configured cap.")
    outputs_dropped: int = Field(0, description="Displays (images...) left out at the display cap.")
    state_lost: bool = Field(
        False, description="The kernel was restarted (timeout, death): variables are gone."
    )
    cause: DeathCause | None = Field(None, description="Why the kernel died (status kernel_died).")
    restored_from: RestoredFrom | None = Field(
        None, description="Before this run, a fresh kernel was restored from this checkpoint.")
    restored_variables: list[str] = Field(default_factory=list, description="Names the restore brought back.")
    lost_variables: list[str] = Field(
        default_factory=list, description="Names of the checkpoint that did not come back (or were never saved).")
    restore_error: str | None = Field(
        None, description="A restore was tried and failed (damaged or missing checkpoint): the kernel started empty.")
    tool_calls: list[ToolCall] = Field(default_factory=list, description="Host tools the code called.")
    tool_calls_truncated: bool = Field(False, description="More calls were made than are listed.")
    pending_approvals: list[PendingApproval] = Field(
        default_factory=list, description="Status awaiting_approval: what waits for a yes/no.")
    artifacts: list[Artifact] = Field(default_factory=list, description="Files and outputs kept.")
    artifacts_truncated: bool = Field(False, description="Some were left out (count or size cap).")
    artifact_error: str | None = Field(
        None, description="Why files were not kept (the store failed, the workspace walk stopped at "
        "its bound or could not read it); the run itself stands.")
    egress: list[EgressUse] = Field(
        default_factory=list, description="Hosts the run's code reached or was refused through the "
        "egress proxy; left out when empty.")

    @model_serializer(mode="wrap")
    def _without_empty_egress(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = dict(handler(self))
        if not data.get("egress"):
            data.pop("egress", None)  # most runs reach nothing: the older, shorter shape
        return data


class ErrorDetail(_Model):
    code: str
    message: str
    details: Any | None = None


class RunProgress(_Model):
    """``GET /v1/runs/{run_id}``: a run's output since ``offset``, and its result once it ended."""

    run_id: str
    session_id: str
    status: RunStatus
    done: bool = Field(description="The run has ended: ``result`` (or ``failure``) is final.")
    offset: int = Field(description="Index of the first event returned.")
    next_offset: int = Field(description="Pass as ?offset= to get only what comes after.")
    events: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Output in arrival order: {type: stream, name, text}, {type: display_data | "
        "execute_result, data, metadata}, {type: error, ename, evalue, traceback}.",
    )
    pending_approvals: list[PendingApproval] = Field(
        default_factory=list, description="Status awaiting_approval: what waits for a yes/no.")
    result: RunResult | None = Field(None, description="The final RunResult, once done.")
    failure: ErrorDetail | None = Field(None, description="The run could not complete (not a code error).")
    approvals_version: int = Field(0, description="Changes whenever what is pending changes: pass it back "
                                   "as ?approvals_version= and a wait ends on any change after this answer.")
    truncated: bool = Field(False, description="Some output was cut at the server's caps so far (as the "
                            "result's ``truncated`` says once done).")
    outputs_dropped: int = Field(0, description="Displayed outputs left out so far, over the display cap "
                                 "(as the result's ``outputs_dropped`` once done).")


class ErrorBody(_Model):
    error: ErrorDetail


class Health(_Model):
    status: Literal["ok", "unavailable"]
    checks: dict[str, Any] = Field(default_factory=dict)


class ToolList(_Model):
    tools: list[ToolInfo]


class ToolMatches(_Model):
    """``GET /v1/tools?q=...``: the tools that best fit the intent, best first."""

    tools: list[ToolMatch]


class PackagesRequest(_Strict):
    """Body of ``POST /v1/sessions/{id}/packages``."""

    packages: list[str] = Field(
        min_length=1, max_length=100,
        description="Requirements: 'name', 'name==1.2', 'name>=1,<2', 'name[extra]'.")


class PackageRef(_Model):
    name: str
    version: str


class PackagesResult(_Model):
    """What an install did: ``installed`` now, ``already`` there (in the session or the kernel)."""

    installed: list[PackageRef] = Field(default_factory=list)
    already: list[PackageRef] = Field(default_factory=list)
    duration_ms: float = 0.0


class LayerWheel(PackageRef):
    """A wheel unpacked in a session's package layer, named as the shared cache holds it."""

    filename: str
    sha256: str
    size: int = Field(0, description="Bytes of the wheel file.")


# -- checkpoints -----------------------------------------------------------------------------------
class SkippedVariable(_Model):
    name: str
    reason: str = Field(description="Why it was not saved (open file, socket, generator, size cap...).")


class SkippedFile(_Model):
    path: str
    reason: str = Field(description="Why it is not in the checkpoint (over the workspace's disk_mb budget).")


class CheckpointInfo(_Model):
    """Answer of ``POST /v1/sessions/{id}/checkpoint`` (and one entry of the list)."""

    checkpoint_id: str
    session_id: str
    saved: list[str] = Field(description="Variables saved (modules by name, re-imported on restore).")
    skipped: list[SkippedVariable] = Field(default_factory=list)
    bytes: int = Field(description="Size of the saved variables plus the workspace archive.")
    workspace_files: int = Field(0, description="Workspace files in the checkpoint.")
    skipped_files: list[SkippedFile] = Field(default_factory=list, description=(
        "Workspace files left out: what is read from the kernel is bounded by limits.disk_mb, "
        "however large its files say they are (sparse files count at their full length)."))
    duration_ms: float = 0.0
    serialize_ms: float = Field(0.0, description="Of duration_ms, the kernel's part: serialising and writing the file.")
    created_at: datetime
    auto: bool = Field(False, description="Taken automatically (after a run, or when hibernating).")
    packages: list[LayerWheel] = Field(default_factory=list, description=(
        "The session's installed packages: a fork gets the same wheels from the package cache."))


class CheckpointList(_Model):
    checkpoints: list[CheckpointInfo]
