"""`kernelmode console SESSION_ID`: a real jupyter console on a live session's kernel.

The variables the agent made are there, what the person runs is seen by the agent's next call,
Ctrl-C interrupts (through kernelmode's interrupt), and leaving leaves the kernel running.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..client import Client, ServerUnreachable
from ..errors import BridgeError, KernelmodeError, SessionNotFound, Unauthorized
from ..models import SessionInfo
from .bridge import ChannelBridge


class _BridgeThread:
    """The bridge's own event loop in a thread: the console owns the main thread and SIGINT."""

    def __init__(self, bridge: ChannelBridge) -> None:
        self.bridge = bridge
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kernelmode-bridge", daemon=True)

    def start(self) -> Path:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.bridge.start(), self.loop).result(60)

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.bridge.stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def check_session(client: Client, session_id: str) -> SessionInfo | str:
    """The session, or what is wrong, said plainly."""
    try:
        info = client.get_session(session_id)
    except Unauthorized:
        return f"the server at {client.url} refused the token (check --token / $KERNELMODE_TOKEN)"
    except SessionNotFound:
        return f"there is no session {session_id!r} on {client.url} (see `kernelmode sessions`)"
    except ServerUnreachable as e:
        return e.message
    except KernelmodeError as e:
        return e.message
    if info.status == "lost":
        return f"session {session_id!r} is lost: its kernel ended with a previous server run"
    return info


def run_console(url: str | None, token: str | None, session_id: str, console_args: list[str],
                connection_file_only: bool = False, transport: str = "ipc") -> int:
    with Client(url, token) as client:
        found = check_session(client, session_id)
        if isinstance(found, str):
            print(f"kernelmode console: {found}", file=sys.stderr)
            return 2
        bridge = ChannelBridge(client.url, client.token or "", session_id, transport)
        runner = _BridgeThread(bridge)
        try:
            conn_file = runner.start()
        except BridgeError as e:
            print(f"kernelmode console: {e}", file=sys.stderr)
            runner.stop()
            return 2
        try:
            if connection_file_only:
                return _serve_connection_file(conn_file, session_id)
            return _jupyter_console(conn_file, lambda: client.interrupt(session_id), console_args)
        finally:
            runner.stop()


def _serve_connection_file(conn_file: Path, session_id: str) -> int:
    print(f"Connection file for session {session_id}: {conn_file}\n"
          f"  e.g. jupyter qtconsole --existing {conn_file}\n"
          "Keep this running while the frontend is attached; Ctrl-C ends the bridge "
          "(the kernel keeps running).", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    return 0


def _jupyter_console(conn_file: Path, interrupt: Callable[[], Any], args: list[str]) -> int:
    from jupyter_console.app import ZMQTerminalIPythonApp

    class KernelmodeConsoleApp(ZMQTerminalIPythonApp):
        """Ctrl-C interrupts through kernelmode (the stock console only interrupts kernels it started)."""

        def handle_sigint(self, *a: Any) -> None:
            if self.shell._executing:
                threading.Thread(target=_quietly, args=(interrupt,), daemon=True).start()
            else:
                raise KeyboardInterrupt

    app = KernelmodeConsoleApp.instance()
    app.initialize(["--existing", str(conn_file), "--ZMQTerminalIPythonApp.confirm_exit=False",
                    "--ZMQTerminalInteractiveShell.kernel_timeout=30", "--ZMQCompleter.timeout=10", *args])
    _completions_never_crash(app.shell.Completer)
    app.start()
    return 0


def _completions_never_crash(completer: Any) -> None:
    """A kernel too busy to answer a completion in time is no completion, not an "Unhandled
    exception in event loop" that stops the prompt at "Press ENTER to continue...". And a reply
    that comes after its Tab gave up is dropped: jupyter console would read it as the answer to
    the next Tab (and so on, one behind, until the next execute)."""
    from queue import Empty

    from jupyter_console.utils import run_sync

    def complete_request(code: str, cursor_pos: int) -> dict[str, Any]:
        msg_id = completer.client.complete(code=code, cursor_pos=cursor_pos)
        deadline = time.monotonic() + completer.timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = run_sync(completer.client.shell_channel.get_msg)(timeout=left)
            except Empty:
                break
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return dict(msg["content"])
        return {"matches": [], "cursor_start": cursor_pos, "cursor_end": cursor_pos,
                "metadata": {}, "status": "ok"}

    completer.complete_request = complete_request


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except KernelmodeError as e:
        print(f"\n[kernelmode] interrupt failed: {e.message}", file=sys.stderr)


def _age(ts: datetime) -> str:
    s = int((datetime.now(timezone.utc) - ts).total_seconds())
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def sessions_table(sessions: list[SessionInfo]) -> str:
    rows = [("SESSION", "STATUS", "AGE", "LAST ACTIVE", "RUNS", "MEMORY")]
    for s in sessions:
        memory = f"{s.memory_bytes / 2**20:.0f} MB" if s.memory_bytes is not None else "-"
        rows.append((s.session_id, s.status, _age(s.created_at), _age(s.last_activity) + " ago",
                     str(s.execution_count), memory))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def list_sessions(url: str | None, token: str | None) -> int:
    with Client(url, token) as client:
        try:
            sessions = client.list_sessions()
        except KernelmodeError as e:
            msg = ("the server refused the token (check --token / $KERNELMODE_TOKEN)"
                   if isinstance(e, Unauthorized) else e.message)
            print(f"kernelmode: {msg}", file=sys.stderr)
            return 2
    print(sessions_table(sessions) if sessions else "no sessions")
    return 0
