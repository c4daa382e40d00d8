"""Library mode: kernelmode inside your own application, with your functions as kernel tools.

    .venv/bin/python examples/library_mode.py

The agent-written code below runs in a sandboxed kernel without network; `tools.price` and
`tools.stock` run here, in this process, where your data and credentials live.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from kernelmode import KernelmodeApp, SessionCreate, ToolRegistry, load_settings

CATALOGUE = {f"SKU-{i:03d}": {"price": 5 + i % 17, "stock": (i * 7) % 23} for i in range(300)}

tools = ToolRegistry()


@tools.register
def price(sku: str) -> float:
    """Unit price of a product, in EUR."""
    return float(CATALOGUE[sku]["price"])


@tools.register
async def stock(sku: str) -> int:
    """Units in stock for a product."""
    return int(CATALOGUE[sku]["stock"])


# What an agent would send: loop over 300 products *inside the kernel* and return a compact
# summary, instead of 600 separate model tool calls.
AGENT_CODE = """
skus = [f"SKU-{i:03d}" for i in range(300)]
value = sum(tools.price(s) * tools.stock(s) for s in skus)
empty = [s for s in skus if tools.stock(s) == 0]
print(f"stock value: {value:.0f} EUR; {len(empty)} products out of stock, e.g. {empty[:3]}")
"""


async def main() -> None:
    settings = load_settings()  # embedded defaults, then KERNELMODE_* environment variables
    settings.server.port = 0  # any free port for the REST API (unused here)
    settings.server.data_dir = Path(tempfile.mkdtemp(prefix="kernelmode-example-"))
    app = KernelmodeApp(settings, tools)
    await app.start()
    try:
        session = await app.sessions.create(SessionCreate())
        result = await app.sessions.execute(session.session_id, AGENT_CODE)
        print(result.stdout.strip())
        print(f"{len(result.tool_calls)} tool calls in {result.duration_ms:.0f} ms, one round trip for the model")
        await app.sessions.delete(session.session_id)
    finally:
        await app.stop()
        shutil.rmtree(settings.server.data_dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
