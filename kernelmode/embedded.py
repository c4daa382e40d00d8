"""`kernelmode mcp` without a URL: a whole service in this process, its MCP tools over stdio.

Gateway, manager and sandboxed kernels start in a fresh data dir and stop when the client goes
(stdin closes). An MCP host launches this at each of its starts, so the order is chosen for the
first answers: the gateway child is spawned first (its start, a Python process of its own, runs
on the other core while this process imports), then the MCP SDK and the tools are imported and
``initialize`` is answered; the session layer is imported after that, in a thread, and the first
kernel starts as soon as both it and the gateway are up. A tool call that needs the sessions
waits for the start; a failed start is its answer (an isError saying what to do). stdout
carries only the protocol (the SDK points fd 1 at stderr while it serves; logs go to stderr).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .config import Settings
from .early_start import EarlyStart, LocalStart, start_host_tools
from .errors import KernelmodeError
from .tools.registry import ToolRegistry

if TYPE_CHECKING:
    from .server import KernelmodeApp
    from .services import Services

log = logging.getLogger("kernelmode.mcp")

_TEMP_PREFIX = "kernelmode-mcp-"
# Not $TMPDIR: kernels run as other uids and must be able to traverse the path to their workspace.
_TEMP_BASE = Path("/tmp")


def _sweep_stale_data_dirs() -> None:
    """Remove the data dirs of embedded services whose process is gone (killed, not stopped)."""
    from .artifacts.volume import detach_all

    for d in _TEMP_BASE.glob(_TEMP_PREFIX + "*"):
        try:
            pid = int((d / "owner.pid").read_text())
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # not ours to judge (no pid file yet, or another user's)
        detach_all(d)
        shutil.rmtree(d, ignore_errors=True)
        log.info("removed %s, left by an embedded service that was killed", d)


def prefer_fast_sandbox(settings: Settings) -> None:
    """``sandbox.backend: auto`` (the user did not choose): bubblewrap when a bare sandbox starts
    here, without asking a Docker engine (its probe and throw-away container cost seconds at
    every launch of an embedded server, and a container starts slower than bwrap). Else 'auto'
    stays, and the service probes Docker as `serve` does."""
    sb = settings.sandbox
    exe = shutil.which(sb.bwrap_path) if sb.backend == "auto" else None
    if exe is None:
        return
    try:  # the namespaces a kernel's sandbox needs, around `true`: a few ms
        ok = subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
                            capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if ok:
        sb.backend = "bwrap"
        log.info("sandbox backend: bwrap (embedded, auto: it starts fastest; no Docker probe)")


def resume_gc() -> None:
    """The garbage collector back on after the start (cli.py paused it), the start's objects
    moved out of its way first (``gc.freeze``): modules, classes and the service's parts, which
    live as long as the process. Not collected first: a full collection here found nothing to
    free and cost ~65 ms of CPU (the few cycles a start may leave stay, once)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


async def _services(app: asyncio.Future[KernelmodeApp]) -> Services:
    """The service's, once started (what a tool call waits for); raises what stopped it."""
    return await (await asyncio.shield(app)).started()


async def _service(settings: Settings, tools: ToolRegistry, early: EarlyStart,
                   app: asyncio.Future[KernelmodeApp], done: asyncio.Event) -> None:
    """The service, once the client's greeting (``initialize``) has been answered (its modules
    imported in a thread: the loop answers the client meanwhile), started in the background,
    until ``done``; then stopped."""
    answered = asyncio.create_task(early.mcp.greeted.wait())
    gone = asyncio.create_task(done.wait())
    await asyncio.wait([answered, gone], return_when=asyncio.FIRST_COMPLETED)
    answered.cancel()
    gone.cancel()
    if not early.mcp.greeted.is_set():  # the client went before it said anything: nothing to start
        app.set_exception(KernelmodeError("the MCP client closed the connection"))
        app.exception()
        return
    log.info("the client's greeting is answered: importing and starting the service")
    try:
        server = await asyncio.to_thread(importlib.import_module, "kernelmode.server")
        async with server.running(settings, tools, background=True, early=early) as started:
            app.set_result(started)
            try:
                await started.started()
            except Exception as e:  # the process goes on serving; each tool call answers with the reason
                log.error("cannot start: %s", getattr(e, "message", None) or repr(e))
            else:
                log.info("kernelmode MCP (stdio) ready; downloads served on %s", started.url)
            finally:
                resume_gc()
            await done.wait()
    except Exception as e:
        if not app.done():
            app.set_exception(e)
        log.error("cannot start: %s", getattr(e, "message", None) or repr(e))


async def embedded(settings: Settings) -> int:
    """Start a whole service in this process and serve its MCP tools over stdio until the client
    goes. ``initialize`` and the tool list are answered before the session layer is imported."""
    temp_dir: Path | None = None
    if settings.server.data_dir == Settings().server.data_dir:
        # Each client gets its own service: a shared data dir would let one instance clean up
        # another's workspaces at start.
        await asyncio.to_thread(_sweep_stale_data_dirs)
        temp_dir = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=_TEMP_BASE))
        (temp_dir / "owner.pid").write_text(str(os.getpid()))
        settings.server.data_dir = temp_dir
        # Nobody will adopt this private gateway after a crash: it should not wait long.
        settings.gateway.orphan_timeout_seconds = 5.0
    # MCP clients stop their servers by closing stdin, then SIGTERM to the process group: either
    # way, clean up (kernels, volumes, the data dir) before exiting.
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    stopping = False
    await asyncio.to_thread(prefer_fast_sandbox, settings)

    def on_signal() -> None:
        # The SDK closes stdin, then sends SIGTERM 2 s later: by then the cleanup may be under
        # way, and cancelling it would leave the data dir behind.
        if not stopping and main is not None:
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    local = LocalStart(settings, settings.server.data_dir.resolve())
    try:
        if settings.sandbox.backend != "auto" and not settings.gateway.url:
            # Spawned now: its start overlaps the imports below. Whatever fails here, the service's
            # start raises again (every tool call waits for that start and answers with its error).
            local.begin()
            await local.spawned.wait()
        # The MCP SDK and the tools' module (~0.5 s of imports), in a thread: the loop renews the
        # gateway's lease meanwhile.
        front = await asyncio.to_thread(importlib.import_module, "kernelmode.mcp.app")
        if local.process is not None:
            local.start_check()  # kernelspec and check beside the session layer's import (after initialize)
        tools = ToolRegistry()
        policy = await start_host_tools(settings, tools)  # the instructions list the tools
        app: asyncio.Future[KernelmodeApp] = loop.create_future()
        mcp = front.KernelmodeMCP(settings, tools, partial(_services, app))
        done = asyncio.Event()
        service = asyncio.create_task(_service(settings, tools, EarlyStart(local, policy, mcp), app, done),
                                      name="service")
        try:
            await mcp.server.run_stdio_async()
        finally:
            stopping = True  # the service stops next
            log.info("kernelmode MCP (stdio) stopping")
            done.set()
            await service
        return 0
    except asyncio.CancelledError:
        return 0
    except KernelmodeError as e:  # the tools could not start (nothing else is raised before serving)
        log.error("cannot start: %s", e.message)
        return 2
    finally:
        await local.stop()  # done already if the service started; not if the tools failed
        local.release()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
