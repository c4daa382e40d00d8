"""GatewayClient: the Kernel Gateway's REST API and kernel websockets, errors translated here.

Every failure of the gateway (refused connection, HTTP error, closed websocket) becomes a
kernelmode error in this module and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import ssl
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import websockets
from jupyter_client.session import Session as JupyterSession
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from websockets.asyncio.client import ClientConnection
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import Event

from ..errors import (
    FrameError,
    GatewayError,
    GatewayForbidden,
    GatewayUnavailable,
    KernelUnavailable,
    SandboxUnavailable,
)
from ..protocol.frames import Bounds, decode_frame, encode_frame, pack_json
from .exchange import DISCONNECTED_EVENT, KERNEL_STATUS_EVENT

log = logging.getLogger("kernelmode.gateway")


def _gateway_message(e: HTTPClientError) -> str:
    """The ``message`` of the gateway's JSON error body ('' when there is none)."""
    try:
        return str(json.loads(e.response.body)["message"])[:2000] if e.response else ""
    except (ValueError, TypeError, KeyError):
        return ""

# Status the gateway itself sends when the kernel process died and is being restarted, or when
# restarting failed for good.
KERNEL_RESTARTING = "restarting"
KERNEL_DEAD = "dead"
# The binary websocket protocol: the gateway forwards the kernel's frames without decoding and
# re-encoding them as JSON, which the legacy protocol does for every message.
WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"
# Frames a kernel websocket buffers before its reader takes them: with the frame size cap
# (max_size), what one kernel connection can make the manager hold, (MAX_QUEUE + 1) frames.
MAX_QUEUE = 4
# A kernel's message over the cap ends that websocket (1009) and the run is reported lost:
# our gateway cuts messages to the cap first (kg_extensions), so this is only a backstop.
FRAME_SLACK = 64 * 1024
# A live kernel that is slow to answer gets this long for its websocket's opening handshake
# (the gateway holds it until the kernel answers); a kernel that is gone fails it sooner (opening).
OPEN_TIMEOUT = 30.0


