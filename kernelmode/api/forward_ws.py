"""A session's channels websocket forwarded to the manager that owns the session (forwarding.py
says why): frame by frame, in both directions, each closing the other, with the subprotocol the
owner chose. The owner does every check (token, tenant, frames, code policy); this manager only
caps frame sizes as the owner does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING

from tornado import httpclient, websocket

from ..errors import KernelmodeError, from_wire
from .forwarding import FORWARDED_HEADER, HOP_BY_HOP, Router

if TYPE_CHECKING:
    from .channels import ChannelsHandler

log = logging.getLogger("kernelmode.api")

# The handshake's own headers are made anew for the owner; Origin was checked here (the owner
# would compare it with its own host name, not the one the client reached).
_NOT_PASSED = HOP_BY_HOP | {"origin", "sec-websocket-key", "sec-websocket-version",
                            "sec-websocket-extensions", "sec-websocket-protocol", "content-length"}
_UNSENDABLE = {1005, 1006, 1015}  # close codes that only report, never travel (RFC 6455 7.4.1)


class WsRelay:
    """The owner's websocket of one forwarded client connection."""

    def __init__(self, upstream: websocket.WebSocketClientConnection) -> None:
        self.upstream = upstream
        self.pump: asyncio.Task[None] | None = None

    @property
    def subprotocol(self) -> str | None:
        return self.upstream.selected_subprotocol

    @classmethod
    async def connect(cls, handler: ChannelsHandler, router: Router, base_url: str,
                      max_message_size: int) -> WsRelay:
        """Open the owner's websocket (ManagerGone if it does not answer; its refusal as a
        KernelmodeError of its status and text)."""
        req = handler.request
        url = "ws" + base_url.rstrip("/").removeprefix("http") + req.uri
        headers = {k: v for k, v in req.headers.get_all() if k.lower() not in _NOT_PASSED}
        headers[FORWARDED_HEADER] = router.manager_id
        offered = [p.strip() for p in req.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        request = httpclient.HTTPRequest(url, headers=headers, connect_timeout=5, request_timeout=30)
        try:
            upstream = await websocket.websocket_connect(request, subprotocols=offered or None,
                                                         max_message_size=max_message_size)
        except httpclient.HTTPClientError as e:
            if e.code == 599:  # tornado's code for no answer (timeout)
                raise router.gone(base_url, e) from e
            raise owners_refusal(e) from e
        except OSError as e:  # refused, unreachable
            raise router.gone(base_url, e) from e
        return cls(upstream)

    def start(self, handler: ChannelsHandler) -> None:
        self.pump = asyncio.create_task(self._from_owner(handler))

    async def _from_owner(self, handler: ChannelsHandler) -> None:
        try:
            while (msg := await self.upstream.read_message()) is not None:
                await handler.write_message(msg, binary=isinstance(msg, bytes))
        except (websocket.WebSocketClosedError, KernelmodeError):
            pass
        finally:
            code = self.upstream.close_code
            handler.close(code if code and code not in _UNSENDABLE else 1001,
                          self.upstream.close_reason or "the session's manager closed the connection")

    async def to_owner(self, message: str | bytes) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            await self.upstream.write_message(message, binary=isinstance(message, bytes))

    def close(self, code: int | None, reason: str | None) -> None:
        """The client went away: so does the owner's connection."""
        if self.pump is not None:
            self.pump.cancel()
        self.upstream.close(code if code and code not in _UNSENDABLE else 1000, reason)


def owners_refusal(e: httpclient.HTTPClientError) -> KernelmodeError:
    """The owner's answer to the handshake (its JSON error: code, message, details kept)."""
    body = e.response.body if e.response is not None and e.response.body else b""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        err = json.loads(body)["error"]
        return from_wire(str(err["message"]), code=str(err["code"]), status=e.code, details=err.get("details"))
    return from_wire(body.decode(errors="replace") or e.message or "", status=e.code)
