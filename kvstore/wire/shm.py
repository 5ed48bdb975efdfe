"""The wire format of the store process's shared-memory gate (a Unix socket): pure encoders
and decoders, no I/O.  Used by ``kvstore.server.shmgate`` (server) and
``kvstore.client.shmsession`` (client).

A client opens a session with one hello, answered by one reply::

    hello = "KVM1" | u16 token length | ticket (32 bytes, from OpenData) | token (UTF-8)
    reply = u8 code | u8 writable | u16 features | u32 message length | u64 session
            | u64 pool size | message (UTF-8)

Integers are little-endian; ``code`` is a gRPC status code number (0: OK).  With code 0 the
reply carries one file descriptor (``SCM_RIGHTS``): the caller's tenant's pool, ``pool
size`` bytes, writable exactly when ``writable`` is 1.  The client keeps the connection open
while it maps the pool; closing it ends the session (``session`` is its id, named by
``PutStart``).  On a refusal the server closes at once.

``features`` bit 0 (``FEATURE_LEASES``): the session also takes lease requests, the same
host's read without a gRPC round trip (what ``Get`` does: the object's place in the pool and
a lease on it).  The client may send any number of them without waiting; each is answered
once, in any order, by its ``request`` id::

    lease  = u8 op ("L") | u8 key length | u16 0 | u32 lease_ms | u64 request | key
    leased = u8 code | u8 found | u8 tier | u8 0 | u32 lease_ms | u64 request | u64 offset
             | u64 length | u64 lease id | u32 message length | message (UTF-8)

``key`` is the caller's own ``ObjectKey`` bytes, scoped to the session's tenant as on gRPC;
``lease_ms`` 0 asks for the server's default.  ``code`` 0 with ``found`` 0 is a miss; a
non-zero ``code`` is the status ``Get`` would have answered, and ``message`` says why.
Anything else from the client (another op, a key too long, bytes after a partial request)
ends the session.  Without the bit, the client sends nothing after its hello.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.wire.data import HELLO, TICKET_SIZE, TicketHello

MAGIC = b"KVM1"
MAX_MESSAGE_BYTES = 4096
REPLY = struct.Struct("<BBHIQQ")  # code, writable, features, message length, session, pool size
LEASE = struct.Struct("<BBHIQ")  # op, key length, 0, lease_ms, request
LEASED = struct.Struct("<BBBxIQQQQI")  # code, found, tier, lease_ms, request, offset, length, lease id, message length
LEASE_OP = ord("L")
MAX_KEY_BYTES = 128  # an ObjectKey: 64 bytes and a tag of at most 32
FEATURE_LEASES = 1


class ShmWireError(ConfigError):
    """Bytes that are not what the shared-memory gate's format allows."""


@dataclass(frozen=True, slots=True)
class GateReply:
    code: int
    writable: bool
    session: int
    pool_size: int
    message_len: int
    features: int = 0

    @property
    def serves_leases(self) -> bool:
        return bool(self.features & FEATURE_LEASES)


@dataclass(frozen=True, slots=True)
class Leased:
    """One answer to a lease request (``code`` 0 and ``found`` False: a miss)."""

    request: int
    code: int = 0
    found: bool = False
    tier: int = 0
    lease_ms: int = 0
    offset: int = 0
    length: int = 0
    lease_id: int = 0
    message: str = ""


_HELLO = TicketHello(MAGIC, "kvstore shared-memory client", ShmWireError)
encode_hello, decode_hello = _HELLO.encode, _HELLO.decode


def encode_reply(
    code: int = 0, writable: bool = False, session: int = 0, pool_size: int = 0, message: str = "", features: int = 0
) -> bytes:
    text = message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    return REPLY.pack(code, int(writable), features, len(text), session, pool_size) + text


def decode_reply(head: bytes) -> GateReply:
    """The reply's fields; feature bits this client does not know are ignored."""
    code, writable, features, message_len, session, pool_size = REPLY.unpack(head)
    if writable > 1 or message_len > MAX_MESSAGE_BYTES:
        raise ShmWireError("malformed shared-memory gate reply")
    return GateReply(code, bool(writable), session, pool_size, message_len, features)


def encode_lease(key: bytes, lease_ms: int, request: int) -> bytes:
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ConfigError(f"a lease request names a key of 1-{MAX_KEY_BYTES} bytes, got {len(key)}")
    return LEASE.pack(LEASE_OP, len(key), 0, lease_ms, request) + key


def decode_lease_head(head: bytes) -> tuple[int, int, int]:
    """(key length, lease_ms, request) of a lease request's fixed part."""
    op, key_len, zero, lease_ms, request = LEASE.unpack(head)
    if op != LEASE_OP:
        raise ShmWireError(f"not a lease request (op {op:#04x})")
    if zero or not 0 < key_len <= MAX_KEY_BYTES:
        raise ShmWireError(f"malformed lease request (key length {key_len})")
    return key_len, lease_ms, request


def encode_leased(ans: Leased) -> bytes:
    text = ans.message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    return (
        LEASED.pack(
            ans.code,
            int(ans.found),
            ans.tier,
            ans.lease_ms,
            ans.request,
            ans.offset,
            ans.length,
            ans.lease_id,
            len(text),
        )
        + text
    )


def decode_leased_head(head: bytes) -> tuple[Leased, int]:
    """An answer without its message, and the message's length."""
    code, found, tier, lease_ms, request, offset, length, lease_id, message_len = LEASED.unpack(head)
    if found > 1 or message_len > MAX_MESSAGE_BYTES or (found and code):
        raise ShmWireError("malformed lease answer")
    return Leased(request, code, bool(found), tier, lease_ms, offset, length, lease_id), message_len


__all__ = [
    "FEATURE_LEASES",
    "GateReply",
    "HELLO",
    "LEASE",
    "LEASED",
    "Leased",
    "MAGIC",
    "REPLY",
    "ShmWireError",
    "TICKET_SIZE",
    "decode_hello",
    "decode_lease_head",
    "decode_leased_head",
    "decode_reply",
    "encode_hello",
    "encode_lease",
    "encode_leased",
    "encode_reply",
]
