"""Byte movement for the egress proxy: reads with an idle deadline, writes with back-pressure, and
the per-session meter that enforces the byte cap. Every buffer is bounded by ``CHUNK``: a client
that stops reading stalls its own writer in ``drain``, it never grows a queue."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import EgressCapReached

CHUNK = 64 * 1024


class Meter:
    """A session's byte count against its cap, and the last time a connection moved a byte."""

    def __init__(self, cap: int, on_bytes: Callable[[int], None] = lambda n: None) -> None:
        self.cap = cap
        self.used = 0
        self.on_bytes = on_bytes

    @property
    def spent(self) -> bool:
        return self.used >= self.cap

    def charge(self, n: int) -> None:
        self.used += n
        self.on_bytes(n)
        if self.used > self.cap:
            raise EgressCapReached(f"egress byte cap of {self.cap} bytes reached")


class Link:
    """One connection's reads and writes, counted: ``up`` from the client, ``down`` to it."""

    def __init__(self, meter: Meter, idle_seconds: float) -> None:
        self.meter = meter
        self.idle = idle_seconds
        self.up = 0
        self.down = 0
        self.last = time.monotonic()
        self.on_bytes: Callable[[int], None] | None = None  # the run usage entry of a tunnel
        self.idled = False
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, task: asyncio.Task[None]) -> None:
        """Cancel ``task`` once neither direction moved a byte for the idle time. One timer per
        connection, not a deadline per read (asyncio.wait_for makes a task each time)."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            left = self.last + self.idle - time.monotonic()
            if left > 0:
                self._timer = loop.call_later(left, check)
            else:
                self.idled = True
                task.cancel()
        self._timer = loop.call_later(self.idle, check)

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    async def read(self, reader: Reader, *, upstream: bool) -> bytes:
        """Up to CHUNK bytes (b"" at EOF), counted and charged to the session."""
        data = await reader.read(CHUNK)
        self.count(len(data), upstream=upstream)
        return data

    def count(self, n: int, *, upstream: bool) -> None:
        """``n`` bytes moved: counted, and charged to the session (raises past its cap)."""
        self.last = time.monotonic()
        if upstream:
            self.down += n
        else:
            self.up += n
        if self.on_bytes is not None:
            self.on_bytes(n)
        self.meter.charge(n)

    @staticmethod
    async def write(writer: Writer, data: bytes) -> None:
        if data:
            writer.write(data)
            await writer.drain()

    async def pipe(self, reader: Reader, writer: Writer, *, upstream: bool) -> None:
        """Copy until EOF, then half-close the other side."""
        while data := await self.read(reader, upstream=upstream):
            await self.write(writer, data)
        if writer.can_write_eof():
            writer.write_eof()

    async def splice(self, client: tuple[Reader, Writer], upstream: tuple[Reader, Writer]) -> None:
        """Both directions until both ended, or one failed (idle, cap, reset). Where a side
        cannot take a half-close (TLS), one direction ending ends both."""
        half_close = client[1].can_write_eof() and upstream[1].can_write_eof()
        tasks = [asyncio.ensure_future(self.pipe(client[0], upstream[1], upstream=False)),
                 asyncio.ensure_future(self.pipe(upstream[0], client[1], upstream=True))]
        try:
            pending: set[asyncio.Future[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if not half_close:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def can_write_eof(self) -> bool: ...
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


class TlsStream:
    """TLS over an existing stream with the stdlib's sans-I/O ``SSLObject`` (memory BIOs), so one
    connection can switch to TLS after ``CONNECT`` on every supported Python (StreamWriter.start_tls
    is 3.11+). It is both the reader and the writer of the TLS side."""

    def __init__(self, reader: Reader, writer: Writer, ctx: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self._reader, self._writer = reader, writer
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)

    def _flush(self) -> None:
        if self._out.pending:
            self._writer.write(self._out.read())

    async def _fill(self) -> None:
        await self._writer.drain()
        data = await self._reader.read(CHUNK)
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    async def handshake(self, timeout: float) -> None:
        async def run() -> None:
            while True:
                try:
                    self._obj.do_handshake()
                    self._flush()
                    await self._writer.drain()
                    return
                except ssl.SSLWantReadError:
                    self._flush()
                    await self._fill()
        await asyncio.wait_for(run(), timeout)

    async def read(self, n: int = -1) -> bytes:
        limit = CHUNK if n < 0 else n
        while True:
            try:
                data = self._obj.read(limit)
            except ssl.SSLWantReadError:
                self._flush()
                await self._fill()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            # One read gives one TLS record (16 KiB at most): take the records already here too,
            # so a large body moves in few h11 events and writes, not one per record.
            parts = [data]
            size = len(data)
            while data and size < limit:
                try:
                    data = self._obj.read(limit - size)
                except (ssl.SSLWantReadError, ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    break  # an EOF is for the next call, after these bytes
                parts.append(data)
                size += len(data)
            self._flush()
            return b"".join(parts) if len(parts) > 1 else parts[0]

    def write(self, data: bytes) -> None:
        self._obj.write(data)
        self._flush()

    async def drain(self) -> None:
        await self._writer.drain()

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with contextlib.suppress(ssl.SSLError):
            self._obj.unwrap()
        self._flush()
        self._writer.close()
