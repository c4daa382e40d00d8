"""Classes loaded into the Kernel Gateway process by gateway-config/kernel_gateway_config.py."""

from __future__ import annotations

import zmq
import zmq.asyncio
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from kernel_gateway.services.kernels.manager import SeedingMappingKernelManager
from traitlets import default

MAX_ZMQ_SOCKETS = 65_536


class NoDelayWebsocketConnection(ZMQChannelsWebsocketConnection):
    """Turns Nagle off on each kernel websocket.

    tornado re-enables Nagle after every HTTP request and nothing turns it off for websockets,
    so each exchange of more than one message stalls ~40 ms on delayed ACK (GATEWAY-NOTES,
    pitfall 1).
    """

    def connect(self):  # noqa: ANN201 (same signature as the parent)
        self.websocket_handler.set_nodelay(True)
        return super().connect()


class ManyKernelsMappingKernelManager(SeedingMappingKernelManager):
    """The gateway's kernel manager, with a ZMQ context that can hold many kernels' sockets.

    All kernels share one ZMQ context, whose default cap of 1023 sockets (about 6 per kernel
    with a websocket attached) made kernel starts fail with "Too many open files" at ~170
    kernels.
    """

    @default("context")
    def _context_default(self) -> zmq.asyncio.Context:
        self._created_context = True
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, MAX_ZMQ_SOCKETS)
        return context
