"""The settings models of the service itself (server, tenants, sandbox, sessions, gateway) and the
root ``Settings``, which adds the sections of features.py.

The descriptions are the configuration reference's (docs/reference/settings.md is generated from
these models by scripts/gen_docs.py): say what a key does in a sentence or two.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..egress.patterns import first_uncovered
from ..models import LimitCeilings, Limits, LimitsPatch
from .base import (
    ADMIN_TENANT,
    ENV_PREFIX,
    GATEWAY_CONFIG_DIR,
    REPO_ROOT,
    TENANT_NAME_PATTERN,
    _Section,
    default_kernel_env,
)
from .egress import EgressNarrowing, EgressSecret, EgressSettings
from .features import (
    ArtifactSettings,
    KernelSettings,
    McpFrontSettings,
    McpServerSettings,
    PackageSettings,
    PolicySettings,
    ToolBrokerSettings,
    ToolSettings,
)

__all__ = ["EgressNarrowing", "EgressSecret", "EgressSettings", "ADMIN_TENANT", "ENV_PREFIX", "GATEWAY_CONFIG_DIR", "REPO_ROOT", "TENANT_NAME_PATTERN",
           "ArtifactSettings", "CheckpointSettings", "GatewaySettings", "KernelSettings",
           "McpFrontSettings", "McpServerSettings", "PackageSettings", "PolicySettings",
           "SandboxSettings", "ServerSettings", "SessionSettings", "Settings", "StoreSettings",
           "TenantSettings", "ToolBrokerSettings", "ToolSettings", "default_kernel_env"]

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # pool_preimport


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
    egress: EgressNarrowing | None = None
    """Narrows `egress` for this tenant's sessions: its `allow` patterns must each be covered by
    the server's `egress.allow`; its `deny` adds to the server's; its caps lower the server's."""

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
    advertise_url: str | None = Field(None, pattern=r"^https?://[^\s/]+/?$")
    """Base URL (`http://host:port`) at which the other managers sharing `store.url` reach this
    one (they forward a session's requests to its owner). Unset: built from `host` and the bound
    port, which is right on one host; set it when managers run in pods or behind NAT (e.g.
    `http://$(POD_IP):8888`), since `0.0.0.0` is no address another host can reach."""
    drain_seconds: float = Field(20.0, ge=0, le=3600)
    """On SIGTERM (a rolling update) or SIGINT: how long this manager waits for the runs in flight
    to finish and be recorded before it stops. Meanwhile `/readyz` answers 503 and new runs and
    creates are refused with `503 server_busy` (Retry-After), so clients and the load balancer go
    to another manager; then its sessions are handed over (docs/scaling.md). `0`: stop at once (a
    run in flight ends `interrupted`). Kubernetes: `terminationGracePeriodSeconds` must exceed it."""
    forward_max_connections: int = Field(256, ge=1, le=100_000)
    """Requests this manager passes on to the other managers at once (a session's requests go to
    the manager that owns it), each over a connection of its own. One more is answered at once
    with `503 server_busy` and `Retry-After: 1` instead of waiting for a connection, so a flood
    through one manager cannot open connections without bound on another."""
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
    pool_size: int = Field(2, ge=0)
    """Warm kernels kept ready at all times, the pool's floor (not counted in `max_sessions`).
    After a burst of creates the pool grows above it, up to `pool_max` (see `pool_memory_mb`).
    Each costs, idle with the default `pool_preimport`, ~80 MB PSS and ~0.75-1 CPU-s to make; a
    first burst larger than the pool waits for cold starts (two to three a second on 2 cores)."""
    pool_max: int = Field(20, ge=0)
    """Most warm kernels kept ready: after a burst the pool holds as many as the most creates
    seen in any 10 s of the last 10 minutes, between `pool_size` and this (a value below
    `pool_size` counts as `pool_size`), also bounded by `pool_memory_mb` and by the sessions the
    server may still hold (`max_sessions` minus the sessions held; a tenant's own cap does not
    bound it, as the admin token's sessions have none)."""
    pool_memory_mb: int = Field(2048, ge=0)
    """Memory the warm kernels above `pool_size` may hold together (MiB): measured per kernel
    (its cgroup, where there is one; else an estimate of 150 MB a kernel). 0: the pool never
    grows above `pool_size`."""
    pool_preimport: list[str] = Field(default_factory=lambda: ["numpy", "pandas"], max_length=32)
    """Modules imported in every warm kernel before a session takes it, so that a session's first
    `import pandas` costs nothing. A module the kernel environment lacks (or whose import fails)
    is skipped. Nothing leaks between sessions: a warm kernel serves exactly one session, and
    what it ran before is kernelmode's own code. The first session after start may take a kernel
    before its imports (it would wait longer for them than for the kernel)."""
    pool_parallel_starts: int = Field(4, ge=1, le=64)
    """Kernel starts under way at once (a create's own and the pool's refills; a create's go
    first). A start waits on I/O part of its time, so about twice the machine's cores; many
    more only make each start slower. Measured on 2 cores: one at a time gave a first burst the
    best median on a quiet machine and the worst on a loaded one, unbounded the best tail."""
    pool_refill_delay_seconds: float = Field(0.5, ge=0, description="Wait after a take before refilling.")
    create_queue_seconds: float = Field(30.0, ge=0)
    """How long a create that misses the pool may expect to wait before its kernel start
    begins (the starts under way and queued ahead of it, `pool_parallel_starts` at a time, at the
    recent time of one start). A create that would wait longer is answered at once with
    `503 server_busy` and a `Retry-After` header (when to try again) instead of piling up until
    it times out; one with nothing queued ahead always goes. 0: never refused for this."""
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

    @field_validator("pool_preimport", mode="after")
    @classmethod
    def _module_names(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not _MODULE.fullmatch(m)]
        if bad:
            raise ValueError(f"not module names: {bad} (dotted Python identifiers, e.g. 'numpy')")
        return v

    @model_validator(mode="after")
    def _timeouts(self) -> SessionSettings:
        if self.default_timeout_seconds > self.max_timeout_seconds:
            raise ValueError(f"default_timeout_seconds ({self.default_timeout_seconds:g}) is above "
                             f"max_timeout_seconds ({self.max_timeout_seconds:g})")
        return self


