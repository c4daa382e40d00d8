"""Settings: embedded defaults < kernelmode.yaml < KERNELMODE_* environment < CLI flags.

Every key is declared here; an unknown or mistyped key is an error that names it (and its line
in the YAML file). ``${VAR}`` in a YAML string is read from the manager's environment.
Environment overrides use ``KERNELMODE_<SECTION>__<KEY>`` (for example
``KERNELMODE_SESSIONS__MAX_SESSIONS=10``); ``KERNELMODE_TOKEN`` sets the API token.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from .errors import ConfigError
from .models import LimitCeilings, Limits, LimitsPatch

ENV_PREFIX = "KERNELMODE_"
REPO_ROOT = Path(__file__).resolve().parent.parent
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
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    port: int = Field(8888, ge=0, le=65535)
    data_dir: Path = Path("./.kernelmode")
    token: str | None = Field(None, description="Admin bearer token (sees every session); generated "
                              "and printed when unset.")
    tenants: list[TenantSettings] = Field(
        default_factory=list, description="Tenant tokens; each tenant sees only its own sessions.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
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
    max_limits: LimitCeilings = Field(default_factory=LimitCeilings)
    kernel_python: Path = Field(
        default_factory=lambda: default_kernel_env() / "bin" / "python",
        description="Python of the kernel environment (has ipykernel).",
    )
    bwrap_path: str = "bwrap"
    uid_base: int = Field(
        200_000, ge=1000, description="When run as root, kernel N runs as host uid uid_base+N."
    )
    uid_count: int = Field(65_536, ge=1)
    cgroups: Literal["auto", "off"] = "auto"
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
    max_sessions: int = Field(50, ge=1)
    pool_size: int = Field(2, ge=0, description="Warm kernels kept ready (not counted in max_sessions).")
    pool_refill_delay_seconds: float = Field(0.5, ge=0, description="Wait after a take before refilling.")
    max_workspace_files: int = Field(10_000, ge=1, description="Files a workspace may hold (uploads).")
    files_timeout_seconds: float = Field(
        60.0, gt=0, le=3600, description="How long the kernel's file agent may take to answer one "
        "message of a file operation (upload, download, listing, delete, harvest) before it fails "
        "with 503 files_timeout: the kernel is dead or stuck.")
    reap_interval_seconds: float = Field(15.0, gt=0)
    default_timeout_seconds: float = Field(60.0, gt=0)
    max_timeout_seconds: float = Field(3600.0, gt=0)
    interrupt_grace_seconds: float = Field(3.0, gt=0)
    max_output_bytes: int = Field(1024 * 1024, ge=1024, description="Cap per stream (stdout, stderr).")
    max_display_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Cap on a run's rich outputs (images, HTML...) together.")
    max_code_bytes: int = Field(1024 * 1024, ge=16)
    kernel_start_timeout_seconds: float = Field(60.0, gt=0)
    run_retention_seconds: float = Field(
        3600.0, gt=0, description="How long a finished run's output stays pollable (GET /v1/runs/{id}).")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
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
    startup_timeout_seconds: float = Field(60.0, gt=0)
    # How often the gateway checks that a kernel is alive; bounds how fast a death is seen.
    poll_interval_seconds: float = Field(0.5, gt=0)
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
    function: str = Field(description="'package.module:callable'", pattern=r"^[\w.]+:[\w.]+$")
    description: str | None = None
    requires_approval: bool = Field(False, description="Each call waits for a person's yes/no "
                                    "(REST approvals route or MCP elicitation); no answer: denied.")


class McpServerSettings(_Section):
    """An upstream MCP server whose tools kernels call as tools.NAME.TOOL: stdio or HTTP."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    connect_timeout_seconds: float = Field(30.0, gt=0)
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
    rate_per_second: float = Field(200.0, gt=0, description="Per-session tool calls per second.")
    rate_burst: int = Field(1000, ge=1)
    max_argument_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_result_bytes: int = Field(8 * 1024 * 1024, ge=1024)
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
    """The code policy hook, called before each run (REST and MCP)."""

    module: str | None = Field(
        None, pattern=r"^[\w.]+:[\w.]+$", description="'package.module:callable' given code, "
        "session_id and tenant; answers 'allow', ('deny', reason) or ('ask', reason). Null: off.")
    timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="A policy that has not answered within this long denies the "
        "run (it holds the session's lock while it decides).")


class ArtifactSettings(_Section):
    """Where harvested files and outputs go: ``local`` (under the data dir) or ``s3``."""

    store: Literal["local", "s3"] = "local"
    link_ttl_seconds: int = Field(7 * 24 * 3600, ge=60, le=7 * 24 * 3600)
    public_url: str | None = Field(None, description="Base URL of this server as clients reach it "
                                   "(for local-store links); default http://HOST:PORT.")
    max_artifact_bytes: int = Field(100 * 1024 * 1024, ge=1024)
    max_upload_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="Largest file upload.")
    max_artifacts_per_run: int = Field(50, ge=1)
    # s3
    endpoint: str | None = Field(None, description="host:port of the S3 API, e.g. minio:9000")
    secure: bool = False
    access_key: str | None = None
    secret_key: str | None = None
    bucket: str = "kernelmode"
    region: str | None = None

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
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tools: list[ToolSettings] = Field(default_factory=list)
    mcp_servers: list[McpServerSettings] = Field(default_factory=list)
    tool_calls: ToolBrokerSettings = Field(default_factory=ToolBrokerSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    mcp: McpFrontSettings = Field(default_factory=McpFrontSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    packages: PackageSettings = Field(default_factory=PackageSettings)
    kernel: KernelSettings = Field(default_factory=KernelSettings)

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


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _interpolate(value: Any, environ: dict[str, str]) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in environ:
                raise ConfigError(f"${{{name}}} is used in the config but not set in the environment")
            return environ[name]

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, environ) for v in value]
    return value


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path of a YAML mapping to its 1-based line, to point at bad keys."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*path, str(k.value))
                lines[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, str(i)))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # YAML parsing gives ints, floats and booleans their types ("10" -> 10).
        node[path[-1]] = yaml.safe_load(value) if value else value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_settings(
    path: str | Path | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Read settings from an optional YAML file and the environment; raise ConfigError."""
    environ = dict(os.environ if environ is None else environ)
    raw: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    source = "environment"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
            lines = _key_lines(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        raw = _interpolate(loaded, environ)
    raw = _merge(raw, _env_overrides(environ))
    if environ.get("KERNELMODE_TOKEN"):
        raw = _merge(raw, {"server": {"token": environ["KERNELMODE_TOKEN"]}})
    try:
        return Settings.model_validate(raw)
    except PydanticValidationError as e:
        problems = []
        for err in e.errors():
            key = tuple(str(p) for p in err["loc"])
            where = f" (line {lines[key]})" if key in lines else ""
            problem = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            # A check across sections (loc ()) names its keys itself.
            problems.append(f"{'.'.join(key)}{where}: {problem}" if key else problem)
        raise ConfigError(f"{source}: " + "; ".join(problems)) from e
