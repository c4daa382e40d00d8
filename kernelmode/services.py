"""What the front doors (REST handlers, the console websocket, MCP tools) work with.

Built in one place, ``KernelmodeApp.start`` (server.py), once everything in it runs, and handed
to each door: tornado handlers get it as ``initialize`` kwargs from the route table, the MCP
server in its constructor. A door never reaches into the app object, so it cannot depend on how
the app is put together, and no door imports server.py (no import cycle).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api.forwarding import Router
    from .artifacts.base import ArtifactStore
    from .config import Settings
    from .gateway.client import GatewayClient
    from .metrics import Metrics
    from .sessions import SessionManager
    from .tenants import Tenants
    from .tools.registry import ToolRegistry


@dataclass(frozen=True)
class Services:
    """The running service's parts that front doors use (and nothing else of the app)."""

    settings: Settings
    tenants: Tenants  # who a bearer token is
    tools: ToolRegistry  # host tools, for listings (kernels reach them through the broker)
    sessions: SessionManager  # everything about sessions, runs, files and artifacts
    gateway: GatewayClient  # the console websocket opens a kernel's channels through it
    artifact_store: ArtifactStore  # the local store serves its signed download links
    metrics: Metrics  # /metrics renders them
    readiness: Callable[[], Awaitable[dict[str, Any]]]  # /readyz: the checks of each part
    router: Router | None = None  # several managers: which one serves a session (api/forwarding.py)
