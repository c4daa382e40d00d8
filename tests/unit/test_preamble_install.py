"""When a kernel's ``tools`` preamble is installed again (sessions/kernels.py
``Kernel.install_preamble``, called before every run): only when the session's tool list changed.
The same list (the same objects, or equal ones) is settled without making its JSON."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kernelmode.gateway.execution import OutputCollector
from kernelmode.sessions.kernels import Kernel
from kernelmode.tools.base import ToolInfo


class _Registry:
    def __init__(self, infos: list[ToolInfo]) -> None:
        self.tools = infos
        self.listed = 0

    def infos(self, allow: list[str] | None = None) -> list[ToolInfo]:
        self.listed += 1
        return list(self.tools)  # a new list each time, as ToolRegistry.infos makes


def _kernel(registry: _Registry) -> tuple[Kernel, list[list[dict[str, Any]]]]:
    k = object.__new__(Kernel)  # only what install_preamble reads
    k.env = SimpleNamespace(broker=SimpleNamespace(registry=registry))  # type: ignore[assignment]
    k.info = SimpleNamespace(tools=None, session_id="s1")  # type: ignore[assignment]
    k.tools_installed, k._tools_infos = None, []
    boots: list[list[dict[str, Any]]] = []

    async def run_boot(specs: list[dict[str, Any]], deadline: float) -> tuple[str, OutputCollector]:
        boots.append(specs)
        collector = OutputCollector(1000)
        collector.reply_status = "ok"
        return "done", collector

    k._run_boot = run_boot  # type: ignore[method-assign,assignment]
    return k, boots


def _tool(name: str, description: str = "") -> ToolInfo:
    return ToolInfo(name=name, description=description, signature=f"{name}()")


async def test_the_preamble_is_installed_again_only_when_the_tools_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dumps: list[str] = []
    model_dump = ToolInfo.model_dump

    def counted(self: ToolInfo, **kwargs: Any) -> dict[str, Any]:
        dumps.append(self.name)
        return model_dump(self, **kwargs)

    monkeypatch.setattr(ToolInfo, "model_dump", counted)
    registry = _Registry([_tool("a"), _tool("b")])
    k, boots = _kernel(registry)
    await k.install_preamble(5)
    assert [s["name"] for s in boots[-1]] == ["a", "b"] and len(boots) == 1 and len(dumps) == 2
    await k.install_preamble(5)  # the same objects
    registry.tools = [t.model_copy() for t in registry.tools]  # equal ones (e.g. an MCP refresh)
    await k.install_preamble(5)
    assert len(boots) == 1 and registry.listed == 3
    assert len(dumps) == 2  # no JSON made of an unchanged list

    registry.tools = [*registry.tools, _tool("c")]  # a tool more
    await k.install_preamble(5)
    assert len(boots) == 2 and [s["name"] for s in boots[-1]] == ["a", "b", "c"]
    registry.tools = [registry.tools[0], _tool("b", "now described"), registry.tools[2]]  # one changed
    await k.install_preamble(5)
    assert len(boots) == 3 and boots[-1][1]["description"] == "now described"
    await k.install_preamble(5)
    assert len(boots) == 3

    k.tools_installed = None  # a new or restarted kernel has no preamble yet
    await k.install_preamble(5)
    assert len(boots) == 4
