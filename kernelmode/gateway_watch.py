"""The watches of the kernel gateway (server.py starts one): an embedded gateway is our child, so
its exit is seen at once and it is started again; an external one is asked every few seconds.
Either way the sessions are told what their kernels' loss means (sessions/gateway_loss.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .audit import audit
from .errors import KernelmodeError

if TYPE_CHECKING:  # the app passes itself in; importing it would be a cycle
    from .server import KernelmodeApp

log = logging.getLogger("kernelmode")


async def watch_embedded(app: KernelmodeApp) -> None:
    """The gateway's exit is seen at once (we are its parent): sessions are told their
    kernels are gone, then a new gateway is started (with backoff while that fails)."""
    assert app.gateway_process is not None and app.gateway is not None
    while not app.stopping:
        code = await app.gateway_process.wait()
        if app.stopping:
            return
        log.error("the kernel gateway exited (code %s), and its kernels with it; restarting it\n%s",
                  code, app.gateway_process.log_tail(1000))
        audit("gateway_died", exit_code=code)
        await app.sessions.gateway_lost()
        if app.settings.sandbox.backend == "docker":  # their launchers died with the gateway
            from .sandbox.docker_engine import remove_orphans, server_id

            await asyncio.to_thread(remove_orphans, server_id(app.data_dir))
        backoff = 0.5
        while not app.stopping:
            try:
                await app.gateway_process.start(app.settings.gateway.startup_timeout_seconds)
                break
            except KernelmodeError as e:
                log.error("the kernel gateway did not restart (%s); retrying in %.1f s", e.message, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
        if app.stopping:
            return
        app.gateway.url = app.gateway_process.url  # a new port; same token
        app.gateway_restarts += 1
        app.sessions.metrics.gateway_restarts.inc()
        audit("gateway_restarted", restarts=app.gateway_restarts)
        app.sessions.gateway_back()

async def watch_external(app: KernelmodeApp) -> None:
    """An external gateway is not our child: it is asked every few seconds. Once it answers
    again after it did not (restarted, or the network came back), the sessions whose kernels
    it lost are marked dead, and the log names those that survived."""
    assert app.gateway is not None
    down = False
    while not app.stopping:
        await asyncio.sleep(max(2.0, 4 * app.settings.gateway.poll_interval_seconds))
        try:
            # Bounded like a probe: a gateway that hangs is as down as one that refuses.
            running = {str(k["id"]) for k in await app.gateway.list_kernels(
                timeout=app.settings.gateway.probe_timeout_seconds)}
        except KernelmodeError as e:
            if not down:
                log.error("the external kernel gateway does not answer: %s", e.message)
                audit("gateway_unreachable", url=app.settings.gateway.url)
            down = True
            continue
        if down or app.sessions.kernels_vanished(running):
            down = False
            survived, lost = await app.sessions.external_gateway_back(running)
            app.gateway_restarts += 1
            log.warning("the external kernel gateway answers again; sessions that survived: %s; "
                        "lost (kernel gone): %s", ", ".join(survived) or "none", ", ".join(lost) or "none")
            audit("gateway_back", survived=survived, lost=lost)
