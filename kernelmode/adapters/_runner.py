"""SessionRunner: "run this code in my session and give me text for a model", framework-free.

The adapters (``langchain.py``, ``crewai.py``) wrap one of these in their framework's tool class.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from ..client import AsyncClient, AsyncSession, Client, Session
from ..errors import SessionNotFound
from ..mcp.render import run_text, whole_page
from ..models import RunResult

DEFAULT_BUDGET = 20_000  # characters per text part (stdout, stderr, result...), as the MCP server

DEFAULT_DESCRIPTION = (
    "Run Python code in a stateful, sandboxed Jupyter kernel and return its output. Variables, "
    "imports and loaded data persist between calls, so work step by step instead of repeating "
    "work. The value of the last expression is returned, like in a notebook cell; use print() for "
    "anything else you want to see. Files live in /mnt/data; files your code saves there are "
    "listed with download links. The kernel has no network access, but host tools are callable "
    "from the code as tools.NAME(...): call tools.help() to list them. An exception in the code "
    "comes back as an ERROR status with its traceback; the session and its variables survive it."
)

_NEW_SESSION_NOTE = ("NOTE: the previous session was gone (expired or deleted), so this ran in a "
                     "NEW session: variables, imports and files from earlier calls are lost.")

Target = Client | Session | AsyncClient | AsyncSession


class SessionRunner:
    """Runs code in one kernelmode session and renders each result with ``run_text``.

    ``target`` is a ``Client`` or ``AsyncClient`` (the runner creates its own session on first
    use, with ``session_options`` as ``create_session`` arguments, and ``close()`` deletes it; if
    that session expires or is deleted, the next call starts a new one and says so), or an
    existing ``Session`` / ``AsyncSession`` (used as it is and never deleted: it is the caller's).

    A sync target serves ``run`` and ``arun`` (in a worker thread); an async target serves only
    ``arun`` / ``aclose``, since its httpx client belongs to one event loop.
    """

    def __init__(self, target: Target, *, session_options: Mapping[str, Any] | None = None,
                 timeout_seconds: float | None = None, budget: int = DEFAULT_BUDGET) -> None:
        if not isinstance(target, (Client, Session, AsyncClient, AsyncSession)):
            raise TypeError("expected a kernelmode Client, AsyncClient, Session or AsyncSession, "
                            f"not {type(target).__name__}")
        if isinstance(target, (Session, AsyncSession)) and session_options:
            raise ValueError("session options apply only to a session the adapter creates: "
                             "pass a Client, or create the Session with them yourself")
        self.target = target
        self.session_options = dict(session_options or {})
        self.timeout_seconds = timeout_seconds
        self.budget = budget
        self.owns_session = isinstance(target, (Client, AsyncClient))
        self._session: Session | AsyncSession | None = (
            target if isinstance(target, (Session, AsyncSession)) else None)
        self._lock = threading.Lock()
        self._alock: asyncio.Lock | None = None

    @property
    def is_async(self) -> bool:
        return isinstance(self.target, (AsyncClient, AsyncSession))

    @property
    def session_id(self) -> str | None:
        """The session in use: None before the first call (when the runner creates it)."""
        return self._session.id if self._session is not None else None

    def render(self, result: RunResult, note: str | None = None) -> str:
        text = run_text(result, whole_page(result), self.budget, self.budget)
        return f"{note}\n\n{text}" if note else text

    # -- sync --------------------------------------------------------------------------------------
    def _sync_session(self) -> Session:
        with self._lock:
            if self._session is None:
                assert isinstance(self.target, Client)
                self._session = self.target.create_session(**self.session_options)
            assert isinstance(self._session, Session)
            return self._session

    def _sync_only(self) -> None:
        if self.is_async:
            raise TypeError("this tool was made from an AsyncClient/AsyncSession: call it "
                            "asynchronously (ainvoke / arun / aclose), or make it from a Client")

    def run(self, code: str) -> str:
        """Run ``code``; the result (an error in the code included) as text for a model.
        Service failures (unreachable server, too many sessions...) raise KernelmodeError."""
        self._sync_only()
        session = self._sync_session()
        note = None
        try:
            result = session.run(code, timeout_seconds=self.timeout_seconds)
        except SessionNotFound:
            if not self.owns_session:
                raise
            with self._lock:
                if self._session is session:
                    self._session = None
            note = _NEW_SESSION_NOTE
            result = self._sync_session().run(code, timeout_seconds=self.timeout_seconds)
        return self.render(result, note)

    def close(self) -> None:
        """Delete the session this runner created (a later call starts a new one); a session
        that was handed in is left alone."""
        self._sync_only()
        with self._lock:
            session, owned = self._session, self.owns_session
            if owned:
                self._session = None
        if owned and isinstance(session, Session):
            session.close()

    # -- async -------------------------------------------------------------------------------------
    async def _async_session(self) -> AsyncSession:
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            if self._session is None:
                assert isinstance(self.target, AsyncClient)
                self._session = await self.target.create_session(**self.session_options)
            assert isinstance(self._session, AsyncSession)
            return self._session

    async def arun(self, code: str) -> str:
        """``run`` for async callers: native with an async target, else in a worker thread."""
        if not self.is_async:
            return await asyncio.to_thread(self.run, code)
        session = await self._async_session()
        note = None
        try:
            result = await session.run(code, timeout_seconds=self.timeout_seconds)
        except SessionNotFound:
            if not self.owns_session:
                raise
            if self._session is session:
                self._session = None
            note = _NEW_SESSION_NOTE
            result = await (await self._async_session()).run(code, timeout_seconds=self.timeout_seconds)
        return self.render(result, note)

    async def aclose(self) -> None:
        if not self.is_async:
            await asyncio.to_thread(self.close)
            return
        session, owned = self._session, self.owns_session
        if owned:
            self._session = None
        if owned and isinstance(session, AsyncSession):
            await session.close()
