"""A kernel manager for Jupyter Server (JupyterLab, Notebook 7) on kernelmode's Jupyter API: it
shows every session the token may see as a running kernel, so a person picks an agent's session
in JupyterLab's kernel list or its *Select Kernel* dialog.

Jupyter Server's own gateway manager lists only the kernels it started itself. Use::

    jupyter lab --gateway-url=http://127.0.0.1:8888 --GatewayClient.auth_token=$KERNELMODE_TOKEN \\
        --ServerApp.kernel_manager_class=kernelmode.console.jupyter_server.AttachingKernelManager

When JupyterLab exits it stops only the kernels it started (Jupyter's own manager stops every
kernel it knows; kernelmode would only detach from an agent's session anyway).
"""

from __future__ import annotations

from typing import Any

from jupyter_server.gateway.gateway_client import gateway_request
from jupyter_server.gateway.managers import GatewayMappingKernelManager
from tornado.escape import json_decode


class AttachingKernelManager(GatewayMappingKernelManager):
    """GatewayMappingKernelManager that attaches to every kernel the gateway lists."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._started: set[str] = set()  # kernels this server started (not attached to)

    async def start_kernel(  # type: ignore[override]
            self, *, kernel_id: str | None = None, path: str | None = None, **kwargs: Any) -> str:
        started = await super().start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        if kernel_id is None:
            self._started.add(started)
        return str(started)

    async def list_kernels(self, **kwargs: Any) -> list[dict[str, Any]]:
        response = await gateway_request(self.kernels_url, method="GET")
        for model in json_decode(response.body):
            if model["id"] not in self._kernels:
                await super().start_kernel(kernel_id=model["id"])  # attach: no new kernel
        kernels: list[dict[str, Any]] = await super().list_kernels(**kwargs)
        return kernels

    async def shutdown_all(self, now: bool = False) -> None:  # type: ignore[override]
        for kernel_id in list(self._kernels):
            if kernel_id in self._started:
                await self.shutdown_kernel(kernel_id, now=now)
            else:
                self.remove_kernel(kernel_id)
