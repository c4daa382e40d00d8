"""`kernelmode mcp`: MCP over stdio, for clients that launch their servers as commands.

Two modes. With a URL, a transport bridge to a running `kernelmode serve` (its /mcp endpoint):
messages pass through unchanged, so the tools are the server's. Without one, an embedded
service: gateway, manager and sandboxed kernels start in this process, in a fresh data dir,
and stop when the client goes (stdin closes). Either way, stdout carries only the protocol
(the SDK points fd 1 at stderr while it serves; logs go to stderr).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.server.stdio import stdio_server

from ..config import Settings
from ..errors import KernelmodeError

if TYPE_CHECKING:
    from ..server import KernelmodeApp

log = logging.getLogger("kernelmode.mcp")


async def _pump(source: Any, sink: Any, what: str, done: anyio.Event) -> None:
    try:
        async for message in source:
            if isinstance(message, Exception):
                log.warning("%s: %s", what, message)
                continue
            await sink.send(message)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
        pass
    finally:
        done.set()


async def _preflight(http: httpx2.AsyncClient, base: str) -> str | None:
    """Why the server cannot be used (unreachable, wrong token), or None."""
    try:
        r = await http.get(base + "/v1/tools")
    except httpx2.HTTPError as e:
        return f"cannot reach the kernelmode server at {base}: {e}"
    if r.status_code == 401:
        return f"the server at {base} refused the token (check --token / $KERNELMODE_TOKEN)"
    if r.status_code != 200:
        return f"the server at {base} answered {r.status_code}: is it a kernelmode server?"
    return None


async def bridge(url: str, token: str) -> int:
    """Relay stdio to the /mcp endpoint of a running server until either side ends."""
    base = url.rstrip("/").removesuffix("/mcp")
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(30.0, read=None))
    problem = await _preflight(http, base)
    if problem is not None:
        await http.aclose()
        log.error("%s", problem)
        return 2
    endpoint = base + "/mcp"
    try:
        async with stdio_server() as (stdin, stdout), \
                streamable_http_client(endpoint, http_client=http) as (server_in, server_out):
            done = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pump, stdin, server_out, "from the client", done)
                tg.start_soon(_pump, server_in, stdout, "from the server", done)
                await done.wait()
                tg.cancel_scope.cancel()
    finally:
        await http.aclose()
    return 0


_TEMP_PREFIX = "kernelmode-mcp-"
# Not $TMPDIR: kernels run as other uids and must be able to traverse the path to their workspace.
_TEMP_BASE = Path("/tmp")


def _sweep_stale_data_dirs() -> None:
    """Remove the data dirs of embedded services whose process is gone (killed, not stopped)."""
    from ..artifacts.volume import detach_all

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


async def _log_start(app: KernelmodeApp) -> None:
    """Say when the background start is done (or why it failed: the process goes on serving,
    and each tool call that needs a kernel answers with the reason)."""
    try:
        await app.started()
    except Exception as e:
        log.error("cannot start: %s", getattr(e, "message", None) or repr(e))
        return
    log.info("kernelmode MCP (stdio) ready; downloads served on %s", app.url)


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


async def embedded(settings: Settings) -> int:
    """Start a whole service in this process and serve its MCP tools over stdio.

    ``initialize`` and the tool list are answered at once; the gateway, the sandbox check and the
    first kernel start in the background, and a tool call that needs them waits for them."""
    from ..server import running

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
    try:
        # Only the tools start before the body (the instructions list them); the rest in the
        # background, awaited by each tool call that needs it (KernelmodeMCP).
        async with running(settings, background=True) as app:
            try:
                started = asyncio.create_task(_log_start(app), name="start-log")
                await app.mcp_server().server.run_stdio_async()
                started.cancel()
            finally:
                stopping = True  # running() stops the service next
                log.info("kernelmode MCP (stdio) stopping")
        return 0
    except asyncio.CancelledError:
        return 0
    except KernelmodeError as e:  # the tools could not start (nothing else is raised before the body)
        log.error("cannot start: %s", e.message)
        return 2
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
