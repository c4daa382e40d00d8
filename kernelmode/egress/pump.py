"""A tunnel's bytes, moved in the kernel: ``os.splice`` from one socket into a pipe and from the
pipe into the other socket, driven by the event loop's readiness callbacks. The proxy never
copies a tunnelled byte into Python, yet counts every one: a read asks for no more than the
session's remaining budget, and once it is spent for one byte, which fails the tunnel before it
leaves the pipe: the cap is forwarded exactly, never a byte more. Each direction holds at most ``PIPE``
bytes: a side that stops reading stops the other side's reads (back-pressure, bounded memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import time
from typing import cast

from .streams import Link

SPLICE = getattr(os, "splice", None)  # Linux, Python 3.10+
FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
PIPE = 256 * 1024  # per direction; what the kernel grants (the pipe quota) may be less


def available() -> bool:
    return SPLICE is not None


async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[socket.socket, bytes]:
    """Take a connection from its asyncio stream: reading stops, the bytes the stream had read
    but not handed out are returned, and a duplicate of its socket is for the pump alone (the
    transport keeps the original and closes it when the stream is closed)."""
    # From now on drain() waits until the transport has sent everything: the pump writes to the
    # socket itself, after what the stream was given.
    transport = cast(asyncio.Transport, writer.transport)  # a socket's: it reads too
    transport.set_write_buffer_limits(high=0)
    await writer.drain()
    transport.pause_reading()
    reader.feed_eof()  # no more will come from the transport: read() returns what is buffered
    left = await reader.read()
    sock = writer.get_extra_info("socket")
    dup = socket.socket(fileno=os.dup(sock.fileno()))
    dup.setblocking(False)
    return dup, left


async def tunnel(link: Link, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """Pump a tunnel between two streams: what each had read already is counted and sent on
    first, then the pump takes both sockets until the tunnel ends."""
    csock, cleft = await take(*client)
    try:
        usock, uleft = await take(*upstream)
    except BaseException:
        csock.close()
        raise
    try:
        for data, writer, up in ((cleft, upstream[1], False), (uleft, client[1], True)):
            if data:
                link.count(len(data), upstream=up)
                await Link.write(writer, data)
        await Pump(link, csock, usock).run()
    finally:
        csock.close()
        usock.close()


class _Way:
    """One direction: ``src`` -> pipe -> ``dst``."""

    def __init__(self, pump: Pump, src: socket.socket, dst: socket.socket, *, upstream: bool) -> None:
        self.pump, self.src, self.dst, self.upstream = pump, src, dst, upstream
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:  # beyond the user's pipe quota a pipe keeps its default size
            self.size = fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, PIPE)
        except OSError:
            self.size = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ)
        self.pending = 0  # bytes in the pipe
        self.eof = self.shut = False
        self.full = False  # the pipe took no more (full by pages, short of its size): wait for the writer
        self.reading = self.writing = False

    def readable(self) -> None:
        try:
            self._read()
            if self.pending:
                self._write()
        except BlockingIOError:
            pass
        except Exception as e:  # noqa: BLE001 - reset, cap: the tunnel is over
            self.pump.fail(e)
            return
        self.update()

    def writable(self) -> None:
        try:
            self._write()
            if not self.eof and not self.full:
                self._read()
        except BlockingIOError:
            pass
        except Exception as e:  # noqa: BLE001
            self.pump.fail(e)
            return
        self.update()

    def _read(self) -> None:
        link = self.pump.link
        # No more than the budget left; once it is spent, one byte, to see the cap passed (that
        # byte never leaves the pipe): a tunnel carries the cap exactly, never a byte more.
        left = link.meter.cap - link.meter.used
        want = min(self.size - self.pending, left) if left > 0 else 1
        try:
            n = SPLICE(self.src.fileno(), self.w, want, flags=FLAGS)  # type: ignore[misc]
        except BlockingIOError:
            self.full = self.pending > 0
            raise
        if n == 0:
            self.eof = True
            return
        link.count(n, upstream=self.upstream)  # raises EgressCapReached past the cap
        self.pending += n

    def _write(self) -> None:
        n = SPLICE(self.r, self.dst.fileno(), self.pending, flags=FLAGS)  # type: ignore[misc]
        self.pending -= n
        self.full = False
        self.pump.link.last = time.monotonic()

    def update(self) -> None:
        if self.pump.over:
            return
        if self.eof and not self.pending and not self.shut:
            self.shut = True
            with contextlib.suppress(OSError):  # the peer may be gone; the other way still runs
                self.dst.shutdown(socket.SHUT_WR)
            self.pump.check()
        loop = self.pump.loop
        read = not self.eof and self.pending < self.size and not self.full
        if read != self.reading:
            if read:
                loop.add_reader(self.src.fileno(), self.readable)
            else:
                loop.remove_reader(self.src.fileno())
            self.reading = read
        write = self.pending > 0
        if write != self.writing:
            if write:
                loop.add_writer(self.dst.fileno(), self.writable)
            else:
                loop.remove_writer(self.dst.fileno())
            self.writing = write

    def stop(self) -> None:
        if self.reading:
            self.pump.loop.remove_reader(self.src.fileno())
        if self.writing:
            self.pump.loop.remove_writer(self.dst.fileno())
        self.reading = self.writing = False
        os.close(self.r)
        os.close(self.w)


class Pump:
    """Both directions of a tunnel between ``client`` and ``upstream`` until both have ended
    (EOF read and passed on as a half-close) or one failed (reset, the byte cap); the caller's
    task being cancelled (the idle timeout) stops it too."""

    def __init__(self, link: Link, client: socket.socket, upstream: socket.socket) -> None:
        self.link = link
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.over = False
        self.ways: list[_Way] = []
        try:
            self.ways.append(_Way(self, client, upstream, upstream=False))
            self.ways.append(_Way(self, upstream, client, upstream=True))
        except OSError:
            self.close()
            raise

    async def run(self) -> None:
        try:
            for way in self.ways:
                way.update()
            await self.done
        finally:
            self.close()

    def check(self) -> None:
        if all(way.shut for way in self.ways) and not self.done.done():
            self.over = True
            self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        self.over = True
        if not self.done.done():
            self.done.set_exception(error)

    def close(self) -> None:
        self.over = True
        for way in self.ways:
            way.stop()
        self.ways = []
