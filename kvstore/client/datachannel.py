"""The client side of the store's raw TCP data channel: a small pool of persistent
connections and the transfers over them.  Used by ``kvstore.client.store_client``.

Runs in the engine's processes: the pool on the client's event loop, the bytes on I/O
threads (one per connection in use).  Each connection is opened with a fresh single-use
ticket (``mint``: the ``OpenData`` RPC), plus the bearer token, TLS when the gRPC channel
uses it (same CA, client certificate and server name), and is then reused for request
after request (format: ``kvstore.wire.data``).  A get is one round trip: the request goes
out, the reply's bytes land with ``recv_into`` straight in the caller's buffer (no buffer of
our own: a fresh one per object would cap the copy near 2 GB/s, docs/limits.md#fresh-allocations), and the
payload checksum is computed on the same thread right after (xxh3 releases the GIL); the
caller verifies the object with it.  A put sends its request and the caller's bytes with
``sendall`` straight from its memory, then reads the outcome.

Failures.  A transport failure (refused, reset, closed mid-reply, a stall past the
deadline) closes that connection and raises ``TierUnavailableError``; a reply carrying a
status code comes back as ``Reply`` for the client to translate (one place,
``kvstore.client.rpc.Rpc.status_error``).  A request that fails on a *reused* connection before any reply
byte arrived (the server restarted, or dropped an idle connection) is retried once on a
new one; gets and puts are both idempotent (a put of a stored object is EXISTS).

Buffers: an I/O thread writes into the caller's buffer only while its coroutine waits for
it.  A coroutine cancelled (or failing) meanwhile cuts the socket, which returns the
blocking call at once, and waits for the thread before it lets the exception go: no byte
lands in the buffer after ``get`` returns or raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore import codec
from kvstore.errors import ConfigError, TierError, TierUnavailableError
from kvstore.wire import data as wire

T = TypeVar("T")
DEFAULT_CONNECTIONS = 4
_KEEPALIVE = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply: ``code`` (gRPC status number, 0 OK), ``message``, and for a get that found
    its object: ``length`` bytes in the buffer, ``tier`` and the payload ``digest``."""

    code: int
    flag: int
    tier: int = 0
    length: int = 0
    message: str = ""
    digest: bytes = b""


class _Retry(Exception):
    """A reused connection failed before any reply byte: try once more on a new one."""


