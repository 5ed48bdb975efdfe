"""The wire format of the store process's shared-memory gate (a Unix socket): pure encoders
and decoders, no I/O.  Used by ``kvstore.server.shmgate`` (server) and
``kvstore.client.shmsession`` (client).

A client opens a session with one hello, answered by one reply::

    hello = "KVM1" | u16 token length | ticket (32 bytes, from OpenData) | token (UTF-8)
    reply = u8 code | u8 writable | u16 0 | u32 message length | u64 session | u64 pool size
            | message (UTF-8)

Integers are little-endian; ``code`` is a gRPC status code number (0: OK).  With code 0 the
reply carries one file descriptor (``SCM_RIGHTS``): the caller's tenant's pool, ``pool
size`` bytes, writable exactly when ``writable`` is 1.  The client then sends nothing more
and keeps the connection open while it maps the pool; closing it ends the session
(``session`` is its id, named by ``PutStart``).  On a refusal the server closes at once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.wire.data import HELLO, TICKET_SIZE, TicketHello

MAGIC = b"KVM1"
MAX_MESSAGE_BYTES = 4096
REPLY = struct.Struct("<BBHIQQ")  # code, writable, 0, message length, session, pool size


class ShmWireError(ConfigError):
    """Bytes that are not what the shared-memory gate's format allows."""


@dataclass(frozen=True, slots=True)
class GateReply:
    code: int
    writable: bool
    session: int
    pool_size: int
    message_len: int


_HELLO = TicketHello(MAGIC, "kvstore shared-memory client", ShmWireError)
encode_hello, decode_hello = _HELLO.encode, _HELLO.decode


def encode_reply(
    code: int = 0, writable: bool = False, session: int = 0, pool_size: int = 0, message: str = ""
) -> bytes:
    text = message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    return REPLY.pack(code, int(writable), 0, len(text), session, pool_size) + text


def decode_reply(head: bytes) -> GateReply:
    code, writable, zero, message_len, session, pool_size = REPLY.unpack(head)
    if zero or writable > 1 or message_len > MAX_MESSAGE_BYTES:
        raise ShmWireError("malformed shared-memory gate reply")
    return GateReply(code, bool(writable), session, pool_size, message_len)


__all__ = [
    "GateReply",
    "HELLO",
    "MAGIC",
    "REPLY",
    "ShmWireError",
    "TICKET_SIZE",
    "decode_hello",
    "decode_reply",
    "encode_hello",
    "encode_reply",
]