class GatewayClient:
    """REST calls to one Kernel Gateway."""

    def __init__(self, url: str, token: str, request_timeout: float = 60.0,
                 max_message_bytes: int = 17 * 1024 * 1024, kernel_name: str = "kernelmode",
                 validate_cert: bool = True, poll_interval: float = 0.5, close_timeout: float = 5.0) -> None:
        """``poll_interval``: how often a websocket being opened asks whether its kernel still
        exists; ``close_timeout``: the bound on a websocket's closing handshake (then aborted)."""
        self.url = url.rstrip("/")
        self.token = token
        self.kernel_name = kernel_name
        self.validate_cert = validate_cert  # an external gateway's https/wss (gateway.validate_cert)
        self.request_timeout = request_timeout
        # What a kernel's message may hold (message_limit): its metadata and content are
        # not decoded beyond it, and the websocket refuses frames much larger.
        self.bounds = Bounds(max_part_bytes=max_message_bytes)
        self.max_frame_bytes = max_message_bytes + FRAME_SLACK
        self.poll_interval = poll_interval
        self.close_timeout = close_timeout
        self._http = AsyncHTTPClient()

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[len("http") :]

    def ws_options(self) -> dict[str, Any]:
        """websockets.connect's TLS option: an unverified context when validate_cert is off."""
        if not self.url.startswith("https") or self.validate_cert:
            return {}
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return {"ssl": ctx}

    async def check(self) -> dict[str, Any]:
        """``GET /api`` with the token: the gateway's version, or GatewayUnavailable saying why."""
        return dict(await self._request("GET", "/api", timeout=10) or {})

    async def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        req = HTTPRequest(
            f"{self.url}{path}",
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=json.dumps(body) if body is not None else ("{}" if method == "POST" else None),
            request_timeout=timeout or self.request_timeout,
            validate_cert=self.validate_cert,
        )
        try:
            resp = await self._http.fetch(req)
        except HTTPClientError as e:
            text = e.response.body.decode(errors="replace")[:500] if e.response and e.response.body else ""
            if e.code == 404:
                raise KernelUnavailable(f"the gateway does not know {path}: {text}") from e
            if e.code == 599:
                raise GatewayUnavailable(f"the kernel gateway did not answer {method} {path}: {e}") from e
            if e.code == 403:
                raise GatewayForbidden(f"the kernel gateway refused {method} {path} (403): "
                                       f"{_gateway_message(e) or text}") from e
            if e.code == 503:  # the sandbox refused a kernel: its provisioner says why
                raise SandboxUnavailable(_gateway_message(e) or f"the sandbox refused {method} {path}") from e
            # The gateway's own message when it sent one (not the traceback around it).
            raise GatewayError(f"kernel gateway {method} {path} failed with {e.code}: "
                               f"{_gateway_message(e) or text}") from e
        except OSError as e:
            raise GatewayUnavailable(f"the kernel gateway is unreachable: {e}") from e
        return json.loads(resp.body) if resp.body else None

    async def start_kernel(self, kernel_id: str, env: dict[str, str], timeout: float) -> None:
        """Start a kernel under an id of our choosing (it names the kernel's workspace too)."""
        # "env" must be present: without it the gateway gives the kernel its whole environment.
        body = {"name": self.kernel_name, "kernel_id": kernel_id, "env": env}
        post = asyncio.ensure_future(self._request("POST", "/api/kernels", body, timeout))
        try:
            model = await asyncio.shield(post)
        except asyncio.CancelledError:
            # The gateway goes on starting it: wait for its answer, so that the DELETE which
            # follows finds the kernel (one still starting is unknown there, and left running).
            with contextlib.suppress(Exception):
                await post
            raise
        if model.get("id") != kernel_id:
            raise GatewayError(f"the gateway started kernel {model.get('id')} instead of {kernel_id}")

    async def shutdown_kernel(self, kernel_id: str, timeout: float | None = None) -> None:
        with contextlib.suppress(KernelUnavailable):
            await self._request("DELETE", f"/api/kernels/{kernel_id}", timeout=timeout)

    async def interrupt_kernel(self, kernel_id: str) -> None:
        await self._request("POST", f"/api/kernels/{kernel_id}/interrupt")

    async def restart_kernel(self, kernel_id: str, timeout: float) -> None:
        await self._request("POST", f"/api/kernels/{kernel_id}/restart", timeout=timeout)

    async def list_kernels(self, timeout: float | None = None) -> list[dict[str, Any]]:
        return list(await self._request("GET", "/api/kernels", timeout=timeout))

    async def kernel_exists(self, kernel_id: str) -> bool | None:
        """Whether the gateway still has the kernel (None: it did not say)."""
        try:
            await self._request("GET", f"/api/kernels/{kernel_id}", timeout=max(5.0, self.poll_interval))
            return True
        except KernelUnavailable:  # 404: its process exited and the gateway's restarts failed
            return False
        except GatewayError:
            return None

    async def opening(self, kernel_id: str, connecting: Awaitable[ClientConnection]) -> ClientConnection:
        """The websocket ``connecting`` opens, or KernelUnavailable as soon as the gateway no longer
        has the kernel. The gateway holds the opening handshake until the kernel answers, and a
        kernel that died at start never does: without this, the handshake's whole OPEN_TIMEOUT."""
        task = asyncio.ensure_future(connecting)
        probe: asyncio.Future[bool | None] | None = None
        try:
            while True:
                done: set[asyncio.Future[Any]]
                done, _ = await asyncio.wait({task}, timeout=self.poll_interval)
                if not done:  # ask, while the handshake goes on (a slow answer must not hold it up)
                    probe = asyncio.ensure_future(self.kernel_exists(kernel_id))
                    waiting: set[asyncio.Future[Any]] = {task, probe}
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if probe is not None and probe.result() is False:
                    raise KernelUnavailable(
                        f"kernel {kernel_id} is gone: its process exited before it answered, and the "
                        "gateway gave it up (its restarts failed too)")
        finally:
            for pending in (task, probe):
                if pending is not None and not pending.done():
                    pending.cancel()  # the handshake's: websockets closes what it opened so far
                    await asyncio.gather(pending, return_exceptions=True)

    async def ping(self, timeout: float = 5) -> bool:
        try:
            await self._request("GET", "/api/kernelspecs", timeout=timeout)
            return True
        except GatewayError:
            return False

    async def open_channels(self, kernel_id: str) -> ClientConnection:
        """A raw websocket to the kernel's channels (v1 binary protocol), for a proxy."""
        url = f"{self.ws_url}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
        try:
            return await self.opening(kernel_id, websockets.connect(
                url, additional_headers={"Authorization": f"token {self.token}"},
                subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                max_size=self.max_frame_bytes, max_queue=MAX_QUEUE, compression=None, open_timeout=OPEN_TIMEOUT,
                ping_interval=None, close_timeout=self.close_timeout, **self.ws_options(),
            ))
        except (OSError, websockets.WebSocketException, asyncio.TimeoutError) as e:
            raise KernelUnavailable(f"cannot open the websocket of kernel {kernel_id}: {e}") from e

    async def connect(self, kernel_id: str, on_kernel_status: Callable[[str], None]) -> KernelConnection:
        conn = KernelConnection(self, kernel_id, on_kernel_status)
        await conn.open()
        return conn


