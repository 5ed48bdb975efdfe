"""The wire format of the store process's data channel (raw TCP beside gRPC): pure encoders
and decoders, no I/O.  Used by both sides: ``kvstore.server.dataconn`` (server) and
``kvstore.client.datachannel`` (client).

A connection opens with the client's hello, answered by one reply (code 0, or the refusal,
after which the server closes the connection)::

    hello   = "KVD1" | u16 token length | ticket (32 bytes) | token (UTF-8)

It then carries requests one at a time, each answered before the next is sent::

    request = u8 op ("G" get, "P" put) | u8 key length | u16 0 | u64 size
              | parent chunk hash (32 bytes; zeros: none) | key
              [put: then exactly ``size`` bytes, the whole object]
    reply   = u8 code | u8 flag | u8 tier | u8 0 | u32 message length | u64 length
              | message (UTF-8)
              [get, code 0, flag 1: then exactly ``length`` bytes, the whole object]

Integers are little-endian.  ``key`` is the caller's own ``ObjectKey`` bytes (namespace,
chunk hash, tag); the server scopes it to the connection's tenant exactly as on gRPC.
``code`` is the number of the gRPC status code that the same failure gets on the gRPC API
(0: OK); ``flag`` is "found" for a get (0 with code 0: a miss) and the ``PutOutcome`` wire
value for a put; ``tier`` the ``Tier`` wire value where a get found the object.

A put's bytes follow its request without waiting for an answer (one round trip).  A put the
server refuses or answers at once (EXISTS, NO_ROOM, a bad key, no write permission) still
has its bytes read to their end before the reply, so the stream stays in step; a size above
the server's ``max_object_bytes`` is answered and the connection closed instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from kvstore.errors import ConfigError

MAGIC = b"KVD1"
TICKET_SIZE = 32
MAX_TOKEN_BYTES = 4096
MAX_MESSAGE_BYTES = 4096
NO_PARENT = bytes(32)

HELLO = struct.Struct("<4sH32s")  # magic, token length, ticket
REQUEST = struct.Struct("<BBHQ32s")  # op, key length, 0, size, parent hash
REPLY = struct.Struct("<BBBxIQ")  # code, flag, tier, message length, length


class Op(IntEnum):
    GET = ord("G")
    PUT = ord("P")


class WireError(ConfigError):
    """Bytes that are not what the data channel's format allows at this point."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A request's fixed part; ``key_len`` bytes of key follow it on the wire."""

    op: Op
    key_len: int
    size: int
    parent: bytes  # b"" when the request names no parent


@dataclass(frozen=True, slots=True)
class ReplyHead:
    """A reply's fixed part; ``message_len`` bytes of message follow it on the wire."""

    code: int
    flag: int
    tier: int
    message_len: int
    length: int


class TicketHello:
    """The first message of a connection that presents an ``OpenData`` ticket and a bearer
    token: ``magic | u16 token length | ticket (32 bytes) | token (UTF-8)``.  The data
    channel and the shared-memory gate (``kvstore.wire.shm``) differ only in the magic."""

    def __init__(self, magic: bytes, client: str, error: type[Exception]) -> None:
        self.magic, self.client, self.error = magic, client, error

    def encode(self, ticket: bytes, token: str | None) -> bytes:
        raw = (token or "").encode()
        if len(ticket) != TICKET_SIZE:
            raise self.error(f"a ticket is {TICKET_SIZE} bytes, got {len(ticket)}")
        if len(raw) > MAX_TOKEN_BYTES:
            raise self.error(f"bearer token longer than {MAX_TOKEN_BYTES} bytes")
        return HELLO.pack(self.magic, len(raw), ticket) + raw

    def decode(self, head: bytes) -> tuple[bytes, int]:
        """(ticket, token length) of a hello's fixed part."""
        magic, token_len, ticket = HELLO.unpack(head)
        if magic != self.magic:
            raise self.error(f"not a {self.client} (magic {magic!r})")
        if token_len > MAX_TOKEN_BYTES:
            raise self.error(f"token of {token_len} bytes exceeds {MAX_TOKEN_BYTES}")
        return ticket, token_len


_HELLO = TicketHello(MAGIC, "kvstore data channel client", WireError)
encode_hello, decode_hello = _HELLO.encode, _HELLO.decode


def encode_request(op: Op, key: bytes, size: int = 0, parent: bytes = b"") -> bytes:
    if not 0 < len(key) <= 255:
        raise WireError(f"object key of {len(key)} bytes")
    if parent and len(parent) != 32:
        raise WireError(f"parent hash must be 32 bytes, got {len(parent)}")
    return REQUEST.pack(op, len(key), 0, size, parent or NO_PARENT) + key


def decode_request(head: bytes) -> RequestHead:
    op, key_len, zero, size, parent = REQUEST.unpack(head)
    if op not in Op._value2member_map_ or zero or key_len == 0:
        raise WireError(f"malformed data request (op {op}, key length {key_len})")
    if op == Op.GET and (size or parent != NO_PARENT):
        raise WireError("a get request carries no size and no parent")
    return RequestHead(Op(op), key_len, size, b"" if parent == NO_PARENT else parent)


def encode_reply(code: int = 0, flag: int = 0, tier: int = 0, length: int = 0, message: str = "") -> bytes:
    text = message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    return REPLY.pack(code, flag, tier, len(text), length) + text


def decode_reply(head: bytes) -> ReplyHead:
    code, flag, tier, message_len, length = REPLY.unpack(head)
    if message_len > MAX_MESSAGE_BYTES:
        raise WireError(f"malformed data reply (a message of {message_len} bytes)")
    return ReplyHead(code, flag, tier, message_len, length)


__all__ = [
    "HELLO",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_TOKEN_BYTES",
    "NO_PARENT",
    "Op",
    "REPLY",
    "REQUEST",
    "ReplyHead",
    "RequestHead",
    "TICKET_SIZE",
    "TicketHello",
    "WireError",
    "decode_hello",
    "decode_reply",
    "decode_request",
    "encode_hello",
    "encode_reply",
    "encode_request",
]
