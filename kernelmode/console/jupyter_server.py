"""A kernel manager for Jupyter Server (JupyterLab, Notebook 7) on kernelmode's Jupyter API: it
shows every session the token may see as a running kernel, so a person picks an agent's session
in JupyterLab's kernel list or its *Select Kernel* dialog.

Jupyter Server's own gateway manager lists only the kernels it started itself. Use::

    jupyter lab --gateway-url=http://127.0.0.1:8888 --GatewayClient.auth_token=$KERNELMODE_TOKEN \\
        --ServerApp.kernel_manager_class=kernelmode.console.jupyter_server.AttachingKernelManager

When JupyterLab exits it stops only the kernels it started (Jupyter's own manager stops every
kernel it knows; kernelmode would only detach from an agent's session anyway).

Kernels are named after their session: JupyterLab labels a running kernel that no notebook uses
by its model's ``name`` and the start of its id, and a spec name (``kernelmode-docker
(10f29c53)``) does not tell a person which agent's session it is; ``agent1 · team-a (10f29c53)``
does. kernelmode's Jupyter API keeps the spec name (what Jupyter clients start kernels by); only
the models this server hands JupyterLab carry the label.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.gateway.gateway_client import gateway_request
from jupyter_server.gateway.managers import GatewayMappingKernelManager
from tornado.escape import json_decode


def labelled(model: dict[str, Any]) -> dict[str, Any]:
    """A copy of a kernel model named after its kernelmode session and tenant (the stored model,
    which the gateway manager refreshes, keeps the spec name)."""
    about = model.get("kernelmode") or {}
    session = about.get("session_id")
    if not session:
        return model
    tenant = about.get("tenant")
    return {**model, "name": f"{session} · {tenant}" if tenant else str(session)}


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
        return [labelled(model) for model in kernels]

    async def kernel_model(self, kernel_id: str) -> dict[str, Any]:
        model: dict[str, Any] = await super().kernel_model(kernel_id)
        return labelled(model)

    async def shutdown_all(self, now: bool = False) -> None:  # type: ignore[override]
        for kernel_id in list(self._kernels):
            if kernel_id in self._started:
                await self.shutdown_kernel(kernel_id, now=now)
            else:
                self.remove_kernel(kernel_id)
