"""A session's packages: installs from every front door into the layer of the session's kernel
(REST, MCP, the client, a session created with ``packages``), and ``%pip install`` typed in a
cell, which the preamble sends over the tool channel as a reserved call (``PIP`` in
kernel/preamble.py): the manager fetches, the kernel then imports. The calling session is the
channel's, never one named in the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from ..errors import HostOnly, KernelmodeError, ToolFailed
from ..models import LayerWheel, PackagesRequest, PackagesResult
from ..packages.cache import CachedWheel
from ..packages.layer import PackageLayer
from ..packages.service import PackageService
from .live import LiveSession

log = logging.getLogger("kernelmode.sessions")


def layer_wheels(layer: PackageLayer | None) -> list[LayerWheel]:
    """What a checkpoint records of the session's packages (the wheels its layer holds)."""
    out = []
    for w in layer.wheels() if layer is not None else []:
        try:
            out.append(LayerWheel.model_validate(w))
        except ValidationError:
            log.warning("package layer %s: an unreadable record is ignored", layer.root if layer else "")
    return out


def _layer(s: LiveSession) -> PackageLayer:
    layer = s.kernel.layer
    if layer is None:  # the SessionManager gives every kernel one, except on a remote gateway
        raise HostOnly("package installs need the session's package layer on the manager's disk, "
                       "which kernels on a remote gateway (gateway.url) cannot mount")
    return layer


class SessionPackages:
    def __init__(self, service: PackageService, live: Callable[[str], LiveSession | None]) -> None:
        self.service = service
        self._live = live

    async def install(self, s: LiveSession, packages: list[str], source: str) -> PackagesResult:
        layer = _layer(s)
        return await self.service.install(layer, packages, session_id=s.info.session_id,
                                          tenant=s.info.tenant, source=source)

    async def copy_in(self, s: LiveSession, wheels: list[LayerWheel], source: str = "fork") -> PackagesResult:
        """A fork (or a session from a checkpoint) gets the source's packages: the same cached
        wheels, unpacked into its own layer (independent of the source's from then on)."""
        layer = _layer(s)
        cached = [CachedWheel(w.name, w.version, w.filename, w.sha256, w.size) for w in wheels]
        return await self.service.copy_in(layer, cached, session_id=s.info.session_id,
                                          tenant=s.info.tenant, source=source)

    async def from_kernel(self, session_id: str, arguments: dict[str, Any]) -> Any:
        """``%pip install ...`` in a cell: the result as JSON data, or ToolFailed with the reason."""
        s = self._live(session_id)
        if s is None:
            raise ToolFailed("the session is gone")
        try:
            req = PackagesRequest.model_validate(arguments)
        except ValidationError as e:
            raise ToolFailed(f"invalid_request: {e.errors()[0].get('msg', 'bad request')}") from None
        try:
            result = await self.install(s, req.packages, "kernel")
        except KernelmodeError as e:
            raise ToolFailed(f"{e.code}: {e.message}") from None
        except Exception as e:  # the kernel waits for an answer: it must get one, whatever failed
            log.exception("session %s: %%pip install failed", session_id)
            raise ToolFailed(f"internal: the install failed ({type(e).__name__})") from None
        return result.model_dump(mode="json")
