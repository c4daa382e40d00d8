"""Classes loaded into the Kernel Gateway process by its config file, gateway/config/kernel_gateway_config.py."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import threading
import time

import orjson
import zmq
import zmq.asyncio
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from kernel_gateway.services.kernels.manager import SeedingMappingKernelManager
from traitlets import default

from ..protocol.frames import DROPPED, MAX_HEADER_BYTES, json_shape_error
from .ws_batch import BatchedWrites

MAX_ZMQ_SOCKETS = 65_536
# The manager's cap on a stream (sessions.max_output_bytes) + 1: longer stream texts are cut here.
STREAM_CHARS = int(os.environ.get("KERNELMODE_GW_MAX_STREAM_CHARS", "0"))
# The largest message the manager reads (frames.message_limit): over it, a message's metadata,
# content and buffers are replaced here by a note of their size, so that neither this process
# nor the manager ever holds or decodes one giant message of a kernel's making.
MAX_MESSAGE_BYTES = int(os.environ.get("KERNELMODE_GW_MAX_MESSAGE_BYTES", "0"))


def _cut_stream(parts: list) -> list:
    """[header, parent, metadata, content, *buffers] of a message; a ``stream`` message's text is
    cut to STREAM_CHARS characters (which the manager then marks as truncated)."""
    try:
        if json.loads(bytes(parts[0])).get("msg_type") != "stream":
            return parts
        if json_shape_error(parts[3]) is not None:
            return parts  # not a stream's shape: left for the size check to drop
        content = json.loads(bytes(parts[3]))
        content["text"] = str(content.get("text", ""))[:STREAM_CHARS]
    except (ValueError, TypeError, AttributeError):
        return parts
    return [parts[0], parts[1], parts[2], json.dumps(content).encode(), *parts[4:]]


def _cut_oversized(parts: list) -> list | None:
    """The message with its metadata, content and buffers replaced by a note when it is over
    MAX_MESSAGE_BYTES (None: drop it, its header alone is over)."""
    size = sum(len(p) for p in parts)
    if size <= MAX_MESSAGE_BYTES:
        return parts
    if len(parts[0]) + len(parts[1]) > MAX_HEADER_BYTES:
        return None
    note = {DROPPED: {"bytes": size, "limit": MAX_MESSAGE_BYTES,
                      "reason": f"over the limit of {MAX_MESSAGE_BYTES:,} bytes a message"}}
    return [parts[0], parts[1], b"{}", json.dumps(note).encode()]


log = logging.getLogger("kernelmode.gateway")


def watch_lease(path: str, timeout: float, interval: float = 1.0) -> None:
    """SIGTERM this gateway (which shuts its kernels down) once its manager's lease file is older
    than ``timeout``: a manager that crashed and never came back leaves nothing running for long.
    A manager that comes back in time adopts the gateway and renews the lease."""
    while True:
        time.sleep(interval)
        try:
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            age = float("inf")
        if age > timeout:
            log.warning("no manager for %.0f s (lease %s): shutting down with my kernels", age, path)
            os.kill(os.getpid(), signal.SIGTERM)
            return


class NoDelayWebsocketConnection(BatchedWrites, ZMQChannelsWebsocketConnection):
    """Turns Nagle off on each kernel websocket.

    tornado re-enables Nagle after every HTTP request and nothing turns it off for websockets,
    so each exchange of more than one message stalls ~40 ms on delayed ACK (GATEWAY-NOTES,
    pitfall 1). The frames of one loop pass leave in one send instead (ws_batch.BatchedWrites).
    """

    def connect(self):  # noqa: ANN201 (same signature as the parent)
        self.websocket_handler.set_nodelay(True)
        return super().connect()

    def _on_zmq_reply(self, stream, msg_list):  # noqa: ANN001, ANN202
        """Cut a stream message's text to what the manager keeps anyway (its output cap), here,
        before it is framed and sent: one huge ``print`` then costs the manager nothing. Any
        other message over the manager's limit loses its content here, with a note."""
        if self.subprotocol == "v1.kernel.websocket.jupyter.org" and len(msg_list) >= 4:
            iopub = getattr(stream, "channel", None) == "iopub"
            if STREAM_CHARS and iopub and len(msg_list[3]) > STREAM_CHARS + 1024:
                msg_list = _cut_stream(msg_list)
            if MAX_MESSAGE_BYTES:
                msg_list = _cut_oversized(msg_list)
                if msg_list is None:
                    self.log.warning("kernel %s: a message with a header over %d bytes was dropped",
                                     self.kernel_id, MAX_HEADER_BYTES)
                    return None
            if iopub:
                self._note_activity(msg_list)
        self._note_stream(stream)
        return super()._on_zmq_reply(stream, msg_list)

    def _note_activity(self, parts: list) -> None:
        """What jupyter_server's IOPub activity watcher records (the kernel's last activity, and
        its execution state from status messages), read from the messages this connection
        forwards anyway: a second IOPub socket per kernel woke this process for every message
        a kernel published, ~0.7 ms of its CPU per `1+1` run (bench/RESULTS.md)."""
        if len(parts[0]) > MAX_HEADER_BYTES or len(parts[1]) > MAX_HEADER_BYTES:
            return
        kernel, kernels = self.kernel_manager, self.multi_kernel_manager
        try:
            # orjson reads the parts in place (zmq frames are buffers: no copy), ~5x faster than
            # json; the parent header and the content only for a status message.
            msg_type = orjson.loads(memoryview(parts[0])).get("msg_type")
            status = msg_type == "status"
            parent_type = orjson.loads(memoryview(parts[1])).get("msg_type") if status else None
            state = orjson.loads(memoryview(parts[3])).get("execution_state") if status else None
        except (ValueError, TypeError, AttributeError):  # orjson.JSONDecodeError is a ValueError
            return
        track = kernels.track_message_type
        if getattr(kernel, "execution_state", None) == "busy" or track(msg_type) or track(parent_type):
            kernels.last_kernel_activity = kernel.last_activity = utcnow()
        if status and isinstance(state, str):
            if track(parent_type):
                kernel.execution_state = state
            elif getattr(kernel, "execution_state", None) == "starting" and state != "starting":
                kernel.execution_state = "idle"


