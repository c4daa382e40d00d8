"""The MCP tools: what each does and says, on the running service's ``Services``.

Errors come out in one way, at one point (``tool_errors``, wrapped around every tool): a
``KernelmodeError`` from anywhere below becomes an ``isError`` result whose text is the SDK's own
(``Error executing tool NAME: message``) and whose structured content is the error as REST
gives it (``{"error": {"code", "message"}}``), so a program need not parse the text. The one
error met before any tool runs (the service could not start) is an ``isError`` too, saying what
to do, with the same structured content (``app.start_failed``, from ``protocol_error``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import inspect
import io
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.tools.base import Tool
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    CallToolResult,
    ContentBlock,
    ImageContent,
    ResourceLink,
    TextContent,
    ToolAnnotations,
)
from pydantic import Field

from ..artifacts.workspace import clean_path
from ..config import Settings
from ..errors import (
    FileNotFound,
    ImageTooLarge,
    InvalidRequest,
    KernelmodeError,
    PayloadTooLarge,
    RunNotFound,
    SessionNotFound,
    StoreError,
)
from ..models import SESSION_ID_PATTERN, SessionCreate
from ..services import Services
from ..tools.registry import ToolRegistry
from ..tools.search import MAX_LIMIT, MAX_QUERY_CHARS
from . import remote
from .answers import RunAnswers
from .budget import McpRunResult
from .connections import Connections
from .elicit import asker
from .images import INLINE_TYPES, fit_image
from .instructions import LIST_AT_MOST, call_form
from .remote_sessions import OwnerSessions
from .render import clip, size_text

if TYPE_CHECKING:
    from ..sessions import SessionManager

log = logging.getLogger("kernelmode.mcp")

P = ParamSpec("P")
T = TypeVar("T")
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript", "application/x-yaml",
               "image/svg+xml", "application/x-ipynb+json", "application/sql")

# list_sessions: a row is ~150 characters at most, so a page stays under the text budget (8,000).
_SESSION_ROWS, _MAX_SESSION_ROWS = 40, 50

SessionArg = Annotated[str | None, Field(
    None, pattern=SESSION_ID_PATTERN,
    description="A session to use instead of this connection's own (from list_sessions or an "
    "earlier result). Omit it: each connection gets its own session, created on first use.")]


def error_result(tool: str, error: KernelmodeError) -> CallToolResult:
    """A KernelmodeError as an MCP tool result: the text the SDK gives a ToolError, and the
    code and message as REST gives them."""
    return CallToolResult(content=[TextContent(text=f"Error executing tool {tool}: {error.message}")],
                          structured_content={"error": error.to_dict()}, is_error=True)


def protocol_error(error: KernelmodeError, doing: str) -> MCPError:
    """A KernelmodeError met before any tool ran (the service could not start) as a JSON-RPC
    error: saying what failed, with the error as REST gives it in ``data``."""
    return MCPError(INTERNAL_ERROR, f"{doing}: {error.message}", data={"error": error.to_dict()})


def tool_errors(tool: str, fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T | CallToolResult]]:
    """``fn``, with any KernelmodeError it raises answered as ``error_result`` (the one point
    where MCP translates errors). The signature is ``fn``'s, for the SDK's schema."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T | CallToolResult:
        try:
            return await fn(*args, **kwargs)
        except KernelmodeError as e:
            log.log(logging.WARNING if e.http_status >= 500 else logging.INFO,
                    "tool %s: %s (%s)", tool, e.message, e.code)
            return error_result(tool, e)

    return call


