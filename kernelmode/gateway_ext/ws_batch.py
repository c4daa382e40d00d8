"""In the Kernel Gateway process: the websocket frames one kernel connection makes in a loop pass,
written to the socket with one send.

A run's kernel messages reach the gateway within a fraction of a millisecond, and tornado writes
each websocket frame the moment it is made: one ``send`` (and, with Nagle off, one TCP segment
and one wake-up of the manager) per message. Here a frame joins the connection's pending frames
and a flush is scheduled for the next loop pass (``call_soon``: no timer, no Nagle). Before it
writes, the flush reads what the connection's ZMQ streams already hold: pyzmq's ZMQStream hands
over one message per loop pass, so the messages a kernel sent together would otherwise still
go out one flush each. Frames keep their order (every data frame of the connection goes through
the one list); more than FLUSH_BYTES pending are written at once, so a large output is not held.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import zmq
from tornado.iostream import StreamClosedError
from tornado.websocket import WebSocketClosedError

log = logging.getLogger("kernelmode.gateway")

# Pending bytes that are written at once, without waiting for the loop pass to end.
FLUSH_BYTES = 256 * 1024
# ZMQ messages a flush reads ahead from one stream before it writes (then it goes on in the
# next pass): a kernel flooding its IOPub never keeps a flush from writing.
DRAIN_MESSAGES = 32

_FIN = 0x80
_BINARY, _TEXT = 0x2, 0x1


def frame_header(length: int, binary: bool) -> bytes:
    """The header of one unfragmented, unmasked (server to client) websocket frame, RFC 6455 5.2."""
    first = _FIN | (_BINARY if binary else _TEXT)
    if length < 126:
        return struct.pack("!BB", first, length)
    if length <= 0xFFFF:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


class BatchedWrites:
    """Mixin for jupyter_server's ZMQChannelsWebsocketConnection: ``write_message`` queues the
    frame; the frames of one loop pass leave in one write of the websocket's stream."""

    websocket_handler: Any
    channels: dict[str, Any]

    def _batch_state(self) -> dict[str, Any]:
        state: dict[str, Any] | None = self.__dict__.get("_ws_batch")
        if state is None:  # made on first use: the connection is a traitlets object
            state = {"parts": [], "bytes": 0, "scheduled": False, "streams": []}
            self.__dict__["_ws_batch"] = state
        return state

    @property
    def write_message(self) -> Any:  # the parent's is the handler's write_message
        """Queue a frame (the handler's signature: message, binary)."""
        return self._queue_frame

    def _ws_open(self) -> Any:
        """The websocket protocol object while it can still send, else None."""
        ws = getattr(self.websocket_handler, "ws_connection", None)
        return None if ws is None or ws.is_closing() else ws

    def _queue_frame(self, message: bytes | str, binary: bool = False) -> None:
        if self._ws_open() is None:
            raise WebSocketClosedError()  # as the handler's write_message does
        data = message.encode("utf-8") if isinstance(message, str) else bytes(message)
        state = self._batch_state()
        state["parts"] += (frame_header(len(data), binary), data)
        state["bytes"] += len(data)
        if state["bytes"] >= FLUSH_BYTES:
            self._write_pending()
        elif not state["scheduled"]:
            state["scheduled"] = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _note_stream(self, stream: Any) -> None:
        """A ZMQ stream that just delivered a message: the flush reads what else it holds."""
        streams = self._batch_state()["streams"]
        if stream not in streams:
            streams.append(stream)

    def _flush(self) -> None:
        state = self._batch_state()
        state["scheduled"] = False
        more = False
        if self._ws_open() is not None:  # closed: the streams' messages are someone else's now
            for stream in list(state["streams"]):
                more = self._drain(stream) or more
        if not more:
            state["streams"] = []
        self._write_pending()
        if more and not state["scheduled"]:  # read the rest next pass; nothing is left unread
            state["scheduled"] = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _drain(self, stream: Any) -> bool:
        """Forward the messages ``stream`` holds, as its own callback would one per loop pass;
        True when DRAIN_MESSAGES were read and more may wait. Reading until EAGAIN is what
        ZMQStream does too (its socket's descriptor is edge-triggered)."""
        for _ in range(DRAIN_MESSAGES):
            if stream.closed() or not stream.receiving() or self._ws_open() is None:
                return False
            try:
                msg = stream.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as e:
                log.warning("reading a kernel's %s stream: %s", getattr(stream, "channel", "?"), e)
                return False
            try:
                self.handle_outgoing_message(stream, msg)  # type: ignore[attr-defined]
            except WebSocketClosedError:
                return False
            except Exception:  # noqa: BLE001 - as ZMQStream's callback: the next message is read
                log.exception("a kernel message could not be forwarded")
        return True

    def _write_pending(self) -> None:
        state = self._batch_state()
        parts = state["parts"]
        if not parts:
            return
        state["parts"], state["bytes"] = [], 0
        ws = self._ws_open()
        if ws is None:
            log.debug("websocket closed: %d frames not sent", len(parts) // 2)
            return
        try:
            ws.stream.write(parts[0] + parts[1] if len(parts) == 2 else b"".join(parts))
        except StreamClosedError:
            log.debug("websocket closed: %d frames not sent", len(parts) // 2)
