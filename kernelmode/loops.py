"""The manager's event loop: uvloop when asked for and importable, else asyncio's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
log = logging.getLogger("kernelmode")

EventLoop = Literal["auto", "uvloop", "asyncio"]


def run(main: Coroutine[Any, Any, T], loop: EventLoop = "auto") -> T:
    """``asyncio.run(main)`` on the chosen loop. ``auto``: uvloop if it imports (less CPU per
    message: its transports and callbacks are C), else asyncio; ``uvloop`` when it is missing
    falls back to asyncio with a warning rather than not starting."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                log.warning("server.event_loop is uvloop but uvloop is not installed: using asyncio")
        else:
            return uvloop.run(main)
    return asyncio.run(main)
