"""The sandbox's one way out: 127.0.0.1:3128 in the kernel's network namespace, relayed to the
session's egress socket ``/run/kernelmode/egress/proxy.sock`` (the host-side proxy that enforces
the session's policy).

It is the sandbox's command, run as the kernel's user before the kernel:
``python -I -S egress-bridge.py``, with the kernel's own argv in ``KM_KERNEL_ARGV`` (each argument
hex-encoded, space-separated: no import on the kernel's start path, unlike json; and not on the
command line: the bridge keeps this command line, and nothing must take it for the kernel).
It binds the port, forks the bridge (in a session of its own, deaf to the kernel's interrupts) and
execs the kernel in its own process: the kernel keeps the pid, exit status and signals its backend
watches. The bridge dies with the kernel (PR_SET_PDEATHSIG: it is the kernel's child), and with
the sandbox (the end of its pid namespace).

Each accepted connection is connected to the socket and bytes are moved both ways through
bounded buffers, half-closes passed on: a pipe per direction that ``os.splice`` fills from one
socket and empties into the other (the bytes never enter this process), or a bytearray where
splice is missing or no pipe can be had. With no socket (a session without egress) or none
answering (the proxy is down or restarting), the bridge answers one HTTP response itself, for a
plain request or a ``CONNECT`` alike, that says so in its status line and body (http.client shows
only the status line of a refused ``CONNECT``). The bridge is no security boundary: kernel code
can reach the socket itself, or kill the bridge and lose its own way out; the policy is enforced on
the host. Stdlib only: it runs with ``-S``, in any kernel environment.
"""

from __future__ import annotations

import errno
import fcntl
import os
import selectors
import signal
import socket
import sys
import time

PORT = 3128
SOCKET = "/run/kernelmode/egress/proxy.sock"
ARGV_ENV = "KM_KERNEL_ARGV"
NO_EGRESS = ("kernelmode: this session has no egress; the sandbox has no network by design "
             "(ask the operator for an egress allow-list, or use a host tool)")
NOT_ANSWERING = "kernelmode: the egress proxy is not answering; try again shortly"
BUFFER = 256 * 1024  # per direction and connection: a slow reader stops the other side's reads
SPLICE = getattr(os, "splice", None)  # Linux, Python 3.10+
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
MAX_CONNECTIONS = 256  # beyond, the listener's backlog holds new clients (2 descriptors each)
REFUSAL_SECONDS = 10.0  # a refused client has this long to send its request and hang up
REFUSAL_DRAIN = 1 << 20  # and this much of it is read (and dropped) so that closing sends no RST
ABSENT = (errno.ENOENT, errno.ENOTDIR)
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def reply(code: int, text: str) -> bytes:
    """A whole response; the text is the status line's reason too (a refused CONNECT shows it)."""
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {code} {text}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def dial(path: str) -> tuple[socket.socket | None, bytes]:
    """The way out for one client: (the connected socket, b"") or (None, the refusal to answer)."""
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None, reply(503, NOT_ANSWERING)
    upstream.setblocking(False)
    try:
        upstream.connect(path)  # a unix socket connects at once, or its backlog is full (EAGAIN)
        return upstream, b""
    except OSError as e:
        upstream.close()
        return None, reply(403, NO_EGRESS) if e.errno in ABSENT else reply(503, NOT_ANSWERING)


def pipes() -> tuple[list[tuple[int, int]], int] | None:
    """A pipe per direction for os.splice and the bytes each may hold, or None (no splice, or
    out of descriptors: the connection is copied through bytearrays instead)."""
    if SPLICE is None:
        return None
    made: list[tuple[int, int]] = []
    try:
        size = BUFFER
        for _ in range(2):
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            made.append((r, w))
            try:  # beyond the user's pipe quota a pipe keeps its default size (EPERM)
                size = min(size, fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, BUFFER))
            except OSError:
                size = min(size, fcntl.fcntl(w, fcntl.F_GETPIPE_SZ))
        return made, size
    except OSError:
        for fds in made:
            for fd in fds:
                os.close(fd)
        return None