class FrameConnection(ClientConnection):
    """websockets' client connection that hands each whole data frame to ``on_frame`` as it is
    parsed (in ``data_received``), instead of queueing it for ``recv()``: no reader task step and
    no queue between the socket and the request's queue, per message.

    The frame size cap is the protocol's (max_size), as before. A fragmented message (tornado
    never sends one) turns this off for the rest of the connection: from its first frame on,
    every frame goes through ``recv()``, in order."""

    def __init__(self, protocol: ClientProtocol, *, on_frame: Callable[[Frame], None], **kwargs: Any) -> None:
        super().__init__(protocol, **kwargs)
        self.on_frame: Callable[[Frame], None] | None = on_frame
        self.socket: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport (asyncio's protocol callback), for ``abort``. (uvloop's transports
        are not asyncio.Transport subclasses, but have its methods.)"""
        self.socket = cast(asyncio.Transport, transport)
        super().connection_made(transport)

    def abort(self) -> None:
        """Close the socket now, without a closing handshake (asyncio's ``Transport.abort``)."""
        if self.socket is not None:
            self.socket.abort()

    def process_event(self, event: Event) -> None:
        """A whole text or binary frame to ``on_frame``; anything else as websockets does."""
        on_frame = self.on_frame
        if (on_frame is not None and self.response is not None and isinstance(event, Frame)
                and event.opcode in (Opcode.BINARY, Opcode.TEXT)):
            if event.fin:
                on_frame(event)
                return
            self.on_frame = None
        super().process_event(event)


class KernelConnection:
    """One websocket to one kernel. Replies are routed to their request by parent msg_id."""

    def __init__(self, client: GatewayClient, kernel_id: str, on_kernel_status: Callable[[str], None]) -> None:
        self.client = client
        self.kernel_id = kernel_id
        self.on_kernel_status = on_kernel_status
        # Only builds messages (msg()); the gateway signs them with the kernel's key. A random key
        # keeps jupyter_client from warning "Message signing is disabled" for every session.
        self._session = JupyterSession(key=secrets.token_bytes(16), username="kernelmode")
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._listeners: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._binary = False

    @property
    def binary(self) -> bool:
        """The v1 protocol (binary buffers) is spoken on this websocket."""
        return self._binary

    @property
    def is_open(self) -> bool:
        return self._ws is not None and self._reader is not None and not self._reader.done()

    async def open(self) -> None:
        url = f"{self.client.ws_url}/api/kernels/{self.kernel_id}/channels?session_id={uuid.uuid4().hex}"
        try:
            self._ws = await self.client.opening(self.kernel_id, websockets.connect(
                url,
                additional_headers={"Authorization": f"token {self.client.token}"},
                subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]
                max_size=self.client.max_frame_bytes,
                max_queue=MAX_QUEUE,
                compression=None,
                open_timeout=OPEN_TIMEOUT,
                ping_interval=None,
                close_timeout=self.client.close_timeout,
                create_connection=partial(FrameConnection, on_frame=self._on_frame),  # type: ignore[arg-type]
                **self.client.ws_options(),
            ))
        except KernelUnavailable:
            raise
        except (OSError, websockets.WebSocketException, asyncio.TimeoutError) as e:
            raise KernelUnavailable(f"cannot open the websocket of kernel {self.kernel_id}: {e}") from e
        self._binary = self._ws.subprotocol == WS_PROTOCOL
        self._reader = asyncio.create_task(self._read(), name=f"ws-{self.kernel_id}")

    async def close(self) -> None:
        """The closing handshake, bounded; a close that fails, times out or is cancelled aborts
        the socket instead of leaving it open until the garbage collector finds it."""
        ws, self._ws = self._ws, None
        try:
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.wait({self._reader})  # its end; a cancel of this close propagates
                if not self._reader.cancelled():
                    self._reader.exception()  # taken (the websocket's end), not left to the GC's warning
            if ws is not None:
                # websockets aborts by itself after close_timeout when the peer does not answer the
                # close; not when its send of the close frame waits on a peer that reads nothing.
                await asyncio.wait_for(ws.close(), self.client.close_timeout + 1)
        except BaseException as e:
            if isinstance(ws, FrameConnection):
                ws.abort()
            if not isinstance(e, Exception):
                raise  # cancelled: aborted, and the cancellation goes on
            log.warning("websocket of kernel %s did not close cleanly (%r): aborted", self.kernel_id, e)

    def _on_frame(self, frame: Frame) -> None:
        """A whole frame, straight from the connection's parser (FrameConnection)."""
        data = bytes(frame.data)
        if frame.opcode == Opcode.TEXT:
            try:
                self._take(data.decode())
            except UnicodeDecodeError as e:
                log.warning("kernel %s sent a message that was skipped: %s", self.kernel_id, e)
            return
        self._take(data)

    def _take(self, raw: str | bytes) -> None:
        # One bad message (malformed, over a bound, not UTF-8) is skipped or arrives marked
        # "dropped": it never ends the connection, which would fail the run as kernel_died
        # while the kernel is fine.
        try:
            self._route(decode_frame(raw, self.client.bounds, lenient=True))
        except FrameError as e:
            log.warning("kernel %s sent a message that was skipped: %s", self.kernel_id, e)
        except Exception:  # noqa: BLE001 - same: the next message is read
            log.exception("kernel %s: a message could not be routed", self.kernel_id)

    async def _read(self) -> None:
        """Waits for the websocket's end (then tells every request); reads the frames the
        connection does not hand over itself (a fragmented message's, FrameConnection)."""
        assert self._ws is not None
        try:
            async for raw in self._ws:
                self._take(raw)
        except websockets.WebSocketException as e:
            log.warning("websocket of kernel %s closed: %s", self.kernel_id, e)
        finally:
            self.broadcast({"msg_type": DISCONNECTED_EVENT})

    def _route(self, msg: dict[str, Any]) -> None:
        parent = (msg.get("parent_header") or {}).get("msg_id")
        if parent is None or parent == "":
            if msg.get("msg_type") == "status":
                state = msg["content"].get("execution_state")
                if state in (KERNEL_RESTARTING, KERNEL_DEAD):
                    self.broadcast({"msg_type": KERNEL_STATUS_EVENT, "state": state})
                    self.on_kernel_status(state)
            return
        queue = self._listeners.get(parent) if isinstance(parent, str) else None
        if queue is not None:
            queue.put_nowait(msg)

    def broadcast(self, event: dict[str, Any]) -> None:
        for queue in self._listeners.values():
            queue.put_nowait(event)

    async def send(self, channel: str, msg_type: str, content: dict[str, Any],
                   expect_reply: bool = True, buffers: list[bytes] | None = None,
                   subshell_id: str | None = None) -> asyncio.Queue[dict[str, Any]]:
        """Send a request; the returned queue receives every message that answers it.
        ``buffers`` (binary parts) need the v1 protocol; ``subshell_id``: a kernel subshell."""
        if not self.is_open or self._ws is None:
            raise KernelUnavailable(f"the websocket of kernel {self.kernel_id} is closed")
        msg = self._session.msg(msg_type, content)
        if buffers:
            if not self._binary:
                raise KernelUnavailable("the gateway speaks only the legacy JSON protocol: binary "
                                        "buffers (file transfers) need v1.kernel.websocket.jupyter.org")
            msg["buffers"] = buffers
        if subshell_id is not None:
            msg["header"]["subshell_id"] = subshell_id
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if expect_reply:
            self._listeners[msg["header"]["msg_id"]] = queue
        if self._binary:
            frame: str | bytes = encode_frame(msg, channel)
        else:
            frame = pack_json({**msg, "channel": channel}).decode()
        try:
            await self._ws.send(frame)
        except websockets.WebSocketException as e:
            self._listeners.pop(msg["header"]["msg_id"], None)
            raise KernelUnavailable(f"cannot send to kernel {self.kernel_id}: {e}") from e
        queue.msg_id = msg["header"]["msg_id"]  # type: ignore[attr-defined]
        return queue

    def forget(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._listeners.pop(getattr(queue, "msg_id", ""), None)

    async def ping(self, timeout: float) -> bool:
        """Whether the kernel answers a kernel_info_request on its control channel within
        ``timeout``: ipykernel serves control in a thread of its own, so a kernel busy with a cell
        answers too; a frozen kernel, a dead node or a cut network does not."""
        if not self.is_open:
            return False
        try:
            queue = await self.send("control", "kernel_info_request", {})
        except KernelUnavailable:
            return False
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while (msg := await next_message(queue, deadline)) is not None:
                if msg.get("msg_type") == "kernel_info_reply":
                    return True
                if msg.get("msg_type") == DISCONNECTED_EVENT:
                    return False
            return False
        finally:
            self.forget(queue)

    async def kernel_info(self, timeout: float) -> dict[str, Any]:
        """Wait until the kernel answers on shell AND its IOPub output reaches us.

        A reply on shell alone is not enough: ZMQ's PUB/SUB drops what a kernel publishes
        before the gateway's subscription is in place (the "slow joiner"), and a run whose
        final ``status: idle`` was dropped would wait for its whole timeout. So, like
        jupyter_server's nudge, ask again until the request's IOPub status arrives too.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            queue = await self.send("shell", "kernel_info_request", {})
            reply: dict[str, Any] | None = None
            iopub_seen = False
            attempt_end = min(deadline, loop.time() + 1.0)
            try:
                while not (reply is not None and iopub_seen):
                    msg = await next_message(queue, attempt_end if reply is not None else deadline)
                    if msg is None:
                        break
                    kind = msg.get("msg_type")
                    if kind == "kernel_info_reply":
                        reply = dict(msg["content"])
                    elif kind == "status":
                        iopub_seen = True
                    elif kind == DISCONNECTED_EVENT:
                        raise KernelUnavailable(f"kernel {self.kernel_id} disconnected")
            finally:
                self.forget(queue)
            if reply is not None and iopub_seen:
                return reply
            if loop.time() >= deadline:
                raise KernelUnavailable(f"kernel {self.kernel_id} did not answer within {timeout:.0f} s")


async def next_message(queue: asyncio.Queue[dict[str, Any]], deadline: float) -> dict[str, Any] | None:
    """The next message, or None once the loop clock passes ``deadline``."""
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return queue.get_nowait() if not queue.empty() else None
    try:
        return await asyncio.wait_for(queue.get(), remaining)
    except asyncio.TimeoutError:
        return None
