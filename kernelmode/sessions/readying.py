"""Readying a session's kernel under its lock (a woken or dead session's kernel started, its
preamble installed, its latest checkpoint restored), cut short by a restart.

A restart asked for meanwhile (REST, the Jupyter API) must not wait for a kernel start or a
restore it is about to undo: it cancels the readying, and the holder of the lock (a run, a
console's resume) restarts the kernel in its place (``Kernel.reset``), still under the lock, so
runs queued behind find the fresh kernel; a run ends ``interrupted``, saying why. The restart
answers once that is done (``cut`` gives what to wait for).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import RestartCut

if TYPE_CHECKING:
    from .kernels import Kernel
    from .live import LiveSession

T = TypeVar("T")


class Readying:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # session id -> its readying under way
        self._cut: dict[str, asyncio.Event] = {}  # session id -> set when the restart is done

    async def run(self, session_id: str, step: Awaitable[T]) -> T:
        """Await ``step`` (the readying, under the session's lock); RestartCut if a restart cut it."""
        task: asyncio.Task[T] = asyncio.ensure_future(step)
        self._tasks[session_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            # Cut (the step was cancelled by ``cut``), unless the holder is being cancelled too
            # (Task.cancelling: Python 3.11+; before, a cut wins that rare tie).
            cancelling = getattr(asyncio.current_task(), "cancelling", lambda: 0)
            if session_id in self._cut and task.cancelled() and not cancelling():
                raise RestartCut("a restart cut the kernel's readying short") from None
            self.done(session_id)  # the holder itself is cancelled (a stop): no restart waits on it
            raise
        finally:
            self._tasks.pop(session_id, None)

    def cut(self, session_id: str) -> asyncio.Event | None:
        """Cancel the session's readying, if one is under way: the event is set once its holder
        has restarted the kernel (``done``). None: nothing was readying."""
        task = self._tasks.get(session_id)
        if task is None or task.done():
            return self._cut.get(session_id)  # another restart already cut it: wait for the same
        event = self._cut.setdefault(session_id, asyncio.Event())
        task.cancel()
        return event

    def done(self, session_id: str) -> None:
        """The holder restarted the kernel after a cut (or failed to): the restart answers."""
        event = self._cut.pop(session_id, None)
        if event is not None:
            event.set()


async def restart_in_place(k: Kernel) -> None:
    """The restart a cut readying's holder does: a fresh, empty kernel (the checkpoint is not
    restored: a restart asked for means an empty session). A kernel still being started (woken,
    or replaced) is replaced by a new one; the half-started one is DELETEd in the background."""
    k.restore_pending = False
    if k.needs_new:
        await k.replace()
    else:
        await k.restart(tell_next_run=False)
    k.restore_pending = False


async def restart_asked(s: LiveSession, readying: Readying) -> None:
    """A restart asked for (REST, the Jupyter API): a run or a console readying the kernel
    restarts it in its place; a kernel with no process (woken, given up) is replaced under the
    session's lock; else the kernel is restarted at once (a running call ends ``interrupted``)."""
    cut = readying.cut(s.info.session_id)
    if cut is not None:
        await cut.wait()
    elif s.kernel.needs_new:
        async with s.lock:
            if s.kernel.needs_new:
                await s.kernel.replace()
            else:  # revived while we waited (a files request): what it restored goes too
                await s.kernel.restart()
            s.kernel.restore_pending = False  # a restart asked for: the session starts empty
    else:
        await s.kernel.restart()