class Conn:
    """One client and its way out (or the refusal it is answered). Side 0 is the client, side 1
    the upstream socket; ``toward[i]`` holds what is read from the other side, for side i (a
    bytearray, or ``pipes[i]``: ``pending[i]`` bytes in the pipe toward side i)."""

    def __init__(self, bridge: Bridge, client: socket.socket, upstream: socket.socket | None,
                 refusal: bytes) -> None:
        self.bridge = bridge
        self.socks = [client, upstream]
        self.toward = [bytearray(refusal), bytearray()]
        piped = pipes() if upstream is not None else None
        self.pipes: list[tuple[int, int]] | None = piped[0] if piped is not None else None
        self.limit = piped[1] if piped is not None else BUFFER
        self.pending = [len(refusal), 0]  # bytes held toward side i
        self.pipe_full = [False, False]  # the pipe toward side i took no more: wait for its writer
        self.eof = [False, upstream is None]  # EOF read from side i (a refusal has no upstream)
        self.shut = [False, upstream is None]  # side i's write half shut down (all sent)
        self.masks = [0, 0]
        self.dropped = 0  # bytes of a refused request read and dropped
        self.deadline = time.monotonic() + REFUSAL_SECONDS if upstream is None else None
        self.closed = False
        bridge.conns.add(self)
        self.update()

    def on_event(self, i: int, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ:
                self._read(i)
                if self.pending[1 - i] and self.socks[1 - i] is not None and not self.closed:
                    self._write(1 - i)  # on at once: the other socket can almost always take it
            if mask & selectors.EVENT_WRITE and not self.closed:
                self._write(i)
        except (BlockingIOError, InterruptedError):
            pass  # not ready after all: the selector says when
        except OSError:  # reset, broken pipe: the connection is over for both sides
            self.close()
            return
        self.update()

    def _read(self, i: int) -> None:
        other, o = self.socks[1 - i], 1 - i
        room = self.limit - self.pending[o] if other is not None else BUFFER
        if self.pipes is not None:
            try:
                n = os.splice(self.socks[i].fileno(), self.pipes[o][1], room,  # type: ignore[union-attr]
                              flags=SPLICE_FLAGS)
            except BlockingIOError:
                # A pipe holding bytes can be full short of its size (a page per socket read):
                # wait for its writer rather than spin on a readable socket.
                self.pipe_full[o] = self.pending[o] > 0
                raise
            self.pending[o] += n
            self.eof[i] = n == 0
            return
        data = self.socks[i].recv(room)  # type: ignore[union-attr]
        if not data:
            self.eof[i] = True
        elif other is None:  # a refused client's request: read only so that closing is clean
            self.dropped += len(data)
            if self.dropped > REFUSAL_DRAIN:
                self.close()
        else:
            self.toward[o] += data
            self.pending[o] += len(data)

    def _write(self, i: int) -> None:
        if self.pipes is not None:
            sent = os.splice(self.pipes[i][0], self.socks[i].fileno(), self.pending[i],  # type: ignore[union-attr]
                             flags=SPLICE_FLAGS)
            self.pipe_full[i] = False
        else:
            sent = self.socks[i].send(self.toward[i])  # type: ignore[union-attr]
            del self.toward[i][:sent]
        self.pending[i] -= sent

    def update(self) -> None:
        """Pass on half-closes, close when both directions are done, else re-arm the selector."""
        if self.closed:
            return
        for i, sock in enumerate(self.socks):
            if sock is not None and self.eof[1 - i] and not self.pending[i] and not self.shut[i]:
                self.shut[i] = True
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    self.close()
                    return
        if all(self.eof) and all(self.shut):
            self.close()
            return
        for i, sock in enumerate(self.socks):
            if sock is None:
                continue
            room = self.socks[1 - i] is None or (self.pending[1 - i] < self.limit and not self.pipe_full[1 - i])
            mask = (selectors.EVENT_READ if not self.eof[i] and room else 0) | (
                selectors.EVENT_WRITE if self.pending[i] else 0)
            if mask != self.masks[i]:
                sel = self.bridge.sel
                if not self.masks[i]:
                    sel.register(sock, mask, (self, i))
                elif not mask:
                    sel.unregister(sock)
                else:
                    sel.modify(sock, mask, (self, i))
                self.masks[i] = mask

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for i, sock in enumerate(self.socks):
            if sock is not None:
                if self.masks[i]:
                    self.bridge.sel.unregister(sock)
                sock.close()
        for fds in self.pipes or ():
            for fd in fds:
                os.close(fd)
        self.bridge.closed(self)


class Bridge:
    """The accept loop: one thread, one selector, at most MAX_CONNECTIONS at a time."""

    def __init__(self, listener: socket.socket, path: str = SOCKET) -> None:
        self.sel = selectors.DefaultSelector()
        self.listener = listener
        self.path = path
        self.conns: set[Conn] = set()
        self.listening = False
        listener.setblocking(False)
        self._listen(True)

    def _listen(self, on: bool) -> None:
        if on and not self.listening:
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        elif not on and self.listening:
            self.sel.unregister(self.listener)
        self.listening = on

    def _accept(self) -> None:
        while len(self.conns) < MAX_CONNECTIONS:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in OUT_OF_DESCRIPTORS:
                    if not self.conns:  # none to wait for: try again a little later
                        time.sleep(0.1)
                        return
                    break  # wait for a connection to close (a busy loop otherwise)
                continue  # the client gave up before it was accepted (ECONNABORTED)
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a TLS flight, not a stream of bytes
            Conn(self, client, *dial(self.path))
        self._listen(False)

    def closed(self, conn: Conn) -> None:
        self.conns.discard(conn)
        self._listen(True)

    def serve_forever(self) -> None:
        while True:
            deadlines = [c.deadline for c in self.conns if c.deadline is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, mask in self.sel.select(timeout):
                if key.data is None:
                    self._accept()
                else:
                    conn, i = key.data
                    if not conn.closed:
                        conn.on_event(i, mask)
            now = time.monotonic()
            for conn in [c for c in self.conns if c.deadline is not None and c.deadline <= now]:
                conn.close()


def die_with(parent: int) -> None:
    """SIGKILL when ``parent`` (the kernel) exits. bwrap's init waits for every process of the
    sandbox, not only the kernel: a bridge that outlived its kernel would keep the sandbox up."""
    import ctypes  # here: the kernel's start does not wait for it

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it exited before the signal was set
        os._exit(0)


def spawn(listener: socket.socket) -> None:
    """Start the bridge in a child that dies with this process (the kernel, after the exec)."""
    parent = os.getpid()
    if os.fork() == 0:
        try:
            die_with(parent)
            os.setsid()  # not in the kernel's process group: its interrupts are not ours
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            fd = listener.fileno()
            os.closerange(3, fd)
            os.closerange(fd + 1, 1 << 16)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            Bridge(listener).serve_forever()
        except BaseException as e:  # noqa: BLE001 - last words go to the kernel's log
            print(f"kernelmode egress bridge: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(0)


def main() -> None:
    # Popped: the kernel's environment stays its own.
    argv = decode_argv(os.environ.pop(ARGV_ENV))
    try:
        listener = socket.create_server(("127.0.0.1", PORT), backlog=128)
    except OSError as e:  # the kernel starts anyway, without its way out
        print(f"kernelmode egress bridge: cannot listen on 127.0.0.1:{PORT}: {e}", file=sys.stderr)
    else:
        spawn(listener)
        listener.close()
    os.execvp(argv[0], argv)


def encode_argv(argv: list[str]) -> str:
    """``KM_KERNEL_ARGV`` for ``argv`` (what main() decodes)."""
    return " ".join(arg.encode().hex() for arg in argv)


def decode_argv(value: str) -> list[str]:
    return [bytes.fromhex(arg).decode() for arg in value.split(" ")]


if __name__ == "__main__":
    main()