RELEASE_ARMED = "_kernelmode_release_armed"  # set on a kernel manager whose "dead" callback releases it


class ManyKernelsMappingKernelManager(SeedingMappingKernelManager):
    """The gateway's kernel manager, with a ZMQ context that can hold many kernels' sockets.

    All kernels share one ZMQ context, whose default cap of 1023 sockets (about 6 per kernel
    with a websocket attached) made kernel starts fail with "Too many open files" at ~170
    kernels.
    """

    def __init__(self, **kwargs):  # noqa: ANN003, ANN204
        super().__init__(**kwargs)
        self.cleanups: set[asyncio.Task] = set()
        lease = os.environ.get("KERNELMODE_GW_LEASE")
        if lease:  # started by kernelmode's manager (always, but for a hand-started gateway)
            timeout = float(os.environ.get("KERNELMODE_GW_ORPHAN_TIMEOUT", "120"))
            threading.Thread(target=watch_lease, args=(lease, timeout), name="lease", daemon=True).start()

    def start_watching_activity(self, kernel_id: str) -> None:
        """No IOPub socket of its own: the kernel's websocket connection notes its activity on
        the way through (NoDelayWebsocketConnection._note_activity).

        jupyter_server's watcher opened a second IOPub socket per kernel and so woke this process
        for every message a kernel published, only to note the time and the execution state;
        kernelmode reads neither from the gateway (the manager follows its sessions itself, and
        the gateway's culling is off). The kernel is ready when this is called: its state is
        ``idle`` (a websocket's nudge waits for the end of ``starting``)."""
        kernel = self._kernels[kernel_id]
        # Called again after a restart on new ports: armed once, a mark that goes with the kernel
        # (a set here kept the id of every kernel that was ever shut down normally).
        if not getattr(kernel, RELEASE_ARMED, False):
            setattr(kernel, RELEASE_ARMED, True)
            kernel.add_restart_callback(functools.partial(self.release_dead, kernel), "dead")
        kernel.reason = ""
        kernel.last_activity = utcnow()
        kernel.execution_state = "idle"
        kernel._activity_stream = None

    def release_dead(self, kernel) -> None:  # noqa: ANN001 (a KernelManager)
        """The restarter gave the kernel up (it died and so did its restarts, e.g. one that dies
        at start): jupyter_server only forgets it, and nothing would release what its provisioner
        holds (kernel dir, log, uid lease, cgroup, a Docker container). Its death record, which
        the manager reads, is kept (the provisioner wrote it when it saw the death)."""
        task = asyncio.ensure_future(kernel.cleanup_resources(restart=False))
        self.cleanups.add(task)
        task.add_done_callback(self.cleanups.discard)

    @default("context")
    def _context_default(self) -> zmq.asyncio.Context:
        self._created_context = True
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, MAX_ZMQ_SOCKETS)
        return context