class StoreSettings(_Section):
    """Where sessions, runs and checkpoints' metadata are kept (docs/scaling.md "Store backends")."""

    url: str | None = Field(None, pattern=r"^postgres(ql)?://\S+$")
    """Unset: a SQLite file in `server.data_dir` (one manager). `postgresql://user:password@host:5432/db`:
    a PostgreSQL database (psycopg's URL forms, `?sslmode=require` and the like included), migrated
    when a manager starts; several managers may share it, each session owned by one of them
    through a lease (docs/high-availability.md). Keep the password out of the YAML with `${VAR}`."""
    lease_seconds: float = Field(10.0, ge=1, le=3600)
    """How long a manager's lease on a session lasts unless renewed (its heartbeat renews it every
    third of this): a dead manager's sessions are adopted by another within this plus about a second
    (PostgreSQL store only; a SQLite store has one manager and takes no lease)."""
    rebalance: bool = True
    """Even out the sessions between managers: a manager holding more than its fair share (the
    live managers' sessions divided among them, rounded up) hands a few idle sessions, each round
    of its heartbeat, to the manager holding the fewest, which adopts them with their variables
    (docs/high-availability.md "Rebalancing"). Applies with a PostgreSQL store and an external
    gateway (`gateway.url`: the only kind another manager can reach a kernel on)."""
    rebalance_per_round: int = Field(2, ge=1, le=100)
    """At most this many sessions a manager hands over per heartbeat round (every third of
    `store.lease_seconds`), so that a manager that joins is filled gently, not all at once."""


class GatewaySettings(_Section):
    config_dir: Path = GATEWAY_CONFIG_DIR
    """Directory holding `kernel_gateway_config.py` (the gateway's traitlets config) and
    `kernelspec.json` (the kernelspec template); the default ships inside the installed package
    (`kernelmode/gateway_ext/config/`)."""
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
                                            "of a lost or failed kernel, or of a deleted session's "
                                            "on an external gateway (nothing waits for it).")

    @field_validator("config_dir", mode="after")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        v = v.expanduser().absolute()  # the gateway runs in another directory
        missing = [name for name in ("kernel_gateway_config.py", "kernelspec.json") if not (v / name).is_file()]
        if missing:  # said here, naming the key, rather than as a traceback when serve starts
            raise ValueError(f"{v} lacks {' and '.join(missing)} (the package ships them in "
                             f"{GATEWAY_CONFIG_DIR})")
        return v


class Settings(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    """The HTTP server: address, port, data directory, tokens and tenants."""
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    """How kernels are isolated (docker, bwrap or none) and their resource limits."""
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    """Sessions' lifetimes, timeouts, output caps, the warm pool, checkpoints and hibernation."""
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    """The Kernel Gateway: the one serve starts, or an external one (url)."""
    store: StoreSettings = Field(default_factory=StoreSettings)
    """The session store: SQLite in the data dir, or a PostgreSQL database several managers share."""
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
    egress: EgressSettings = Field(default_factory=EgressSettings)
    """Egress: the hosts kernel code may reach through the host's proxy, secrets it adds, caps."""

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
            wider = first_uncovered(self.egress.allow, (tenant.egress.allow or []) if tenant.egress else [])
            if wider is not None:
                raise ValueError(f"server.tenants.{i}.egress.allow: {wider!r} is not covered by "
                                 "egress.allow: a tenant's egress can only narrow the server's")
        return self
