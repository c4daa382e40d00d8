"""Python tools for the tests, named in a kernelmode.yaml as tests.integration.host_tools:NAME."""

from __future__ import annotations

import asyncio
import os
import time


def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


async def weather(city: str, unit: str = "C") -> dict:
    """The weather in a city (fake data)."""
    return {"city": city, "temp": 21, "unit": unit}


def fail(message: str) -> None:
    """Always fails with the message."""
    raise ValueError(message)


def hang(seconds: float = 3600) -> str:
    """Never returns in time."""
    time.sleep(seconds)
    return "late"


def big(n: int) -> str:
    """Returns n bytes."""
    return "x" * n


def secret() -> str:
    """Reads a secret only the manager has."""
    return os.environ.get("KM_TOOL_SECRET", "missing")


async def slow_async(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


_bumps = [0]


def bump() -> int:
    """Counts its calls (a side effect the approval gate's attack tests look for)."""
    _bumps[0] += 1
    return _bumps[0]


def bumps() -> int:
    """How many times bump() ran."""
    return _bumps[0]
