"""The MCP tools: stateful Python for a model, on the SessionManager of a running KernelmodeApp.

Transports are elsewhere (``http.py`` for /mcp, ``stdio.py`` for `kernelmode mcp`); this module
is what the tools do and say. Every connection gets its own session on first use (keyed by the
stdio process, or by the streamable-HTTP ``Mcp-Session-Id``); naming a ``session_id`` reaches
any session the token may see, as over REST. Over HTTP the caller's tenant comes from the
``/mcp`` handler (``TENANT_HEADER``, set from the bearer token); over stdio the caller is the admin.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    METHOD_NOT_FOUND,
    CallToolResult,
    ContentBlock,
    ImageContent,
    ResourceLink,
    TextContent,
    ToolAnnotations,
)
from pydantic import Field

from .. import __version__
from ..artifacts.base import StoreError
from ..artifacts.workspace import clean_path
from ..errors import KernelmodeError, NotFound, SessionNotFound
from ..models import SESSION_ID_PATTERN, RunResult, SessionCreate
from ..sessions.runs import LiveRun
from ..tenants import ADMIN, Principal
from .budget import (
    McpRunResult,
    MessageTooLarge,
    fit_message,
    fit_text,
    lean_record,
    take_page,
    wire_bytes,
)
from .images import INLINE_TYPES, ImageTooLarge, fit_image
from .render import clip, run_text, size_text

if TYPE_CHECKING:
    from ..server import KernelmodeApp

log = logging.getLogger("kernelmode.mcp")

_STDIO = "stdio"
# Set by the /mcp handler from the bearer token (a client's own header of this name is dropped).
TENANT_HEADER = "x-kernelmode-tenant"
_MAX_FOLLOWED = 10_000  # runs whose shown output is remembered for get_run (per connection)
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript", "application/x-yaml",
               "image/svg+xml", "application/x-ipynb+json", "application/sql")

SessionArg = Annotated[str | None, Field(
    None, pattern=SESSION_ID_PATTERN,
    description="A session to use instead of this connection's own (from list_sessions or an "
    "earlier result). Omit it: each connection gets its own session, created on first use.")]


def _instructions(app: KernelmodeApp) -> str:
    tools = app.tools.infos()
    listed = "\n".join(f"- tools.{t.signature or t.name}: {t.description.splitlines()[0] if t.description else ''}"
                       for t in tools[:40])
    more = f"\n(and {len(tools) - 40} more: call list_tools)" if len(tools) > 40 else ""
    host = (f"Code can call these host tools (they run outside the sandbox, with the network):\n{listed}{more}"
            if tools else "No host tools are configured.")
    return (
        "kernelmode runs Python in a sandboxed, stateful Jupyter kernel. Variables, imports and "
        "loaded data persist between run_python calls of the same session, so build an analysis "
        "step by step instead of repeating work. The kernel has no network. Files live in "
        "/mnt/data: upload_file puts data there, and files your code writes there are kept and "
        "listed with download links; read_artifact shows you an image or text file. numpy, pandas "
        "and matplotlib are installed (plots appear as images). A long run keeps going in the "
        "background: run_python then returns status RUNNING with a run_id for get_run.\n" + host
    )


class KernelmodeMCP:
    """An MCPServer whose tools drive ``app.sessions``."""

    def __init__(self, app: KernelmodeApp) -> None:
        self.app = app
        self.cfg = app.settings.mcp
        self._own: dict[str, str] = {}  # connection key -> its session id
        self._own_locks: dict[str, asyncio.Lock] = {}
        self._seen: dict[tuple[str, str], tuple[int, int, int]] = {}  # (conn, run) -> chars/outputs shown
        self.server: MCPServer[Any] = MCPServer(
            name="kernelmode", version=__version__, instructions=_instructions(app),
            middleware=[self._refuse_discover, self._cap_message],
        )
        self._add_tools()

    # -- connection identity -----------------------------------------------------------------------
    @staticmethod
    async def _refuse_discover(ctx: Any, call_next: Any) -> Any:
        """Over HTTP, keep clients on the initialize handshake, whose connections have an identity.

        The 2026-07-28 per-request envelope has no connection, so "this client's session" would
        not exist; a client that probes server/discover falls back to initialize on this error.
        Over stdio the process is the connection, so the modern era is fine there.
        """
        if getattr(ctx, "method", None) == "server/discover" and getattr(ctx, "request", None) is not None:
            raise MCPError(METHOD_NOT_FOUND, "server/discover is not offered: use the initialize handshake")
        return await call_next(ctx)

    async def _cap_message(self, ctx: Any, call_next: Any) -> Any:
        """Every answer, measured as it goes on the wire, under ``mcp.max_message_bytes``: the one
        point where a whole result is known (progress notifications are clipped where sent)."""
        result = await call_next(ctx)
        if not isinstance(result, dict):
            return result  # a notification's (None)
        if getattr(ctx, "method", None) == "tools/call":
            result = fit_text(result, self.cfg.max_text_chars)
        try:
            return await fit_message(result, self.cfg.max_message_bytes)
        except MessageTooLarge as e:
            raise MCPError(INTERNAL_ERROR, str(e)) from e

    def _principal(self, ctx: Context[Any]) -> Principal:
        headers: Mapping[str, str] | None = ctx.headers
        if headers is None:
            return ADMIN  # stdio: whoever started the process owns the server
        principal = self.app.tenants.get(headers.get(TENANT_HEADER, ""))
        if principal is None:  # cannot happen behind McpHandler; refuse rather than guess
            raise ToolError("this request carries no tenant")
        return principal

    @staticmethod
    def _conn_key(ctx: Context[Any]) -> str | None:
        headers: Mapping[str, str] | None = ctx.headers
        if headers is None:
            return _STDIO  # one stdio process serves one client
        mcp_session = headers.get("mcp-session-id")  # checked by the SDK: it names a live MCP session
        # The tenant is part of the key: another tenant's request naming this MCP session id
        # never reaches this connection's kernel.
        return f"http:{headers.get(TENANT_HEADER, '')}:{mcp_session}" if mcp_session else None

    async def _session(self, ctx: Context[Any], session_id: str | None) -> tuple[str, str | None]:
        """(session id, a note for the model or None)."""
        principal = self._principal(ctx)
        if session_id:
            try:
                self.app.sessions.authorize(principal, session_id)
                info = self.app.sessions.get(session_id)
            except SessionNotFound as e:
                raise ToolError(f"unknown session {session_id!r}: omit session_id to use this "
                                "connection's own session, or call list_sessions") from e
            if info.status == "lost":
                raise ToolError(f"session {session_id!r} is lost (its kernel ended with a previous "
                                "server run); omit session_id to get a fresh session")
            return session_id, None
        key = self._conn_key(ctx)
        if key is None:
            info = await self._create(principal)
            return info.session_id, (
                f"NOTE: this connection is stateless, so a new session was made. Pass "
                f"session_id={info.session_id!r} in later calls to keep these variables.")
        lock = self._own_locks.setdefault(key, asyncio.Lock())
        async with lock:
            sid = self._own.get(key)
            if sid is not None:
                try:
                    if self.app.sessions.get(sid).status != "lost":
                        return sid, None
                except SessionNotFound:
                    pass
            info = await self._create(principal)
            self._forget_gone_connections()
            self._own[key] = info.session_id
            note = None if sid is None else (
                "NOTE: this connection's previous session was closed or expired; this is a new "
                "session, so earlier variables are gone.")
            return info.session_id, note

    def _forget_gone_connections(self) -> None:
        """Drop the entries of connections whose session is gone (closed, reaped)."""
        live = {i.session_id for i in self.app.sessions.all() if i.status != "lost"}
        for key in [k for k, sid in self._own.items() if sid not in live]:
            del self._own[key]
            lock = self._own_locks.get(key)
            if lock is not None and not lock.locked():
                del self._own_locks[key]

    async def _create(self, principal: Principal) -> Any:
        try:
            return await self.app.sessions.create(SessionCreate(), principal)
        except KernelmodeError as e:
            raise ToolError(f"could not start a session: {e.message}") from e

    # -- results -----------------------------------------------------------------------------------
    @staticmethod
    def _image_mime(out: dict[str, Any]) -> str | None:
        return next((m for m in ("image/png", "image/jpeg", "image/gif", "image/webp") if m in out.get("data", {})), None)

    async def _images(self, outputs: list[dict[str, Any]], room: int) -> tuple[list[ContentBlock], list[str]]:
        """Inline images of ``outputs``: at most ``max_images``, each within its share of ``room``
        bytes of the message (base64 makes 4 characters of 3 bytes)."""
        shown = [(out, mime) for out in outputs if (mime := self._image_mime(out)) is not None]
        notes = [f"{len(shown) - self.cfg.max_images} more image(s) were left out (see the files of this run)"
                 ] if len(shown) > self.cfg.max_images else []
        shown = shown[:self.cfg.max_images]
        blocks: list[ContentBlock] = []
        if not shown:
            return blocks, notes
        share = min(self.cfg.max_image_bytes, room // len(shown) * 3 // 4 - 1_024)
        for out, mime in shown:
            try:
                if share < 10_000:
                    raise ImageTooLarge("no room left in this answer")
                raw = base64.b64decode(out["data"][mime])
                # Decoding and resizing a big image takes a while: not on the event loop.
                small, kind = await asyncio.to_thread(fit_image, raw, mime, share)
            except (ValueError, binascii.Error, ImageTooLarge) as e:
                notes.append(f"an image could not be shown: {e}")
                continue
            if len(small) < len(raw):
                notes.append(f"an image is shown downscaled ({size_text(len(raw))} -> {size_text(len(small))}); "
                             "the original is among the files of this run")
            blocks.append(ImageContent(data=base64.b64encode(small).decode(), mime_type=kind))
        return blocks, notes

    def _room(self, blocks: list[ContentBlock], structured: dict[str, Any]) -> int:
        """Bytes of the message cap left after these blocks and this structured content."""
        dumped = CallToolResult(content=blocks, structured_content=structured).model_dump(
            by_alias=True, mode="json", exclude_none=True)
        return self.cfg.max_message_bytes - wire_bytes(dumped)

    async def _result(self, key: str | None, run: LiveRun, result: RunResult, note: str | None) -> CallToolResult:
        """One answer about a run: the page of output since this reader's previous look (the rest
        stays for the next get_run), as text within the text budget, a lean record, and images."""
        follow = (key or "", run.run_id)
        page = take_page(result, self._seen.pop(follow, (0, 0, 0)), self.cfg.max_structured_chars)
        # Kept after the end too: a later look gets only what came since (nothing, once all was given).
        while len(self._seen) >= _MAX_FOLLOWED:  # the least recently looked at go first
            self._seen.pop(next(iter(self._seen)))
        self._seen[follow] = (page.stdout_end, page.stderr_end, page.outputs_end)
        structured = lean_record(result, page, self.cfg.max_structured_chars).model_dump(mode="json")
        budget = self.cfg.max_text_chars
        # Notes (the session's, the images') come first; the run's text gets the rest of the budget.
        image_room = self._room([TextContent(text="x" * budget)], structured)
        images, image_notes = await self._images(page.outputs, image_room)
        extra = "\n\n".join(n for n in [note, *image_notes] if n)
        text = run_text(result, page, max(budget - len(extra) - 2, 200) if extra else budget,
                        self.cfg.max_structured_chars)
        if extra:
            text = clip(f"{extra}\n\n{text}", budget, "answer")
        return CallToolResult(
            content=[TextContent(text=text), *images],
            structured_content=structured,
            is_error=result.status in ("error", "timeout", "kernel_died"),
        )

    async def _follow(self, ctx: Context[Any], run: LiveRun, wait: float) -> RunResult:
        """Wait up to ``wait`` seconds for the run to end, sending its output as progress."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        offset = len(run.collector.events)
        while not run.done:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await run.wait_changed(offset, remaining)
            new = run.collector.events[offset:]
            offset += len(new)
            text = "".join(e["text"] for e in new if e["type"] == "stream")
            if text:
                with contextlib.suppress(Exception):  # a client that asked for no progress, or left
                    await ctx.report_progress(float(offset), None, clip(text, 2000, "progress"))
        if run.failure is not None:
            raise ToolError(run.failure.message)
        return run.result if run.result is not None else run.snapshot()

    def _wait(self, wait_seconds: float | None) -> float:
        return self.cfg.wait_seconds if wait_seconds is None else wait_seconds

    # -- tools -------------------------------------------------------------------------------------
    def _add_tools(self) -> None:
        srv = self.server
        srv.add_tool(self.run_python, name="run_python", annotations=ToolAnnotations(
            title="Run Python", read_only_hint=False, destructive_hint=False, open_world_hint=False))
        srv.add_tool(self.get_run, name="get_run", annotations=ToolAnnotations(
            title="Follow a long run", read_only_hint=True))
        srv.add_tool(self.upload_file, name="upload_file", annotations=ToolAnnotations(
            title="Upload a file", destructive_hint=False))
        srv.add_tool(self.list_files, name="list_files", annotations=ToolAnnotations(
            title="List workspace files", read_only_hint=True))
        srv.add_tool(self.read_artifact, name="read_artifact", annotations=ToolAnnotations(
            title="Read a file or output", read_only_hint=True))
        srv.add_tool(self.list_tools, name="list_tools", annotations=ToolAnnotations(
            title="Host tools callable from code", read_only_hint=True))
        srv.add_tool(self.interrupt, name="interrupt", annotations=ToolAnnotations(
            title="Interrupt the running code", destructive_hint=False))
        srv.add_tool(self.close_session, name="close_session", annotations=ToolAnnotations(
            title="Close a session", destructive_hint=True))
        srv.add_tool(self.list_sessions, name="list_sessions", annotations=ToolAnnotations(
            title="List sessions", read_only_hint=True))
        srv.add_tool(self.export_notebook, name="export_notebook", annotations=ToolAnnotations(
            title="Export the session as a notebook", read_only_hint=True))

    async def run_python(
        self,
        ctx: Context[Any],
        code: Annotated[str, Field(min_length=1, description="Python source. The value of the last "
                                   "expression is returned, like in a notebook cell.")],
        session_id: SessionArg = None,
        timeout_seconds: Annotated[float | None, Field(
            None, gt=0, le=86_400, description="Stop the code after this long (default 60 s). "
            "A timeout interrupts it; if that fails the kernel restarts and variables are lost.")] = None,
        wait_seconds: Annotated[float | None, Field(
            None, ge=0, le=300, description="Return after this long even if the code is still "
            "running (status RUNNING; follow with get_run). Default 20 s.")] = None,
    ) -> Annotated[CallToolResult, McpRunResult]:
        """Run Python code in a stateful, sandboxed Jupyter kernel and return its output.

        Variables, imports and loaded data persist between calls in the same session, so work
        step by step. Files are in /mnt/data (upload_file puts them there; files your code saves
        there are returned with download links). Plots and displayed images come back as images.
        Host tools are callable from the code as tools.NAME(...) (see list_tools). The kernel
        has no network access. A run that outlasts wait_seconds keeps going: the result then has
        status RUNNING and a run_id for get_run.
        """
        key = self._conn_key(ctx)
        sid, note = await self._session(ctx, session_id)
        try:
            self.app.tenants.count_run(self._principal(ctx))
            run = self.app.sessions.submit(sid, code, timeout_seconds)
        except KernelmodeError as e:
            raise ToolError(e.message) from e
        result = await self._follow(ctx, run, self._wait(wait_seconds))
        return await self._result(key, run, result, note)

    async def get_run(
        self,
        ctx: Context[Any],
        run_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="The run_id of a RUNNING result.")],
        wait_seconds: Annotated[float | None, Field(
            None, ge=0, le=300, description="Wait up to this long for the run to end. Default 20 s.")] = None,
    ) -> Annotated[CallToolResult, McpRunResult]:
        """Follow a run that was still RUNNING: returns the output that came since you last looked
        and, once the run has ended, its final result (status, value, error, files)."""
        try:
            run = self.app.sessions.get_run(run_id, self._principal(ctx))
        except NotFound as e:
            raise ToolError(e.message) from e
        key = self._conn_key(ctx)
        # More than a page waits for this reader (paging): answer with the next one at once.
        backlog = take_page(run.snapshot(), self._seen.get((key or "", run_id), (0, 0, 0)),
                            self.cfg.max_structured_chars).more
        result = await self._follow(ctx, run, 0 if backlog else self._wait(wait_seconds))
        return await self._result(key, run, result, None)

    async def upload_file(
        self,
        ctx: Context[Any],
        filename: Annotated[str, Field(min_length=1, max_length=1024, description="Path inside "
                                       "/mnt/data, e.g. 'sales.csv' or 'raw/2024.json'.")],
        content_base64: Annotated[str, Field(description="The file's bytes, base64-encoded.")],
        session_id: SessionArg = None,
        overwrite: Annotated[bool, Field(description="Replace an existing file.")] = False,
    ) -> str:
        """Put a file into the session's workspace (/mnt/data) so that code can read it."""
        try:
            data = base64.b64decode(content_base64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ToolError(f"content_base64 is not valid base64: {e}") from e
        cap = self.app.settings.artifacts.max_upload_bytes
        if len(data) > cap:
            raise ToolError(f"the file is {size_text(len(data))}, over this server's upload limit of "
                            f"{size_text(cap)}")
        sid, note = await self._session(ctx, session_id)
        try:
            up = await self.app.sessions.upload(sid, filename, io.BytesIO(data), len(data), overwrite)
        except KernelmodeError as e:
            raise ToolError(e.message) from e
        return "\n\n".join(x for x in [note, (
            f"Saved {up.path} ({size_text(up.size_bytes)}) in session {sid}. Read it from code, "
            f"e.g. open({up.path!r}) or pandas.read_csv({up.path!r}).")] if x)

    async def list_files(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """List the files in the session's workspace (/mnt/data): name, size, type."""
        sid, note = await self._session(ctx, session_id)
        listing = await self.app.sessions.list_files(sid)
        lines = [f"- {f.path} ({f.mime_type}, {size_text(f.size_bytes)})" for f in listing.files]
        body = "\n".join(lines) if lines else "(no files)"
        more = f"(not complete: the walk {listing.note})" if listing.note else None
        return "\n\n".join(x for x in [note, f"Files of session {sid} in /mnt/data:\n{body}", more] if x)

    async def read_artifact(
        self,
        ctx: Context[Any],
        path_or_artifact: Annotated[str, Field(min_length=1, max_length=2048, description=
                                               "A workspace path ('/mnt/data/chart.png' or "
                                               "'chart.png') or an output's path from a result "
                                               "('outputs/output-1.png').")],
        session_id: SessionArg = None,
    ) -> CallToolResult:
        """Look at a file: images come back as images you can see, text files as text (cut to a
        budget), other files as a download link with their size and type."""
        sid, note = await self._session(ctx, session_id)
        data, mime, name, size, link = await self._fetch(sid, path_or_artifact)
        head = f"{name} ({mime}, {size_text(size)})" + (f"\ndownload: {link}" if link else "")
        blocks: list[ContentBlock] = []
        if mime in INLINE_TYPES:
            try:
                share = min(self.cfg.max_image_bytes, self._room([TextContent(text=head)], {}) * 3 // 4 - 1_024)
                small, kind = await asyncio.to_thread(fit_image, data, mime, share)
                blocks = [TextContent(text=head), ImageContent(data=base64.b64encode(small).decode(), mime_type=kind)]
            except ImageTooLarge as e:
                blocks = [TextContent(text=f"{head}\nThe image cannot be shown inline: {e}")]
        elif mime.startswith("text/") or mime in _TEXT_TYPES:
            text = data.decode("utf-8", errors="replace")
            if size > len(data):
                text += f"\n[... only the first {len(data)} of {size} bytes were read ...]"
            blocks = [TextContent(text=f"{head}\n\n{clip(text, self.cfg.max_text_chars, 'file')}")]
        else:
            blocks = [TextContent(text=f"{head}\nThis is a binary file: read it from code, or download it.")]
            if link:
                blocks.append(ResourceLink(uri=link, name=name, mime_type=mime, size=size))
        if note:
            blocks.insert(0, TextContent(text=note))
        return CallToolResult(content=blocks)

    async def _fetch(self, sid: str, ref: str) -> tuple[bytes, str, str, int, str | None]:
        """(bytes, mime, name, size, download link) of a workspace file or a stored artifact."""
        rel = ref.removeprefix("/mnt/data/").lstrip("/")
        found = None
        with contextlib.suppress(KernelmodeError, StoreError):
            found = await self.app.sessions.find_artifact(sid, ref)
        link = found[1].download_url if found else None
        try:
            fd, size, mime = await asyncio.to_thread(self.app.sessions.open_file, sid, str(clean_path(rel)))
        except KernelmodeError:
            fd = -1
        if fd >= 0:  # a file in the live workspace
            with os.fdopen(fd, "rb") as f:
                whole = mime in INLINE_TYPES
                if whole and size > 64 * 1024 * 1024:
                    raise ToolError(f"{rel} is {size_text(size)}, too large to show; download it instead")
                cap = size if whole else max(self.cfg.max_text_chars * 4, 64 * 1024)
                data = await asyncio.to_thread(f.read, cap)
            return data, mime, rel.rsplit("/", 1)[-1], size, link
        if found is None:
            raise ToolError(f"no file or output {ref!r} in session {sid}: see list_files, or the "
                            "files listed in a run's result")
        run_id, artifact = found
        try:
            data = await self.app.sessions.artifact_bytes(sid, run_id, artifact)
        except StoreError as e:
            raise ToolError(f"could not read {ref!r} from the artifact store: {e}") from e
        return data, artifact.mime_type, artifact.name, artifact.size_bytes, link

    async def list_tools(self) -> str:
        """List the host tools that code can call as tools.NAME(...) inside the kernel, with their
        signatures and descriptions."""
        infos = self.app.tools.infos()
        if not infos:
            return "No host tools are configured on this server."
        lines = [f"tools.{t.signature or t.name + '(...)'}\n    {t.description}".rstrip() for t in infos]
        return ("Call these from run_python code, e.g. `r = tools.NAME(arg=...)`; a failure raises "
                "tools.ToolError.\n\n" + "\n".join(lines))

    async def interrupt(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """Interrupt the code running in the session (like Ctrl-C). Variables are kept."""
        sid, _ = await self._session(ctx, session_id)
        try:
            await self.app.sessions.interrupt(sid)
        except KernelmodeError as e:
            raise ToolError(e.message) from e
        return f"Interrupt sent to session {sid}; the running code stops with KeyboardInterrupt."

    async def close_session(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """Close a session: its kernel stops and its variables and workspace files are gone
        (files saved by runs stay downloadable). The next call without session_id starts fresh."""
        key = self._conn_key(ctx)
        sid = session_id or (self._own.get(key) if key else None)
        if sid is None:
            return "This connection has no session open."
        try:
            self.app.sessions.authorize(self._principal(ctx), sid)
            await self.app.sessions.delete(sid)
        except SessionNotFound as e:
            raise ToolError(f"unknown session {sid!r}") from e
        if key is not None and self._own.get(key) == sid:
            del self._own[key]
        return f"Session {sid} is closed."

    async def export_notebook(self, ctx: Context[Any], session_id: SessionArg = None) -> CallToolResult:
        """Save the session's runs so far as a Jupyter notebook (.ipynb: each run a cell with its
        outputs) and return its download link, e.g. to hand the analysis to a person."""
        sid, note = await self._session(ctx, session_id)
        try:
            artifact = await self.app.sessions.export_notebook(sid)
        except KernelmodeError as e:
            raise ToolError(e.message) from e
        text = (f"Notebook of session {sid}: {artifact.name} ({size_text(artifact.size_bytes)})\n"
                f"download: {artifact.download_url}")
        return CallToolResult(content=[
            *([TextContent(text=note)] if note else []), TextContent(text=text),
            ResourceLink(uri=artifact.download_url, name=artifact.name, mime_type=artifact.mime_type,
                         size=artifact.size_bytes)])

    async def list_sessions(self, ctx: Context[Any]) -> str:
        """List the sessions on this server: id, status, runs so far, idle expiry."""
        key = self._conn_key(ctx)
        own = self._own.get(key) if key else None
        rows = []
        for s in self.app.sessions.all(self._principal(ctx)):
            mark = "  <- this connection's session" if s.session_id == own else ""
            rows.append(f"- {s.session_id}: {s.status}, {s.execution_count} runs, "
                        f"last active {s.last_activity:%Y-%m-%d %H:%M:%S} UTC{mark}")
        return "\n".join(rows) if rows else "No sessions."

