"""Settings: embedded defaults < kernelmode.yaml < KERNELMODE_* environment < CLI flags.

Every key is declared in ``sections`` (a pydantic model per section, whose descriptions are the
generated configuration reference); ``loading`` reads a YAML file and the environment into them.
An unknown or mistyped key is an error that names it, its line in the YAML file and the nearest
known key. ``${VAR}`` in a YAML string is read from the manager's environment. Environment
overrides use ``KERNELMODE_<SECTION>__<KEY>`` (for example ``KERNELMODE_SESSIONS__MAX_SESSIONS=10``);
``KERNELMODE_TOKEN`` sets the API token.
"""

from .loading import load_settings
from .sections import (
    ADMIN_TENANT,
    ENV_PREFIX,
    GATEWAY_CONFIG_DIR,
    REPO_ROOT,
    TENANT_NAME_PATTERN,
    ArtifactSettings,
    CheckpointSettings,
    EgressNarrowing,
    EgressSecret,
    EgressSettings,
    GatewaySettings,
    KernelSettings,
    McpFrontSettings,
    McpServerSettings,
    PackageSettings,
    PolicySettings,
    SandboxSettings,
    ServerSettings,
    SessionSettings,
    Settings,
    StoreSettings,
    TenantSettings,
    ToolBrokerSettings,
    ToolSettings,
    default_kernel_env,
)

__all__ = [
    "ADMIN_TENANT", "ENV_PREFIX", "GATEWAY_CONFIG_DIR", "REPO_ROOT", "TENANT_NAME_PATTERN",
    "ArtifactSettings", "CheckpointSettings", "EgressNarrowing", "EgressSecret", "EgressSettings", "GatewaySettings", "KernelSettings",
    "McpFrontSettings", "McpServerSettings", "PackageSettings", "PolicySettings",
    "SandboxSettings", "ServerSettings", "SessionSettings", "Settings", "StoreSettings", "TenantSettings",
    "ToolBrokerSettings", "ToolSettings", "default_kernel_env", "load_settings",
]
