"""kernelmode.loops: server.event_loop picks uvloop or asyncio, and never fails for want of uvloop."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from kernelmode import loops


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_when_asked_or_auto() -> None:
    pytest.importorskip("uvloop")
    assert loops.run(_loop_module(), "auto").startswith("uvloop")
    assert loops.run(_loop_module(), "uvloop").startswith("uvloop")


def test_asyncio_when_asked() -> None:
    assert loops.run(_loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_falls_back_to_asyncio(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    with caplog.at_level(logging.WARNING, logger="kernelmode"):
        assert loops.run(_loop_module(), "auto").startswith("asyncio")
        assert not caplog.records  # auto: silent
        assert loops.run(_loop_module(), "uvloop").startswith("asyncio")
    assert any("uvloop is not installed" in r.getMessage() for r in caplog.records)
