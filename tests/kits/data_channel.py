"""A raw data-channel client for tests: plain blocking sockets speaking ``kvstore.wire.data``
to a real ``kvstore serve``, so a test can send exactly the bytes it wants (forged tickets,
half objects, garbage) and read exactly what comes back.  Tickets come from ``OpenData``
through ``tests.kits.store_calls.StoreClient`` (plain gRPC stubs)."""

from __future__ import annotations

import socket
import ssl

from kvstore.keys import ObjectKey
from kvstore.localtoken import local_token
from kvstore.wire import data as wire
from tests.kits.store_calls import StoreClient


def ticket_of(client: StoreClient) -> tuple[bytes, int]:
    """(a fresh ticket, the data port) from ``OpenData``."""
    from kvstore._proto import kvstore_pb2 as pb

    reply = client.call("OpenData", pb.OpenDataRequest())
    return reply.ticket, reply.data_port


class RawData:
    """One data-channel connection; every reply is returned as (head, message)."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> None:
        sock = socket.create_connection((host, port), timeout=20)
        self.sock = tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hello(self, ticket: bytes, token: str | None = None) -> tuple[wire.ReplyHead, str]:
        """``token`` None: this user's default token, as real clients send (``""``: none)."""
        self.sock.sendall(wire.encode_hello(ticket, local_token() if token is None else token))
        return self.reply()

    def reply(self) -> tuple[wire.ReplyHead, str]:
        head = wire.decode_reply(self.recv(wire.REPLY.size))
        return head, self.recv(head.message_len).decode()

    def get(self, key: ObjectKey) -> tuple[wire.ReplyHead, str, bytes]:
        self.sock.sendall(wire.encode_request(wire.Op.GET, key))
        head, message = self.reply()
        body = self.recv(head.length) if head.code == 0 and head.flag else b""
        return head, message, body

    def put(self, key: ObjectKey, obj: bytes | memoryview, size: int | None = None) -> tuple[wire.ReplyHead, str]:
        self.sock.sendall(wire.encode_request(wire.Op.PUT, key, len(obj) if size is None else size))
        self.sock.sendall(obj)
        return self.reply()

    def recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"the server closed the connection ({len(out)} of {n} bytes)")
            out += chunk
        return bytes(out)

    def closed_by_server(self) -> bool:
        """Whether the server has closed this connection (EOF or reset on the next read)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, ssl.SSLError):
            return True


__all__ = ["RawData", "ticket_of"]
