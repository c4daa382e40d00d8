"""What a warm pool kernel imports before a session takes it (``sessions.pool_preimport``): the
first ``import pandas`` of a session from the pool then finds the module loaded.

Nothing leaks between sessions by it: each pool kernel serves exactly one session, and what it
ran before is kernelmode's own code (the preamble, these imports) with no user data. The code
leaves no name in the user's namespace (a silent cell that deletes its helper), and a module the
kernel environment lacks, or one whose import fails, is skipped: the pool never fails for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from ..gateway.exchange import ExecuteExchange

if TYPE_CHECKING:
    from .kernels import Kernel

log = logging.getLogger("kernelmode.sessions")


def preimport_code(modules: list[str]) -> str:
    """The silent cell that imports ``modules`` (names checked by the settings; passed as a JSON
    literal, never pasted into code)."""
    return (
        "def __kernelmode_preimport(names):\n"
        "    import importlib, importlib.util, json\n"
        "    for name in json.loads(names):\n"
        "        try:\n"
        "            if importlib.util.find_spec(name) is not None:\n"
        "                importlib.import_module(name)\n"
        "        except Exception:\n"
        "            pass\n"
        f"__kernelmode_preimport({json.dumps(modules)!r})\n"
        "del __kernelmode_preimport\n"
    )


async def preimport(k: Kernel, modules: list[str], timeout: float) -> bool:
    """Import ``modules`` in the pool kernel ``k``; False if the kernel did not answer in time or
    died meanwhile (the caller discards it)."""
    if not modules:
        return True
    assert k.conn is not None
    exchange = ExecuteExchange(k.env.collector())
    try:
        await exchange.send(k.conn, preimport_code(modules), silent=True)
        outcome = await exchange.collect(asyncio.get_running_loop().time() + timeout)
    finally:
        exchange.close()
    if outcome != "done":
        log.warning("warm pool: kernel %s did not finish importing %s (%s)", k.kernel_id, modules, outcome)
        return False
    return True
