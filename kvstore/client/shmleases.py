"""``LeaseLine``: lease requests on a shared-memory session's socket, the same host's read
without a gRPC round trip (format: ``kvstore.wire.shm``; server: ``kvstore.server.shmreads``).

Client side, on the client's event loop (the line opens there, at its first request).
Requests go out as soon as they are made and are answered by id, in any order, so several
reads of one client share the socket without waiting for each other.  One reader task
hands each answer to the request that waits for it.

Leases nobody receives are never lost: an answer that comes after its request gave up
(its deadline passed, or its caller was cancelled) and that granted a lease puts the lease
id in ``orphans``, which ``LeasedReader`` releases with the next batch.  When the socket
fails or the server closes it, every open request and every later one fails with
``SessionLostError``: the reader asks the store again (``Hello``), and a store that restarted
gives it a new session to retry on once; else the read is a failure (the engine recomputes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading

from kvstore.errors import TierUnavailableError
from kvstore.wire import shm as wire


class SessionLostError(TierUnavailableError):
    """The session's socket failed or the store closed it (a restarted store has a new one)."""


class LeaseLine:
    """The request side of one session's socket (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._opening: asyncio.Lock | None = None
        self._pending: dict[int, asyncio.Future[wire.Leased]] = {}
        self._next = 1
        self._broken = ""
        self.orphans: list[int] = []

    async def lease(self, key: bytes, lease_ms: int, timeout_s: float) -> wire.Leased:
        """The server's answer to one lease request for ``key`` (its code may be an error)."""
        if self._broken:
            raise SessionLostError(f"store shared-memory session: {self._broken}")
        writer = self._writer if self._writer is not None else await self._open()
        request, self._next = self._next, self._next + 1
        fut: asyncio.Future[wire.Leased] = asyncio.get_running_loop().create_future()
        self._pending[request] = fut
        delivered = False
        try:
            writer.write(wire.encode_lease(key, lease_ms, request))
            await writer.drain()
            async with asyncio.timeout(timeout_s):
                answer = await fut
            delivered = True
            return answer
        except TimeoutError:
            raise TierUnavailableError(
                f"store shared-memory session: no answer to a lease within {timeout_s:g} s"
            ) from None
        except (ConnectionError, OSError) as err:
            self._fail(f"the socket failed ({err})")
            raise SessionLostError(f"store shared-memory session: {self._broken}") from err
        finally:
            self._pending.pop(request, None)
            if not delivered and fut.done() and not fut.cancelled() and fut.exception() is None:
                self._orphan(fut.result())  # answered, but its caller gave up or was cancelled

    async def _open(self) -> asyncio.StreamWriter:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._writer is None:
                reader, writer = await asyncio.open_unix_connection(sock=self._sock)
                self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
                self._reader_task = self._loop.create_task(self._read_answers(reader))
                self._writer = writer
            return self._writer

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                answer, message_len = wire.decode_leased_head(await reader.readexactly(wire.LEASED.size))
                if message_len:
                    text = (await reader.readexactly(message_len)).decode(errors="replace")
                    answer = dataclasses.replace(answer, message=text)
                fut = self._pending.pop(answer.request, None)
                if fut is None or fut.done():
                    self._orphan(answer)
                else:
                    fut.set_result(answer)
        except asyncio.IncompleteReadError:
            self._fail("the store closed it")
        except (OSError, wire.ShmWireError) as err:
            self._fail(str(err))

    def _orphan(self, answer: wire.Leased) -> None:
        if answer.found:
            self.orphans.append(answer.lease_id)

    def _fail(self, why: str) -> None:
        self._broken = self._broken or why
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SessionLostError(f"store shared-memory session: {self._broken}"))
        self._pending.clear()

    @property
    def broken(self) -> str:
        """Why the line no longer works ("" while it does)."""
        return self._broken

    def take_orphans(self) -> list[int]:
        orphans, self.orphans = self.orphans, []
        return orphans

    def close(self) -> bool:
        """Close the socket through its transport, from any thread; False when the line never
        opened (then the caller closes the socket itself)."""
        writer, loop = self._writer, self._loop
        if writer is None or loop is None:
            return False
        self._broken = self._broken or "closed"
        if threading.get_ident() == self._thread:
            self._shut(writer)
            return True
        try:
            loop.call_soon_threadsafe(self._shut, writer)
        except RuntimeError:  # its loop is closed: nothing reads the socket any more
            return False
        return True

    def _shut(self, writer: asyncio.StreamWriter) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        writer.close()


__all__ = ["LeaseLine", "SessionLostError"]
