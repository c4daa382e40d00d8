"""kernelmode: a self-hosted, stateful, sandboxed Python interpreter service for AI agents.

Client of a running server: ``kernelmode.Client`` / ``kernelmode.AsyncClient`` (see client/).

Library mode (embed the service in your own asyncio application)::

    from kernelmode import KernelmodeApp, SessionCreate, ToolRegistry, load_settings

    tools = ToolRegistry()

    @tools.register
    def price(sku: str) -> float:
        "Price of a product in EUR."
        ...

    app = KernelmodeApp(load_settings(), tools)
    await app.start()
    info = await app.sessions.create(SessionCreate())
    result = await app.sessions.execute(info.session_id, "tools.price('A1') * 2")
    await app.stop()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Imported on first use (PEP 562): `kernelmode mcp` must not pay for the REST client, tornado
# and the rest before it can answer `initialize`.
_LAZY = {
    "AsyncClient": "client", "Client": "client", "Settings": "config", "load_settings": "config",
    "RunResult": "models", "SessionCreate": "models", "SessionInfo": "models",
    "KernelmodeApp": "server", "serve": "server", "ToolRegistry": "tools.registry",
}

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .config import Settings, load_settings
    from .models import RunResult, SessionCreate, SessionInfo
    from .server import KernelmodeApp, serve
    from .tools.registry import ToolRegistry


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelmode' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncClient", "Client", "KernelmodeApp", "RunResult", "SessionCreate", "SessionInfo", "Settings", "ToolRegistry",
    "load_settings", "serve",
]
