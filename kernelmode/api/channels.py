"""``/v1/sessions/{id}/channels``: a session's kernel channels as a websocket, for consoles.

A person's console (``kernelmode console``) reaches the live kernel here, through kernelmode and
its token, never through an opened port: frames pass between this websocket and the gateway's
websocket of the kernel (binary v1 protocol), and the session's ConsoleTap sees each message.
Jupyter clients attach through a subclass (api/jupyter_api.py), which may also speak the
legacy JSON protocol (no subprotocol: one JSON text message a frame, its channel a key in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import websockets
from jupyter_client.jsonutil import json_default
from tornado import websocket
from websockets.asyncio.client import ClientConnection

from ..errors import FrameError, KernelmodeError, Unauthorized, WebsocketRequired, from_wire
from ..gateway.client import FRAME_SLACK, WS_PROTOCOL
from ..protocol.frames import CHANNELS, Bounds, decode_frame, encode_frame
from ..services import Services
from ..sessions.console_tap import ConsoleTap
from ..tenants import Principal
from .forward_ws import WsRelay
from .forwarding import FORWARDED_HEADER

log = logging.getLogger("kernelmode.api")


class ChannelsHandler(websocket.WebSocketHandler):
    _upstream: ClientConnection | None = None
    _pump: asyncio.Task[None] | None = None
    _tap: ConsoleTap | None = None
    _refused = False
    _legacy = False  # this client speaks the legacy JSON protocol
    allow_legacy = False  # the console speaks v1 only; Jupyter clients may speak either
    forward_by = "session"  # what the URL names (forwarding.py's Router)
    _relay: WsRelay | None = None  # forwarded to the manager that owns the session

    services: Services

    def initialize(self, services: Services) -> None:
        self.services = services

    @property
    def _bounds(self) -> Bounds:
        """A console's message: a cell of code (up to 6 bytes a character as escaped JSON)."""
        return Bounds(max_part_bytes=6 * self.services.settings.sessions.max_code_bytes + FRAME_SLACK)

    @property
    def max_message_size(self) -> int:
        # tornado's cap on one frame (it closes with 1009 over it): what the manager buffers
        # for a console connection before any check of ours
        return self._bounds.max_part_bytes + FRAME_SLACK

    def _refuse(self, error: KernelmodeError) -> None:
        """The websockets' one translation point: an error before the upgrade, as REST gives it."""
        self.set_status(error.http_status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": error.to_dict()}))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # tornado's own refusals (a method other than GET, a form body it cannot parse) in JSON,
        # like every other error of the API
        exc = kwargs.get("exc_info", (None, None, None))[1]
        self._refuse(from_wire(getattr(exc, "log_message", None) or self._reason, status=status_code))

    def session_of(self, principal: Principal, ref: str) -> str:
        """The session id the URL names (here the id itself; the Jupyter API maps a kernel id)."""
        self.services.sessions.authorize(principal, ref)
        return ref

    async def get(self, *args: Any, **kwargs: Any) -> None:
        principal = self.services.tenants.from_authorization(self.request.headers.get("Authorization", ""))
        if principal is None:
            return self._refuse(Unauthorized("missing or wrong bearer token"))
        try:
            if (relay := await self._forward_elsewhere(args[0])) is not None:
                await super().get(*args, **kwargs)
                if relay.pump is None:  # refused here (origin, version...)
                    relay.close(1000, None)
                return
            sid = self.session_of(principal, args[0])
            self.services.sessions.live_session(sid)  # unknown or lost: refused before the upgrade
            if not self._is_upgrade():  # before the upstream is opened: a plain GET would leak it
                raise WebsocketRequired("this route is a websocket: send "
                                        f"`Upgrade: websocket` with the {WS_PROTOCOL} subprotocol")
            s = await self.services.sessions.resume(sid)  # a hibernated session wakes
            self._upstream = await self.services.gateway.open_channels(s.kernel_id)
        except KernelmodeError as e:
            return self._refuse(e)
        self._tap = ConsoleTap(self.services.sessions, s, self._send_upstream)
        try:
            await super().get(*args, **kwargs)  # returns when the websocket ends, or at once if refused
        finally:
            if self._pump is None and self._upstream is not None:  # refused (origin, version...)
                await self._upstream.close()

    def _is_upgrade(self) -> bool:
        """The handshake headers tornado checks first (it answers plain text without them)."""
        headers = self.request.headers
        connection = [part.strip().lower() for part in headers.get("Connection", "").split(",")]
        return headers.get("Upgrade", "").lower() == "websocket" and "upgrade" in connection

    async def _forward_elsewhere(self, ref: str) -> WsRelay | None:
        """Connect to the owner's websocket if another manager owns the session."""
        router = self.services.router
        if router is None:
            return None
        find = router.for_kernel if self.forward_by == "kernel" else router.for_session
        target = find(ref, FORWARDED_HEADER in self.request.headers)
        if target is None:
            return None
        if not self._is_upgrade():
            raise WebsocketRequired("this route is a websocket: send "
                                    f"`Upgrade: websocket` with the {WS_PROTOCOL} subprotocol")
        limit = max(self.max_message_size, self.services.gateway.max_frame_bytes)
        self._relay = await WsRelay.connect(self, router, target, limit)
        return self._relay

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        if self._relay is not None:  # the owner chose
            return self._relay.subprotocol
        return WS_PROTOCOL if WS_PROTOCOL in subprotocols else None

    def open(self, *args: Any, **kwargs: Any) -> None:
        if self._relay is not None:
            self.set_nodelay(True)
            self._relay.start(self)
            return
        if self.selected_subprotocol != WS_PROTOCOL:
            if not self.allow_legacy:
                self.close(4400, f"speak the {WS_PROTOCOL} subprotocol")
                return
            self._legacy = True
        # A cell's answer is several small frames: with Nagle on (tornado turns it back on after
        # each HTTP request) each exchange stalls on the client's delayed ACK (~40 ms)
        self.set_nodelay(True)
        self._pump = asyncio.create_task(self._from_kernel())

    async def _send_upstream(self, channel: str, msg: dict[str, Any]) -> None:
        assert self._upstream is not None
        await self._upstream.send(encode_frame(msg, channel))

    async def on_message(self, message: str | bytes) -> None:
        if self._relay is not None:
            await self._relay.to_owner(message)
            return
        if self._upstream is None or self._tap is None or self._refused:
            return
        if isinstance(message, str) != self._legacy:
            return  # not this connection's protocol
        try:
            # Checked before anything is decoded (and before the gateway, whose own decoder
            # trusts the frame's header, ever sees it).
            msg = decode_frame(message, self._bounds)
            if self._legacy:
                msg = legacy_message(msg)
        except FrameError as e:  # a malformed or oversized frame ends its connection, only
            self._refused = True
            self.close(4400, f"refused frame: {e}"[:120])  # a close reason fits in 123 bytes
            return
        # The code policy sees each cell before the kernel (awaited here: tornado reads the
        # connection's next message only then, so messages keep their order).
        refusal = await self._tap.refusal(msg)
        if refusal is not None:
            for channel, answer in refusal:
                await self._to_client(channel, answer)
            return
        if self._tap.from_console(msg["channel"], msg):
            # Every frame is re-encoded from what was checked (the tap may have set an
            # execute_request's stop_on_error), never passed on as it came: the client's bytes
            # may hold lone surrogate escapes or bytes that are not UTF-8, which the decoder made
            # U+FFFD, and which the kernel would get as they are (frames.pack_json says why not).
            with contextlib.suppress(websockets.WebSocketException):
                await self._upstream.send(encode_frame(msg, msg["channel"]))

    async def _to_client(self, channel: str, msg: dict[str, Any]) -> None:
        """A message of kernelmode's own (not the kernel's) to the client, in its protocol."""
        with contextlib.suppress(websocket.WebSocketClosedError):
            if self._legacy:
                await self.write_message(legacy_text({**msg, "channel": channel}))
            else:
                await self.write_message(encode_frame(msg, channel), binary=True)

    async def _from_kernel(self) -> None:
        assert self._upstream is not None and self._tap is not None
        bounds = self.services.gateway.bounds
        try:
            async for raw in self._upstream:
                try:
                    msg = decode_frame(raw, bounds, lenient=True)
                    forward = self._tap.from_kernel(msg["channel"], msg)
                except FrameError as e:  # skipped, like the manager's own connection does
                    log.warning("console of %s: a kernel message was skipped: %s", self._tap.s.info.session_id, e)
                    continue
                if forward and self._legacy:
                    await self.write_message(legacy_text(msg))
                elif forward:
                    await self.write_message(raw, binary=isinstance(raw, bytes))
        except (websockets.WebSocketException, websocket.WebSocketClosedError):
            pass
        finally:
            self.close(1001, "the kernel's connection closed")

    def on_close(self) -> None:
        if self._relay is not None:
            self._relay.close(self.close_code, self.close_reason)
        if self._pump is not None:
            self._pump.cancel()
        if self._tap is not None:
            self._tap.close()
        if self._upstream is not None:
            asyncio.ensure_future(self._upstream.close())


def legacy_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A client's legacy JSON message, checked and completed to the shape a v1 frame decodes to."""
    channel, header = msg.get("channel"), msg.get("header")
    if channel not in CHANNELS:
        raise FrameError(f"unknown channel {str(channel)[:32]!r}")
    if not isinstance(header, dict) or not isinstance(msg.get("parent_header", {}), dict) \
            or not isinstance(msg.get("metadata", {}), dict):
        raise FrameError("a message's header, parent_header and metadata are JSON objects")
    return {"channel": channel, "header": header, "msg_type": header.get("msg_type"),
            "parent_header": msg.get("parent_header") or {}, "metadata": msg.get("metadata") or {},
            "content": msg.get("content") or {}}


def legacy_text(msg: dict[str, Any]) -> str:
    """A kernel's message (decoded from its v1 frame) as a legacy JSON text message. Binary
    buffers are not carried (the legacy protocol sends them in a framing of its own)."""
    header = msg["header"]
    return json.dumps({"header": header, "parent_header": msg["parent_header"],
                       "metadata": msg.get("metadata", {}), "content": msg.get("content", {}),
                       "msg_id": header.get("msg_id"), "msg_type": header.get("msg_type"),
                       "channel": msg["channel"], "buffers": []}, default=json_default)
