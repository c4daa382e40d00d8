"""Kernel code cannot mint metric series (issue 32): a tool name it makes up is counted under
``other``, never as a label value of its own. (Each series lives until restart: 300 forged names
and one of 256 KB grew /metrics from 8 KB to 1.15 MB.)"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kernelmode.protocol import PIP, SEARCH

FORGE = """
bridge = tools.__dict__['_bridge']
names = [f'forged-{i}-' + 'x' * 200 for i in range(300)] + ['forged-huge-' + 'y' * 256 * 1024,
         'forged-"quote\\\\n', 'other']
for name in names:
    try:
        bridge.call(name, {})
    except ToolError:
        pass
print('sent', len(names))
"""


def _tool_labels(text: str) -> set[str]:
    return {s.labels["tool"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("kernelmode_tool_calls")}


def test_forged_tool_names_never_become_label_values(session_factory: Callable[..., str],
                                                     run: Callable[..., dict], api: httpx.Client) -> None:
    sid = session_factory()
    assert run(sid, "print(1)")["status"] == "ok"  # this session's run series exist before
    before = api.get("/metrics").text
    res = run(sid, FORGE, timeout_seconds=120)
    assert res["status"] == "ok" and res["stdout"] == "sent 303\n", res
    assert len(res["tool_calls"]) >= 300 and all(not c["ok"] for c in res["tool_calls"])
    assert max(len(c["tool"]) for c in res["tool_calls"]) <= 257  # its record keeps a cut name
    after = api.get("/metrics").text
    assert "forged" not in after
    known = {t["name"] for t in api.get("/v1/tools").json()["tools"]} | {PIP, SEARCH, "other"}
    assert _tool_labels(after) <= known, _tool_labels(after) - known
    # At most the few series of the `other` tool are new (it was 1.15 MB more).
    assert len(after) - len(before) < 4096, len(after) - len(before)
