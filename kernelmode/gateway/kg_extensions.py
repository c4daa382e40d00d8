"""Classes loaded into the Kernel Gateway process by gateway-config/kernel_gateway_config.py."""

from __future__ import annotations

from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection


class NoDelayWebsocketConnection(ZMQChannelsWebsocketConnection):
    """Turns Nagle off on each kernel websocket.

    tornado re-enables Nagle after every HTTP request and nothing turns it off for websockets,
    so each exchange of more than one message stalls ~40 ms on delayed ACK (GATEWAY-NOTES,
    pitfall 1).
    """

    def connect(self):  # noqa: ANN201 (same signature as the parent)
        self.websocket_handler.set_nodelay(True)
        return super().connect()
