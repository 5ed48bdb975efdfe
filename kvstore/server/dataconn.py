"""One data-channel connection of the store process, served on its own thread.

Server side.  ``DataConnection.serve()`` is the thread's body: the hello (within
``hello_timeout``; TLS first when the server has it), then requests one at a time until the
client closes (format: ``kvstore.wire.data``).  Bytes move with blocking calls on this thread
(``sendall`` straight from the host slot, ``recv_into`` straight into the reserved slot: no
buffer in between, and the GIL is released while the kernel copies); everything that
touches the store's bookkeeping runs on the event loop through ``DataOps`` (``Bridge``).

Deadlines: the hello must arrive within ``hello_timeout``; a connection idle between requests
for ``idle_timeout`` is closed; each request must move its bytes within
``ServerConfig.stream_deadline(size)`` (``stream_grace`` + size / ``stream_min_rate``: every
blocking call gets the time left as its timeout), or the connection is cut (counted).

Cleanup is structural: a get's buffer reference is released and a put's reservation
aborted in ``finally`` blocks, whatever ends the transfer (the client vanishing mid-object,
a stall past its deadline, the server shutting down), and the connection's quota count is
given back when it ends.  Until its hello is accepted the connection holds a
pre-authentication slot of its peer (``slots.leave_preauth``); only then does it take one of
the channel's global slots (``slots.take``, given back by ``slots.give``), so a stranger
holding connections open never takes them (``kvstore.server.peers``).  A request the server refuses
(bad key, missing permission, a put of an existing object) is answered with its status and
the connection goes on; bytes that are not the protocol, a put larger than
``max_object_bytes``, or a transport failure end the connection (a get cut short never
looks like a complete object to the client: it knows the length and checks the checksum).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Protocol

from kvstore.errors import CapacityError, KVStoreError
from kvstore.server.auth import Principal
from kvstore.server.config import ServerConfig
from kvstore.server.dataops import Bridge, DataOps, LoopGone
from kvstore.server.leases import PendingPut
from kvstore.server.status import OUTCOMES, TIER_CODES, status_of
from kvstore.wire import data as wire
from tiers.base import PutResult

log = logging.getLogger("kvstore.server.data")
_SINK = 256 << 10


class Closed(Exception):
    """The peer closed the connection or broke the protocol: stop serving it."""


class Deadline:
    """When the request in progress must be done; ``left()`` is the timeout of the next
    blocking call (``socket.timeout`` once it has passed)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        return left


class Slots(Protocol):
    """What a connection holds of its server (``DataServer``): a pre-authentication slot of
    its peer until the hello, then one of the global connection slots."""

    def leave_preauth(self, conn: DataConnection) -> None: ...
    def take(self) -> bool: ...
    def give(self) -> None: ...


