"""A TCP proxy whose bandwidth can be limited and restored at run time: a slow network
between a client and a real server (Redis, ``kvstore serve``), for tests and benches.

``ThrottledProxy(("127.0.0.1", port), rate=4e6)`` listens on a free loopback port and
forwards every connection to the target.  Bytes from the server to its clients share one
token bucket of ``rate`` bytes per second (``None``: unlimited) with a ``burst`` of bytes,
as on a congested link; requests to the server are not limited (they are small).  Setting
``proxy.rate`` takes effect at once, also for transfers under way.

Threads, not asyncio: the proxy runs beside code under test in the same process and must
never wait on that code's event loop.
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 64 * 1024


class _Bucket:
    """Tokens (bytes) refilled at ``rate`` per second up to ``burst``."""

    def __init__(self, rate: float | None, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens, self._at = float(burst), time.monotonic()
        self._lock = threading.Lock()  # guards _tokens and _at

    def take(self, n: int, stop: threading.Event) -> None:
        """Block until ``n`` bytes may pass (at once when unlimited)."""
        while n > 0 and not stop.is_set():
            with self._lock:
                rate, now = self.rate, time.monotonic()
                if rate is None:
                    return
                self._tokens = min(self.burst, self._tokens + (now - self._at) * rate)
                self._at = now
                step = min(n, self.burst)
                if self._tokens >= step:
                    self._tokens -= step
                    n -= step
                    continue
                wait = (step - self._tokens) / rate
            time.sleep(min(wait, 0.05))  # re-read the rate: it may be lifted meanwhile


class ThrottledProxy:
    def __init__(self, target: tuple[str, int], rate: float | None = None, burst: int = CHUNK) -> None:
        self.target = target
        self._bucket = _Bucket(rate, burst)
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()  # guards _threads and _socks
        self._spawn(self._accept)

    @property
    def rate(self) -> float | None:
        return self._bucket.rate

    @rate.setter
    def rate(self, value: float | None) -> None:
        with self._bucket._lock:
            self._bucket.rate = value

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            self._spawn(self._pump, client, server, False)
            self._spawn(self._pump, server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, limited: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(CHUNK)
                if not data:
                    break
                if limited:
                    self._bucket.take(len(data), self._stop)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        for t in threads:
            t.join(timeout=2)

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ThrottledProxy"]
