"""The gateway's note of a kernel's activity from the IOPub messages it forwards
(kg_extensions.NoDelayWebsocketConnection._note_activity): message parts as ZMQ hands them over
(frames or bytes), read in place; what is not JSON is left alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import zmq
from jupyter_client.session import Session

from kernelmode.gateway_ext.kg_extensions import NoDelayWebsocketConnection

UNTRACKED = {"status", "execute_input", "execute_result", "stream", "comm_info_request"}


def _conn(state: str) -> Any:
    kernel = SimpleNamespace(execution_state=state, last_activity=None)
    kernels = SimpleNamespace(track_message_type=lambda t: t not in UNTRACKED, last_kernel_activity=None)
    return SimpleNamespace(kernel_manager=kernel, multi_kernel_manager=kernels)


def _parts(msg_type: str, content: dict[str, Any], parent_type: str = "execute_request",
           frames: bool = True) -> list[Any]:
    s = Session(key=b"k")
    msg = s.msg(msg_type, content, parent=s.msg(parent_type, {}))
    raw = [s.pack(msg["header"]), s.pack(msg["parent_header"]), b"{}", s.pack(msg["content"])]
    return [zmq.Frame(p) for p in raw] if frames else raw


def test_status_of_a_tracked_request_sets_the_state() -> None:
    conn = _conn("idle")
    NoDelayWebsocketConnection._note_activity(conn, _parts("status", {"execution_state": "busy"}))
    assert conn.kernel_manager.execution_state == "busy" and conn.kernel_manager.last_activity is not None
    NoDelayWebsocketConnection._note_activity(conn, _parts("status", {"execution_state": "idle"}, frames=False))
    assert conn.kernel_manager.execution_state == "idle"


def test_untracked_messages_and_junk_leave_the_state() -> None:
    conn = _conn("idle")
    NoDelayWebsocketConnection._note_activity(conn, _parts("status", {"execution_state": "busy"},
                                                           parent_type="comm_info_request"))
    assert conn.kernel_manager.execution_state == "idle" and conn.kernel_manager.last_activity is None
    NoDelayWebsocketConnection._note_activity(conn, [b"\xff not json", b"{}", b"{}", b"{}"])
    NoDelayWebsocketConnection._note_activity(conn, [b"[1]", b"{}", b"{}", b"{}"])
    NoDelayWebsocketConnection._note_activity(conn, [b"[" * 2000, b"{}", b"{}", b"{}"])
    assert conn.kernel_manager.execution_state == "idle" and conn.kernel_manager.last_activity is None
    # A tracked message type (not a status) is activity.
    NoDelayWebsocketConnection._note_activity(conn, _parts("comm_msg", {}))
    assert conn.kernel_manager.last_activity is not None and conn.kernel_manager.execution_state == "idle"
