"""The client's shared-memory session with a store process on the same host: the Unix
socket that delivered its tenant's pool, and the mapping of that pool.

Client side (``kvstore.client.planes`` opens one per client; tests open them directly).
``ShmSession.open(path, ticket, token)`` connects to the server's gate, sends the hello
(``kvstore.wire.shm``: an ``OpenData`` ticket and the bearer token), receives the pool's
descriptor (``SCM_RIGHTS``) and maps it: read-write when the server says the token may
write, read-only otherwise (a read-only mapping cannot be written, by this process or
through it).  The descriptor is closed once mapped; the connection stays open, because
it carries the session's lease requests when the server takes them (``leases``, a
``kvstore.client.shmleases.LeaseLine``), and closing it ends the session (``close``: unmap
first, then close, so the server never frees a fenced slot this process could still
write).  ``alive`` tells whether the server still holds the session (it closes its end
when it stops).  ``sealed``: the pool's file refuses every new writable mapping (the store
seals the pools of tenants with no writing ``shm`` token), checked on the descriptor itself.

Blocking calls with a timeout: ``open`` runs in a worker thread when called from a loop.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import numpy as np

from kvstore.client.shmleases import LeaseLine
from kvstore.errors import ConfigError, TierError, TierUnavailableError
from kvstore.wire import shm as wire
from tiers.host_shm import SharedPoolView, map_fd, write_sealed


@dataclass(frozen=True, slots=True)
class GateRefusal:
    """The gate refused the session: its status ``code`` (a gRPC number) and ``message``."""

    code: int
    message: str


class GateRefusedError(TierError):
    def __init__(self, refusal: GateRefusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class ShmSession:
    """One open session (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        pool: SharedPoolView,
        session_id: int,
        writable: bool,
        path: str,
        features: int = 0,
        sealed: bool = False,
    ) -> None:
        self.sock, self.pool = sock, pool
        self.session_id, self.writable, self.path = session_id, writable, path
        # nobody but the store can write the pool (its file refuses writable mappings): what is
        # in it was verified when it entered, and reads need not checksum it again
        self.sealed = sealed
        # lease requests on this socket (``kvstore.client.shmleases``), when the server takes them
        self.leases = LeaseLine(sock) if features & wire.FEATURE_LEASES else None

    @property
    def array(self) -> np.ndarray:
        return self.pool.array

    @classmethod
    def open(cls, path: str, ticket: bytes, token: str | None, timeout_s: float = 5.0) -> ShmSession:
        """Connect, present ``ticket`` and ``token``, map the pool received;
        ``TierUnavailableError`` when the socket cannot be reached, ``GateRefusedError``
        with the server's status when it refuses."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            _connect(sock, path, timeout_s)
            sock.sendall(wire.encode_hello(ticket, token))
            reply, fd = _receive(sock)
            try:
                pool = map_fd(fd, reply.pool_size, reply.writable)
                sealed = not reply.writable and write_sealed(fd)
            finally:
                os.close(fd)
        except OSError as err:
            sock.close()
            raise TierUnavailableError(f"store shared-memory socket {path}: {err.strerror or err}") from err
        except BaseException:
            sock.close()
            raise
        return cls(sock, pool, reply.session, reply.writable, path, reply.features, sealed)

    def alive(self) -> bool:
        """Whether the server still holds this session (its end is open)."""
        if self.leases is not None and self.leases.broken:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Unmap (now, or when the last view of the mapping goes), then end the session."""
        self.pool.close()
        if self.leases is not None and self.leases.close():
            return  # its transport closes the socket, on the loop that reads it
        try:
            self.sock.close()
        except OSError:
            pass


def _connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    """Connect to the gate, waiting up to ``timeout_s`` while its backlog is full: a Unix
    socket with a timeout answers EAGAIN at once instead of waiting for room, so other
    processes' connects (a flood of them, issue 23) would otherwise refuse this session."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _receive(sock: socket.socket) -> tuple[wire.GateReply, int]:
    """The gate's reply and the descriptor that came with it; refusals raise."""
    data, fds, _, _ = socket.recv_fds(sock, wire.REPLY.size + wire.MAX_MESSAGE_BYTES, 1)
    if len(data) < wire.REPLY.size:
        for fd in fds:
            socket.close(fd)
        raise TierUnavailableError("the store closed the shared-memory socket before answering")
    reply = wire.decode_reply(data[: wire.REPLY.size])
    message = data[wire.REPLY.size : wire.REPLY.size + reply.message_len].decode(errors="replace")
    if reply.code or len(fds) != 1:
        for fd in fds:
            socket.close(fd)
        if reply.code:
            raise GateRefusedError(GateRefusal(reply.code, message))
        raise ConfigError("the store's shared-memory reply carried no pool descriptor")
    return reply, fds[0]


__all__ = ["GateRefusal", "GateRefusedError", "ShmSession"]