class DataConnection:
    """One accepted connection (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        ops: DataOps,
        bridge: Bridge,
        *,
        tls: ssl.SSLContext | None,
        cfg: ServerConfig,
        slots: Slots | None = None,
        peer: object = None,
    ) -> None:
        self.sock = sock
        self.slots, self.peer = slots, peer
        self._preauth = slots is not None  # holds its peer's pre-authentication slot
        self._counted = False  # holds one of the global slots
        self.ops, self.bridge = ops, bridge
        self.tls = tls
        self.cfg = cfg
        self.max_object_bytes = cfg.max_object_bytes
        self.who: Principal | None = None
        self._deadline = Deadline(cfg.hello_timeout)
        # _state_lock guards busy and closing (read by DataServer.aclose on the loop).
        self._state_lock = threading.Lock()
        self.busy = False
        self.closing = False
        self._sink = memoryview(bytearray(_SINK))

    # --- lifecycle (any thread) -------------------------------------------------------------

    def stop(self, only_idle: bool) -> bool:
        """Cut the connection (every blocking call on it returns); with ``only_idle``, only
        when no request is in progress.  Whether it was cut."""
        with self._state_lock:
            self.closing = True
            if only_idle and self.busy:
                return False
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the raw fd, even under TLS
        except OSError:
            pass
        return True

    def serve(self) -> None:
        try:
            self._handshake()
            while self._one_request():
                pass
        except TimeoutError:
            if self.who is not None:
                self.bridge.soon(self.ops.cut, self.who)
        except (Closed, OSError, LoopGone):
            pass
        except Exception:  # noqa: BLE001 - a bug must not take the server down with it
            log.exception("data connection failed")
        finally:
            try:
                self.sock.close()
            except OSError:
                pass
            self._end_preauth()
            if self._counted and self.slots is not None:  # counted only with slots
                self.slots.give()
            if self.who is not None:
                self.bridge.soon(self.ops.closed, self.who)

    def _end_preauth(self) -> None:
        if self._preauth and self.slots is not None:  # pre-authenticated only with slots
            self._preauth = False
            self.slots.leave_preauth(self)

    # --- protocol ---------------------------------------------------------------------------

    def _principal(self) -> Principal:
        """Who the hello authenticated; a request before it is a bug (the handshake comes first)."""
        if self.who is None:
            raise LookupError("data connection: a request before the hello")
        return self.who

    def _handshake(self) -> None:
        self._deadline = Deadline(self.cfg.hello_timeout)
        self.sock.settimeout(self.cfg.hello_timeout)  # the TLS handshake; then the hello's deadline
        if self.tls is not None:
            try:
                self.sock = self.tls.wrap_socket(self.sock, server_side=True)
            except (ssl.SSLError, OSError) as err:
                self.bridge.soon(self.ops.refused, "tls")
                raise Closed(f"TLS handshake failed: {err}") from err
        try:
            ticket, token_len = wire.decode_hello(self._recv(wire.HELLO.size))
            token = self._recv(token_len).decode() if token_len else ""
            self.who = self.bridge.call(self.ops.open(ticket, token))
        except (KVStoreError, UnicodeDecodeError) as err:
            self.bridge.soon(self.ops.refused, "hello")
            self._reply_error(err)
            raise Closed(str(err)) from err
        self._end_preauth()
        if self.slots is not None:
            if not self.slots.take():
                self.bridge.soon(self.ops.refused, "too_many_connections")
                self._reply_error(CapacityError("the data channel serves its most connections at once"))
                raise Closed("too many connections")
            self._counted = True
        self._sendall(wire.encode_reply())

    def _one_request(self) -> bool:
        """Serve one request; False when the connection ends cleanly (or idled too long)."""
        try:
            self.sock.settimeout(self.cfg.idle_timeout)
            first = self.sock.recv(1)
        except OSError:
            return False
        if not first:
            return False
        with self._state_lock:
            if self.closing:
                return False
            self.busy = True
        try:
            self._deadline = Deadline(self.cfg.stream_grace)  # until the size is known
            head = wire.decode_request(first + self._recv(wire.REQUEST.size - 1))
            raw_key = self._recv(head.key_len)
            if head.op is wire.Op.GET:
                self._get(raw_key)
            else:
                self._put(head, raw_key)
        except wire.WireError as err:
            self._reply_error(err)
            return False
        finally:
            with self._state_lock:
                self.busy = False
        return not self.closing

    def _get(self, raw_key: bytes) -> None:
        t0 = time.perf_counter()
        try:
            opened = self.bridge.call(self.ops.get(self._principal(), raw_key))
        except KVStoreError as err:
            self._reply_error(err)
            return
        if opened is None:
            self._sendall(wire.encode_reply(flag=0))
            return
        key, view, tier = opened
        sent = 0
        try:
            self._deadline = Deadline(self.cfg.stream_deadline(len(view)))
            self._sendall(wire.encode_reply(flag=1, tier=TIER_CODES.get(tier, 0), length=len(view)))
            self._sendall(view)
            sent = len(view)
        finally:
            self.bridge.soon(self.ops.release, self.who, key, sent, time.perf_counter() - t0)

    def _put(self, head: wire.RequestHead, raw_key: bytes) -> None:
        t0 = time.perf_counter()
        if head.size > self.max_object_bytes:  # not read to its end: the connection ends
            self._reply_error(self._capacity(head.size))
            raise Closed("put larger than max_object_bytes")
        self._deadline = Deadline(self.cfg.stream_deadline(head.size))
        try:
            result = self.bridge.call(self.ops.reserve(self._principal(), raw_key, head.size, head.parent))
        except KVStoreError as err:
            self._drain(head.size)
            self._reply_error(err)
            return
        if isinstance(result, PutResult):
            self._drain(head.size)
            self._sendall(wire.encode_reply(flag=OUTCOMES[result]))
            return
        self._fill(result)
        try:
            outcome = self.bridge.call(self.ops.finish(result, time.perf_counter() - t0))
        except KVStoreError as err:
            self._reply_error(err)
            return
        self._sendall(wire.encode_reply(flag=OUTCOMES[outcome]))

    def _fill(self, pending: PendingPut) -> None:
        """The put's bytes straight into its reserved slot; aborted unless all arrived."""
        ok = False
        try:
            buf = pending.handle.buffer
            if buf is None:  # the host tier hands out its slot
                raise LookupError(f"reservation of {pending.key!r} without its slot")
            self._recv_into(buf[: pending.handle.size])
            ok = True
        finally:
            if not ok:
                self.bridge.soon(self.ops.abort, pending)

    # --- plumbing ---------------------------------------------------------------------------

    def _capacity(self, size: int) -> KVStoreError:
        return CapacityError(f"object size {size} exceeds max_object_bytes {self.max_object_bytes}")

    def _reply_error(self, err: BaseException) -> None:
        code, message = status_of(err)
        try:
            self.sock.settimeout(self.cfg.stream_grace)
            self.sock.sendall(wire.encode_reply(code=code.value[0], message=message))
        except OSError:
            pass

    def _sendall(self, data) -> None:
        self.sock.settimeout(self._deadline.left())  # sendall's timeout bounds the whole call
        self.sock.sendall(data)

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_into(memoryview(buf))
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        while view:
            self.sock.settimeout(self._deadline.left())
            n = self.sock.recv_into(view)
            if n == 0:
                raise Closed("the client closed the data connection mid-request")
            view = view[n:]

    def _drain(self, n: int) -> None:
        while n > 0:
            self.sock.settimeout(self._deadline.left())
            got = self.sock.recv_into(self._sink[: min(n, _SINK)])
            if got == 0:
                raise Closed("the client closed the data connection mid-request")
            n -= got


__all__ = ["DataConnection", "Slots"]
