"""kernelmode: a self-hosted, stateful, sandboxed Python interpreter service for AI agents.

Client of a running server: ``kernelmode.Client`` / ``kernelmode.AsyncClient`` (see client.py).

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

__version__ = "0.1.0"

from .client import AsyncClient, Client  # noqa: E402  (after __version__: api/ imports it)
from .config import Settings, load_settings  # noqa: E402
from .models import RunResult, SessionCreate, SessionInfo  # noqa: E402
from .server import KernelmodeApp, serve  # noqa: E402
from .tools.registry import ToolRegistry  # noqa: E402

__all__ = [
    "AsyncClient", "Client", "KernelmodeApp", "RunResult", "SessionCreate", "SessionInfo", "Settings", "ToolRegistry",
    "load_settings", "serve",
]