class _Conn:
    """One connection; its methods block (they run on an I/O thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reused = False
        self.replied = False  # a byte of the current reply has arrived

    def abort(self) -> None:
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the raw fd, even under TLS
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        try:
            self.sock.close()
        except OSError:
            pass

    def hello(self, ticket: bytes, token: str | None) -> Reply:
        self.sock.sendall(wire.encode_hello(ticket, token))
        return self._reply()

    def get(self, request: bytes, dst: memoryview, timeout: float) -> Reply:
        self.sock.settimeout(timeout)
        self.sock.sendall(request)
        reply = self._reply()
        if reply.code or not reply.flag:
            return reply
        if reply.length > len(dst):  # never read it: this connection is out of step now
            raise ConfigError(f"read buffer of {len(dst)} bytes cannot hold {reply.length}")
        self._recv_into(dst[: reply.length])
        digest = codec.checksum(dst[codec.HEADER_SIZE : reply.length]) if reply.length >= codec.HEADER_SIZE else b""
        return Reply(reply.code, reply.flag, reply.tier, reply.length, reply.message, digest)

    def put(self, request: bytes, parts: Sequence[memoryview], timeout: float) -> Reply:
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(request)
            for part in parts:
                self.sock.sendall(part)
        except OSError:
            try:  # the server may have answered (and closed) before reading it all
                return self._reply()
            except (OSError, TierError):
                pass
            raise
        return self._reply()

    def _reply(self) -> Reply:
        self.replied = False
        head = wire.decode_reply(self._recv(wire.REPLY.size))
        message = self._recv(head.message_len).decode(errors="replace") if head.message_len else ""
        return Reply(head.code, head.flag, head.tier, head.length, message)

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        while view:
            n = self.sock.recv_into(view)
            if n == 0:
                raise ConnectionError("the store closed the data connection" + (" mid-reply" if self.replied else ""))
            self.replied = True
            view = view[n:]


class DataChannel:
    """A pool of data connections to one store (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        mint: Callable[[], Awaitable[bytes]],
        token: str | None,
        tls: ssl.SSLContext | None,
        server_name: str | None,
        timeout_s: float,
        connections: int = DEFAULT_CONNECTIONS,
    ) -> None:
        self.host, self.port = host.strip("[]"), port
        self.address = f"{host}:{port}"
        self._mint, self._token = mint, token
        self._tls, self._server_name = tls, server_name or self.host
        self.timeout_s = timeout_s
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._slots = asyncio.Semaphore(connections)
        self._io = cf.ThreadPoolExecutor(connections, thread_name_prefix="kvstore-data-io")
        self.opened = self.retries = 0
        self._closed = False

    async def get(self, request: bytes, dst: memoryview, timeout: float) -> Reply:
        """Send a get request; its object lands in ``dst`` (see ``Reply``)."""
        return await self._request(lambda c: c.get(request, dst, timeout))

    async def put(self, request: bytes, parts: Sequence[memoryview], timeout: float) -> Reply:
        return await self._request(lambda c: c.put(request, parts, timeout))

    async def warm(self) -> None:
        """Open one connection now (so a refusal shows at connect time) and keep it."""
        async with self._slots:
            self._idle.append(await self._open())

    async def aclose(self) -> None:
        """Close idle connections, cut busy ones (their requests fail), stop the threads."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        for conn in self._busy:
            conn.abort()
        self._idle.clear()
        await asyncio.to_thread(self._io.shutdown, wait=True)

    # --- connections ----------------------------------------------------------------------

    async def _request(self, op: Callable[[_Conn], Reply]) -> Reply:
        async with self._slots:
            try:
                return await self._attempt(op, retry=True)
            except _Retry:
                self.retries += 1
                return await self._attempt(op, retry=False)

    async def _attempt(self, op: Callable[[_Conn], Reply], retry: bool) -> Reply:
        conn = self._idle.pop() if self._idle else await self._open()
        self._busy.add(conn)
        try:
            reply = await self._run(conn, op, conn)
        except (OSError, wire.WireError) as err:
            conn.close()
            if retry and conn.reused and not conn.replied and isinstance(err, (ConnectionError, EOFError)):
                raise _Retry() from err
            raise TierUnavailableError(f"store data channel {self.address}: {_why(err)}") from err
        except BaseException:
            conn.close()
            raise
        finally:
            self._busy.discard(conn)
        conn.reused = True
        if self._closed:
            conn.close()
        else:
            self._idle.append(conn)
        return reply

    async def _open(self) -> _Conn:
        if self._closed:
            raise TierUnavailableError(f"store data channel {self.address}: client is closed")
        ticket = await self._mint()
        connecting = self._io.submit(self._connect)
        try:
            conn = await asyncio.wrap_future(connecting)
        except BaseException:
            connecting.add_done_callback(_close_late)  # cancelled while connecting: no leak
            raise
        try:
            reply = await self._run(conn, _Conn.hello, conn, ticket, self._token)
        except BaseException as err:
            conn.close()
            if isinstance(err, (OSError, wire.WireError)):
                raise TierUnavailableError(f"store data channel {self.address}: {_why(err)}") from err
            raise
        if reply.code:
            conn.close()
            raise RefusedError(reply)
        self.opened += 1
        return conn

    def _connect(self) -> _Conn:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as err:
            raise TierUnavailableError(f"store data channel {self.address}: {_why(err)}") from err
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in _KEEPALIVE:
                if hasattr(socket, name):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
        except (OSError, ssl.SSLError) as err:
            sock.close()
            raise TierUnavailableError(f"store data channel {self.address}: TLS: {_why(err)}") from err
        return _Conn(sock)

    async def _run(self, conn: _Conn, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on an I/O thread; on cancellation or failure of the wait, the
        socket is cut and the thread awaited before the exception goes on."""
        fut = self._io.submit(fn, *args)
        try:
            return await asyncio.wrap_future(fut)
        except BaseException:
            if not fut.done():
                conn.abort()
                cf.wait([fut])
            raise


class RefusedError(TierError):
    """The store refused a data connection's hello; ``reply`` carries its status."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def _close_late(fut: cf.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


def _why(err: BaseException) -> str:
    return str(err) or type(err).__name__


__all__ = ["DEFAULT_CONNECTIONS", "DataChannel", "RefusedError", "Reply"]
