"""Protobuf varints, for the few messages the store's client and server encode by hand
(stream frames and the 512-key Lookup request; tests check them against protobuf's own
encoding)."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """The base-128 varint of a non-negative ``n``."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: bytes, pos: int, error: type[Exception] = ValueError) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` and the position after it; ``error`` when it is truncated
    or longer than 64 bits."""
    n = shift = 0
    while pos < len(buf) and shift < 64:
        b = buf[pos]
        n |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return n, pos
        shift += 7
    raise error("truncated varint")