class McpTools:
    """The tools. ``tools`` (host tools) and ``settings`` are there from the start; the rest of
    ``services`` once the service runs (a tool call that needs it waits for that: server.py)."""

    def __init__(self, settings: Settings, tools: ToolRegistry, services: Callable[[], Services]) -> None:
        self.settings = settings
        self.cfg = settings.mcp
        self.host_tools = tools
        self._services = services
        self.connections = Connections(services)
        self.answers = RunAnswers(self.cfg)

    def build(self) -> list[Tool]:
        """Every tool, each behind ``tool_errors``, as the SDK registers them (``MCPServer(tools=)``)."""
        tools: list[tuple[Callable[..., Awaitable[Any]], ToolAnnotations]] = [
            (self.run_python, ToolAnnotations(title="Run Python", read_only_hint=False,
                                              destructive_hint=False, open_world_hint=False)),
            (self.get_run, ToolAnnotations(title="Follow a long run", read_only_hint=True)),
            (self.upload_file, ToolAnnotations(title="Upload a file", destructive_hint=False)),
            (self.list_files, ToolAnnotations(title="List workspace files", read_only_hint=True)),
            (self.read_artifact, ToolAnnotations(title="Read a file or output", read_only_hint=True)),
            (self.list_tools, ToolAnnotations(title="Host tools callable from code", read_only_hint=True)),
            (self.search_tools, ToolAnnotations(title="Find host tools for an intent", read_only_hint=True)),
            (self.interrupt, ToolAnnotations(title="Interrupt the running code", destructive_hint=False)),
            (self.close_session, ToolAnnotations(title="Close a session", destructive_hint=True)),
            (self.list_sessions, ToolAnnotations(title="List sessions", read_only_hint=True)),
            (self.export_notebook, ToolAnnotations(title="Export the session as a notebook",
                                                   read_only_hint=True)),
            (self.install_packages, ToolAnnotations(title="Install Python packages", destructive_hint=False,
                                                    idempotent_hint=True, open_world_hint=True)),
            (self.checkpoint, ToolAnnotations(title="Checkpoint the session", destructive_hint=False)),
            (self.fork_session, ToolAnnotations(title="Fork a session", destructive_hint=False)),
        ]
        # Docstrings as descriptions, dedented (the SDK sends __doc__ as it is: indented on 3.11).
        return [Tool.from_function(tool_errors(fn.__name__, fn), name=fn.__name__, annotations=hints,
                                   description=inspect.cleandoc(fn.__doc__ or ""))
                for fn, hints in tools]

    def _on(self, ctx: Context[Any], sid: str) -> SessionManager | OwnerSessions:
        """The session's methods: here, or on the manager that owns it (remote.py)."""
        svc = self._services()
        owner = remote.owner_of(svc.router, ctx.headers, sid)
        return svc.sessions if owner is None else OwnerSessions(owner)

    def _wait(self, wait_seconds: float | None) -> float:
        return self.cfg.wait_seconds if wait_seconds is None else wait_seconds

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
        status RUNNING and a run_id for get_run. A tool that needs a person's approval pauses the
        code until they answer (a denied call raises ToolDenied).
        """
        svc = self._services()
        key = self.connections.key(ctx)
        sid, note = await self.connections.session(ctx, session_id)
        if (owner := remote.owner_of(svc.router, ctx.headers, sid)) is not None:  # it counts the run
            return await remote.run_python(ctx, owner, self.answers, key, sid, code, timeout_seconds,
                                           self._wait(wait_seconds), note)
        svc.tenants.count_run(self.connections.principal(ctx))
        run = svc.sessions.submit(sid, code, timeout_seconds)
        result = await self.answers.follow(ctx, run, self._wait(wait_seconds), asker(ctx, sid))
        return await self.answers.result(key, result, note)

    async def get_run(
        self,
        ctx: Context[Any],
        run_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="The run_id of a RUNNING result.")],
        wait_seconds: Annotated[float | None, Field(
            None, ge=0, le=300, description="Wait up to this long for the run to end. Default 20 s.")] = None,
    ) -> Annotated[CallToolResult, McpRunResult]:
        """Follow a run that was still RUNNING: returns the output that came since you last looked
        and, once the run has ended, its final result (status, value, error, files)."""
        svc, key = self._services(), self.connections.key(ctx)
        # In flight on another manager (the store's record of it here is not the run)? Asked
        # first: once it is not, the store's record is final when read next.
        owner = remote.run_owner(svc.router, ctx.headers, run_id, False)
        try:
            run = None if owner is not None else svc.sessions.get_run(run_id, self.connections.principal(ctx))
        except RunNotFound:  # queued on another manager, not yet written?
            if (owner := remote.run_owner(svc.router, ctx.headers, run_id, True)) is None:
                raise
        if owner is not None:
            return await remote.get_run(ctx, owner, self.answers, key, run_id, self._wait(wait_seconds))
        assert run is not None
        # More than a page waits for this reader (paging): answer with the next one at once.
        wait = 0 if self.answers.backlog(key, run.snapshot()) else self._wait(wait_seconds)
        result = await self.answers.follow(ctx, run, wait, asker(ctx, run.session_id))
        return await self.answers.result(key, result, None)

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
            raise InvalidRequest(f"content_base64 is not valid base64: {e}") from e
        cap = self.settings.artifacts.max_upload_bytes
        if len(data) > cap:
            raise PayloadTooLarge(f"the file is {size_text(len(data))}, over this server's upload "
                                  f"limit of {size_text(cap)}")
        sid, note = await self.connections.session(ctx, session_id)
        up = await self._on(ctx, sid).upload(sid, filename, io.BytesIO(data), len(data), overwrite)
        return "\n\n".join(x for x in [note, (
            f"Saved {up.path} ({size_text(up.size_bytes)}) in session {sid}. Read it from code, "
            f"e.g. open({up.path!r}) or pandas.read_csv({up.path!r}).")] if x)

    async def list_files(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """List the files in the session's workspace (/mnt/data): name, size, type."""
        sid, note = await self.connections.session(ctx, session_id)
        listing = await self._on(ctx, sid).list_files(sid)
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
        sid, note = await self.connections.session(ctx, session_id)
        data, mime, name, size, link = await self._fetch(sid, path_or_artifact, self._on(ctx, sid))
        head = f"{name} ({mime}, {size_text(size)})" + (f"\ndownload: {link}" if link else "")
        blocks: list[ContentBlock] = []
        if mime in INLINE_TYPES:
            try:
                share = min(self.cfg.max_image_bytes,
                            self.answers.room([TextContent(text=head)], {}) * 3 // 4 - 1_024)
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

    async def _fetch(self, sid: str, ref: str, on: SessionManager | OwnerSessions
                     ) -> tuple[bytes, str, str, int, str | None]:
        """(bytes, mime, name, size, download link) of a workspace file (read where the session
        lives: ``on``) or a stored artifact."""
        sessions = self._services().sessions
        rel = ref.removeprefix("/mnt/data/").lstrip("/")
        found = None
        with contextlib.suppress(KernelmodeError):  # not an artifact (or the store is down)
            found = await sessions.find_artifact(sid, ref)
        link = found[1].download_url if found else None
        try:
            download, mime = await on.open_file(sid, str(clean_path(rel)))
        except KernelmodeError:
            download = None
        if download is not None:  # a file in the live workspace (read through the kernel's channels)
            size = download.size
            whole = mime in INLINE_TYPES
            cap = size if whole else max(self.cfg.max_text_chars * 4, 64 * 1024)
            parts: list[bytes] = []
            got = 0
            chunks = download.chunks()
            try:
                if whole and size > 64 * 1024 * 1024:
                    raise PayloadTooLarge(f"{rel} is {size_text(size)}, too large to show; download it instead")
                async for chunk in chunks:
                    parts.append(chunk[:cap - got])
                    got += len(parts[-1])
                    if got >= cap:
                        break
            finally:
                await chunks.aclose()
            return b"".join(parts), mime, rel.rsplit("/", 1)[-1], size, link
        if found is None:
            raise FileNotFound(f"no file or output {ref!r} in session {sid}: see list_files, or the "
                               "files listed in a run's result")
        run_id, artifact = found
        try:
            data = await sessions.artifact_bytes(sid, run_id, artifact)
        except StoreError as e:
            raise StoreError(f"could not read {ref!r} from the artifact store: {e.message}") from e
        return data, artifact.mime_type, artifact.name, artifact.size_bytes, link

    async def list_tools(self) -> str:
        """List the host tools that code can call as tools.NAME(...) inside the kernel, with their
        signatures and descriptions."""
        infos = self.host_tools.infos()
        if not infos:
            return "No host tools are configured on this server."
        lines = [f"tools.{t.signature or t.name + '(...)'}\n    {t.description}".rstrip() for t in infos]
        hint = (f" There are {len(infos)}: search_tools('what you want to do') finds the few you need."
                if len(infos) > LIST_AT_MOST else "")
        return ("Call these from run_python code, e.g. `r = tools.NAME(arg=...)`; a failure raises "
                f"tools.ToolError.{hint}\n\n" + "\n".join(lines))

    async def search_tools(
        self,
        query: Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS, description=
                                    "What you want to do, in words, e.g. 'list the commits of a "
                                    "repository' or 'post a message to a channel'.")],
        limit: Annotated[int, Field(ge=1, le=MAX_LIMIT, description="How many tools at most.")] = 8,
    ) -> str:
        """Find the host tools that fit what you want to do (best first), with the Python call
        to make from run_python code. Use it instead of list_tools when there are many tools."""
        matches = self.host_tools.search(query, limit)
        if not matches:
            return (f"No host tool matches {query!r}: try other words, or list_tools." if self.host_tools.infos()
                    else "No host tools are configured on this server.")
        lines = [f"{call_form(m.name, m.signature)}\n    {m.description}".rstrip() for m in matches]
        return ("Host tools for this intent, best first; call them from run_python code, e.g. "
                "`r = tools.NAME(arg=...)` (help(tools.NAME) shows the parameters):\n\n" + "\n".join(lines))

    async def interrupt(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """Interrupt the code running in the session (like Ctrl-C). Variables are kept."""
        sid, _ = await self.connections.session(ctx, session_id)
        await self._on(ctx, sid).interrupt(sid)
        return f"Interrupt sent to session {sid}; the running code stops with KeyboardInterrupt."

    async def close_session(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """Close a session: its kernel stops and its variables and workspace files are gone
        (files saved by runs stay downloadable). The next call without session_id starts fresh."""
        sessions = self._services().sessions
        sid = session_id or self.connections.own_session(ctx)
        if sid is None:
            return "This connection has no session open."
        try:
            sessions.authorize(self.connections.principal(ctx), sid)
            await self._on(ctx, sid).delete(sid)
        except SessionNotFound as e:
            raise SessionNotFound(f"unknown session {sid!r}") from e
        self.connections.closed(ctx, sid)
        return f"Session {sid} is closed."

    async def export_notebook(self, ctx: Context[Any], session_id: SessionArg = None) -> CallToolResult:
        """Save the session's runs so far as a Jupyter notebook (.ipynb: each run a cell with its
        outputs) and return its download link, e.g. to hand the analysis to a person."""
        sid, note = await self.connections.session(ctx, session_id)
        artifact = await self._services().sessions.export_notebook(sid)
        text = (f"Notebook of session {sid}: {artifact.name} ({size_text(artifact.size_bytes)})\n"
                f"download: {artifact.download_url}")
        return CallToolResult(content=[
            *([TextContent(text=note)] if note else []), TextContent(text=text),
            ResourceLink(uri=artifact.download_url, name=artifact.name, mime_type=artifact.mime_type,
                         size=artifact.size_bytes)])

    async def list_sessions(
        self, ctx: Context[Any],
        limit: Annotated[int, Field(ge=1, le=_MAX_SESSION_ROWS, description=(
            "Sessions per answer at most, newest first."))] = _SESSION_ROWS,
        cursor: Annotated[str | None, Field(min_length=1, max_length=512, description=(
            "Where to go on: the cursor a previous list_sessions answer named. Omit for the first page."))] = None,
    ) -> str:
        """List the sessions on this server, newest first: id, status, runs so far, last activity.
        This connection's own session is marked (and named first when older than the first page).
        A long list comes a page at a time: the answer names the cursor of the next page."""
        own = self.connections.own_session(ctx)
        sessions = self._services().sessions
        listing = sessions.page(self.connections.principal(ctx), limit, cursor, newest_first=True)
        rows = []
        if cursor is None and own is not None and own not in {s.session_id for s in listing.sessions}:
            with contextlib.suppress(SessionNotFound):  # closed meanwhile
                rows.append(f"This connection's session (older than this page): {own}, {sessions.status(own)}")
        for s in listing.sessions:
            mark = "  <- this connection's session" if s.session_id == own else ""
            rows.append(f"- {s.session_id}: {s.status}, {s.execution_count} runs, "
                        f"last active {s.last_activity:%Y-%m-%d %H:%M:%S} UTC{mark}")
        text = "\n".join(rows) if rows else ("No sessions." if cursor is None else "No more sessions.")
        if listing.next_cursor is not None:
            text += f"\nMore sessions remain: call list_sessions(cursor={listing.next_cursor!r})."
        return text

    async def install_packages(
        self, ctx: Context[Any],
        packages: Annotated[list[str], Field(min_length=1, max_length=100, description=(
            "Requirements as pip takes them: 'tabulate', 'rich==13.7.1', 'pydantic>=2,<3'."))],
        session_id: SessionArg = None,
    ) -> CallToolResult:
        """Install Python packages into the session, then `import` them in run_python. The kernel
        has no network: the server downloads wheels (never builds) from its package index, within
        its allow/deny policy, and they stay installed for the session's life. Packages the kernel
        already has are reported as already installed; another version of one of them is refused."""
        sid, note = await self.connections.session(ctx, session_id)
        result = await self._on(ctx, sid).install_packages(sid, packages, "mcp")
        names = lambda refs: ", ".join(f"{p.name} {p.version}" for p in refs) or "none"  # noqa: E731
        text = (f"Session {sid}: installed {names(result.installed)}; already there: {names(result.already)} "
                f"({result.duration_ms:.0f} ms). Import them in run_python.")
        return CallToolResult(content=[*([TextContent(text=note)] if note else []), TextContent(text=clip(text, 4000, "the package list"))],
                              structured_content={"session_id": sid, **result.model_dump(mode="json")})
    async def checkpoint(self, ctx: Context[Any], session_id: SessionArg = None) -> str:
        """Save the session's variables and files now. If the kernel later dies (out of memory, a
        crash), the next run_python starts from this checkpoint; fork_session can copy it."""
        sid, note = await self.connections.session(ctx, session_id)
        info = await self._on(ctx, sid).checkpoint(sid)
        skipped = "; ".join(f"{x.name} ({x.reason})" for x in info.skipped[:20])
        more = f" and {len(info.skipped) - 20} more" if len(info.skipped) > 20 else ""
        lines = [f"Checkpoint {info.checkpoint_id} of session {sid}: {len(info.saved)} variables saved "
                 f"({size_text(info.bytes)}, {info.workspace_files} files, {info.duration_ms / 1000:.1f} s).",
                 f"saved: {clip(', '.join(info.saved), 2000, 'names') or '(none)'}"]
        if skipped:
            lines.append(f"NOT saved (re-create them after a restore): {skipped}{more}")
        if info.packages:
            pins = ", ".join(f"{p.name}=={p.version}" for p in info.packages)
            lines.append(f"packages (a fork gets them too): {clip(pins, 1000, 'packages')}")
        return "\n".join(x for x in [note, *lines] if x)

    async def fork_session(
        self,
        ctx: Context[Any],
        session_id: SessionArg = None,
        checkpoint_id: Annotated[str | None, Field(
            None, pattern=r"^[0-9a-f]{32}$", description="Start from this checkpoint instead of the "
            "session's current state.")] = None,
    ) -> str:
        """Start a new session with a copy of a session's variables and files (or of a checkpoint),
        e.g. to try two approaches and keep one. The two sessions are independent afterwards;
        pass the new session_id to run_python to work in the fork."""
        principal = self.connections.principal(ctx)
        if checkpoint_id is None:
            source, _ = await self.connections.session(ctx, session_id)
            req, on = SessionCreate(fork_of=source), self._on(ctx, source)  # its live kernel is copied
        else:
            req, on = SessionCreate(from_checkpoint=checkpoint_id), self._services().sessions
        info = await on.create(req, principal)
        origin = f"checkpoint {checkpoint_id}" if checkpoint_id else f"session {req.fork_of}"
        return (f"New session {info.session_id}, a copy of {origin}. Pass session_id={info.session_id!r} "
                "to run_python to work in it; the original is unchanged.")
