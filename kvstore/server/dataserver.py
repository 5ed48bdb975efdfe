"""The store process's raw TCP data channel: the listener and its connection threads.

Server side.  Why it exists: gRPC moves bulk bytes at a fraction of what a socket does in
Python (every message is a fresh buffer, framed, copied and flow-controlled; docs/limits.md#grpc), so
objects cross hosts here instead, while control stays on gRPC: the bearer token and tenant,
TLS with the same certificates, and the ticket that opens each connection come from there
(``OpenData``; ``kvstore.server.tickets``), and a put is the same two-phase reservation,
verified before it is published.  The format is ``kvstore.wire.data``; each connection is
served by ``kvstore.server.dataconn`` on its own thread, its bookkeeping by
``kvstore.server.dataops`` on the event loop.

``DataServer.start(host, port)`` listens (port 0: a free one; no SO_REUSEPORT, so a port in
use is a ``ConfigError``) and accepts on the event loop; each accepted socket gets TCP_NODELAY,
keepalive (a dead peer is found in about 1.5 minutes) and a daemon thread.  Until its hello
is accepted (within ``hello_timeout``) a connection holds one of its source address's
``max_unauthenticated_per_peer`` slots and one of ``max_unauthenticated``
(``kvstore.server.peers``; beyond: closed at once, counted as
``failures{reason="data_unauthenticated_per_peer|_total"}``).  Once authenticated it takes
one of ``MAX_CONNECTIONS`` (beyond: refused with RESOURCE_EXHAUSTED) and counts against its
tenant's ``connections`` quota; it has a deadline per request and an idle timeout
(``kvstore.server.dataconn``).

``aclose(grace)``: stop accepting, cut idle connections, give those in a request ``grace``
seconds, cut the rest (their buffer references and reservations are given back by the
threads' ``finally`` blocks, on the loop, which still runs), and join the threads.  It runs
before the store closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading

from kvstore.errors import ConfigError
from kvstore.server.auth import Authenticator
from kvstore.server.config import ServerConfig
from kvstore.server.core import ServerStore
from kvstore.server.dataconn import DataConnection
from kvstore.server.dataops import Bridge, DataOps
from kvstore.server.peers import PreAuth
from kvstore.server.scoping import Scoper

log = logging.getLogger("kvstore.server.data")
MAX_CONNECTIONS = 512
_KEEPALIVE = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


def server_tls(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The data channel's TLS context: the gRPC server's certificate, key and client CA."""
    if cfg.tls_cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key))
    if cfg.tls_client_ca is not None:
        ctx.load_verify_locations(str(cfg.tls_client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class DataServer:
    """Listener and connection threads of the data channel (see the module docstring)."""

    def __init__(self, store: ServerStore, auth: Authenticator, scope: Scoper, cfg: ServerConfig) -> None:
        self.ops = DataOps(store, auth, scope)
        self.cfg = cfg
        self.tls = server_tls(cfg)
        self.port = 0
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._bridge: Bridge | None = None
        # _lock guards _conns (connection threads remove themselves on exit).
        self._lock = threading.Lock()
        self._conns: dict[DataConnection, threading.Thread] = {}
        self._authenticated = 0  # connections holding a global slot (guarded by _lock)
        self.preauth = PreAuth(cfg.max_unauthenticated_per_peer, cfg.max_unauthenticated)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` and accept on the running loop; the bound port."""
        loop = asyncio.get_running_loop()
        self._bridge = Bridge(loop)
        try:
            infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family = infos[0][0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(infos[0][4])
        except OSError as err:
            raise ConfigError(f"cannot listen for the data channel on {host}:{port}: {err}") from err
        listener.listen(128)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._accepting = loop.create_task(self._accept_forever(listener), name="kvstore-data-accept")
        return self.port

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as err:
                log.warning("data channel: accept failed: %s", err)
                await asyncio.sleep(0.1)
                continue
            self._admit(conn, addr[0])

    def _admit(self, sock: socket.socket, peer: str) -> None:
        refused = self.preauth.enter(peer)
        if refused is not None:
            self.ops.refused(f"unauthenticated_{refused}")
            sock.close()
            return
        sock.setblocking(True)
        _tune(sock)
        assert self._bridge is not None
        conn = DataConnection(sock, self.ops, self._bridge, tls=self.tls, cfg=self.cfg, slots=self, peer=peer)
        thread = threading.Thread(target=self._run, args=(conn,), name="kvstore-data-conn", daemon=True)
        with self._lock:
            self._conns[conn] = thread
        thread.start()

    # --- slots of a connection (dataconn.Slots; connection threads) ---------------------------

    def leave_preauth(self, conn: DataConnection) -> None:
        self.preauth.leave(conn.peer)

    def take(self) -> bool:
        with self._lock:
            if self._authenticated >= MAX_CONNECTIONS:
                return False
            self._authenticated += 1
            return True

    def give(self) -> None:
        with self._lock:
            self._authenticated -= 1

    def _run(self, conn: DataConnection) -> None:
        try:
            conn.serve()
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    async def aclose(self, grace: float) -> None:
        """Stop (see the module docstring).  Idempotent."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting])
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while True:
            with self._lock:
                live = list(self._conns.items())
            busy = [c for c, _ in live if not c.stop(only_idle=True)]
            if not busy or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        for conn, _ in live:
            conn.stop(only_idle=False)
        for _, thread in live:
            await asyncio.to_thread(thread.join, 5.0)
            if thread.is_alive():
                log.warning("data channel: a connection thread did not stop")


def describe(tls: bool, port: int) -> str:
    return f"data channel tcp:{port}" + (" (tls)" if tls else "")


__all__ = ["DataServer", "MAX_CONNECTIONS", "describe", "server_tls"]
