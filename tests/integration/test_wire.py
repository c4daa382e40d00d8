"""The gateway <-> manager websocket with the real gateway and a real sandboxed kernel: the
messages a kernel publishes together leave the gateway in a few sends (ws_batch: counted as the
TCP data segments that reach the manager's side), in order, every one of them; the manager's
connection (KernelConnection) routes them all. Counts, not times."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kernelmode.gateway.client import GatewayClient
from kernelmode.gateway.exchange import execute_content
from tests.tcp_counts import data_segs_in

N = 200


async def _cell(url: str, token: str, kernel_id: str, code: str) -> tuple[list[dict[str, Any]], int]:
    """Every message that answers ``code`` on a connection of our own to the kernel (as the
    manager opens them), and the data segments they came in."""
    conn = await GatewayClient(url, token).connect(kernel_id, lambda state: None)
    try:
        assert conn._ws is not None
        sock = conn._ws.transport.get_extra_info("socket")
        await conn.kernel_info(60)  # the kernel's IOPub reaches this connection
        before = data_segs_in(sock)
        queue = await conn.send("shell", "execute_request", execute_content(code))
        got: list[dict[str, Any]] = []
        while not ({"execute_reply", "idle"} <= {m["msg_type"] for m in got}
                   | {m["content"].get("execution_state") for m in got if m["msg_type"] == "status"}):
            got.append(await asyncio.wait_for(queue.get(), 120))
        return got, data_segs_in(sock) - before
    finally:
        await conn.close()


def test_a_burst_of_messages_leaves_the_gateway_in_few_sends(server, api, session_factory, run):
    sid = session_factory()
    assert run(sid, "1")["status"] == "ok"
    kernel_id = api.get(f"/v1/sessions/{sid}").json()["kernel_id"]
    state = json.loads((server.data_dir / "gateway" / "gateway.json").read_text())
    url = f"http://127.0.0.1:{state['port']}"
    msgs, segments = asyncio.run(_cell(url, state["token"], kernel_id,
                                       f"for i in range({N}): display(i)"))
    shown = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "display_data"]
    assert shown == [str(i) for i in range(N)]  # every message, in the kernel's order
    # IOPub in the kernel's order (its shell reply may come before any of it: another socket,
    # sent from the kernel's main thread while its IOPub thread may still hold the output)
    iopub = [m["msg_type"] for m in msgs if m["channel"] == "iopub"]
    assert iopub[:2] == ["status", "execute_input"] and iopub[-1] == "status", iopub[:3]
    # Before ws_batch: one send, so one segment, per message (205 segments for these 204);
    # now what the gateway finds waiting goes out together (5 segments in the first runs).
    assert segments <= len(msgs) // 4, (segments, len(msgs))
    # The session's own connection (the manager's) was sent the same burst: nothing was lost.
    r = run(sid, "2 + 2")
    assert r["status"] == "ok" and r["result"] == "4"
