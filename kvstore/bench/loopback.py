"""Loopback TCP transfer: the network limit that network tiers are measured against.

``measure_loopback(nbytes, repeat)`` runs a server thread on ``127.0.0.1`` (a free port) and,
over one connection, times request/response rounds in both directions:

* **get**: the client sends a one-byte request, the server ``sendall``s ``nbytes`` and the
  client ``recv_into``s a preallocated buffer until all have arrived;
* **put**: the client ``sendall``s ``nbytes``, the server ``recv_into``s a preallocated buffer
  and answers one byte.

Buffers are allocated (and prefaulted) once, before any timing; each figure is the median
of ``repeat`` rounds.  ``small_round_trip_us(repeat)`` is the median round trip of a one-byte
request and a one-byte answer on a fresh connection of the same kind.  Both are the plain
Python socket path (docs/limits.md#loopback-tcp: ~2 GB/s at 32 MiB on this machine), the fair limit for a
Python client.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass

from kvstore.errors import ConfigError

_GET, _PUT, _PING, _BYE = b"g", b"p", b"s", b"q"
_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class LoopbackResult:
    """Median GB/s (10^9 bytes/s) of ``nbytes`` each way over loopback TCP."""

    nbytes: int
    get_gbps: float
    put_gbps: float


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("loopback peer closed the connection mid-transfer")
        view = view[n:]


def _serve(listener: socket.socket, nbytes: int) -> None:
    """One connection: answer requests until the client says goodbye or goes away."""
    conn, _ = listener.accept()
    payload = bytearray(b"\x5a" * nbytes)  # allocated and touched once
    sink = memoryview(bytearray(b"\0" * nbytes))
    cmd = memoryview(bytearray(1))
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                _recv_exact(conn, cmd)
            except (ConnectionError, OSError):
                return
            op = bytes(cmd)
            if op == _GET:
                conn.sendall(payload)
            elif op == _PUT:
                _recv_exact(conn, sink)
                conn.sendall(b"k")
            elif op == _PING:
                conn.sendall(b"k")
            else:
                return


class _Loopback:
    """A server thread and one connected client socket (context manager)."""

    def __init__(self, nbytes: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_TIMEOUT_S)
        self._thread = threading.Thread(
            target=_serve, args=(self._listener, nbytes), name="kvstore-loopback", daemon=True
        )
        self._thread.start()
        self.sock = socket.create_connection(self._listener.getsockname()[:2], timeout=_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __enter__(self) -> _Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.sock.sendall(_BYE)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=_TIMEOUT_S)
        self._listener.close()


def _check(nbytes: int, repeat: int) -> None:
    if nbytes <= 0:
        raise ConfigError(f"loopback transfer size must be positive, got {nbytes}")
    if repeat < 1:
        raise ConfigError(f"repeat must be at least 1, got {repeat}")


def measure_loopback(nbytes: int, repeat: int = 5) -> LoopbackResult:
    """Median get and put GB/s of ``nbytes`` over loopback TCP (see the module docstring)."""
    _check(nbytes, repeat)
    buf = bytearray(b"\0" * nbytes)  # the client's reused receive buffer
    view = memoryview(buf)
    data = memoryview(bytearray(b"\xa5" * nbytes))  # the client's payload, sent as is
    ack = memoryview(bytearray(1))
    gets, puts = [], []
    with _Loopback(nbytes) as lb:
        for _ in range(repeat + 1):  # the first round warms both sides up
            t0 = time.perf_counter()
            lb.sock.sendall(_GET)
            _recv_exact(lb.sock, view)
            gets.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lb.sock.sendall(_PUT)
            lb.sock.sendall(data)
            _recv_exact(lb.sock, ack)
            puts.append(time.perf_counter() - t0)
    return LoopbackResult(
        nbytes, nbytes / statistics.median(gets[1:]) / 1e9, nbytes / statistics.median(puts[1:]) / 1e9
    )


def small_round_trip_us(repeat: int = 50) -> float:
    """Median microseconds of a one-byte request answered by one byte over loopback TCP."""
    _check(1, repeat)
    ack = memoryview(bytearray(1))
    times = []
    with _Loopback(1) as lb:
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            lb.sock.sendall(_PING)
            _recv_exact(lb.sock, ack)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e6


__all__ = ["LoopbackResult", "measure_loopback", "small_round_trip_us"]
