"""How the Redis tier lays one object out in Redis: key names and the manifest codec.

Every object has a manifest, written LAST, which is what makes it visible (lookups read
only manifests: one MGET of 40-byte values).  Its bytes are stored one of two ways:

* **inline** (``size <= part_size``, manifest flag ``INLINE``): the whole object as ONE
  value under a name a reader knows without the manifest, so a read is a single round trip
  (GET manifest and GET value, pipelined)::

      {prefix}m:{key.printable()}                    the manifest, written LAST
      {prefix}i:{key.printable()}                    the object's bytes, exactly

* **parts** (larger objects): ``ceil(size / part_size)`` parts named by the manifest::

      {prefix}m:{key.printable()}                    the manifest, written LAST
      {prefix}p:{key.printable()}:{nonce hex}:{i}    part i: bytes [i*part_size, (i+1)*part_size)

The manifest (40 bytes, little-endian) is ``magic "KVRM", version u16, flags u16, object size
u64, part size u32, part count u32, nonce 8 bytes, xxh3-64 of the preceding 32 bytes``.  The
nonce is random per write, so parts of two writes of one key never mix: a reader only ever
fetches the parts named by the manifest it read.  An inline value carries no nonce: it is
written with SET NX (whole, in one command, so never half there), the first complete copy
of a key stays, and a reader checks it against the manifest's size and the object's own
header and checksum (``codec.verify``).  Part and inline keys carry no hash tag, so a Redis
Cluster spreads them over its slots.  Readers of the first format (no flags) would take an
inline object for a one-part object whose part is gone: upgrade readers before writers.

``DELETE_IF_SAME`` deletes a manifest only while it still holds the exact bytes a reader saw
(a single-key Lua script, so it also runs in a cluster): cleaning up after a lost or corrupt
object never removes a newer write of the same key.  ``pieces`` cuts a write at any offset
into per-part pieces; ``covered`` says whether a put's parts are complete.  Pure functions,
no I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvstore.codec import HEADER_SIZE, MAX_OBJECT_BYTES
from kvstore.errors import CorruptHeaderError
from kvstore.keys import ObjectKey

MAGIC = b"KVRM"
VERSION = 1
INLINE = 1  # flag: the object is the value of inline_key, not parts
_BODY = struct.Struct("<4sHHQII8s")
_CHECK = struct.Struct("<Q")
MANIFEST_SIZE = _BODY.size + _CHECK.size
NONCE_SIZE = 8
MIN_PART = 4096
MAX_PART = 512 << 20

DELETE_IF_SAME = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Manifest:
    """Where one published object's bytes are: ``count`` parts of ``part_size`` bytes."""

    size: int
    part_size: int
    nonce: bytes
    inline: bool = False

    def __post_init__(self) -> None:
        if self.inline and self.size > self.part_size:
            raise CorruptHeaderError(f"an inline object of {self.size} bytes exceeds its part size {self.part_size}")

    @property
    def count(self) -> int:
        return math.ceil(self.size / self.part_size)

    def part_range(self, i: int) -> tuple[int, int]:
        """``[start, end)`` of part ``i`` inside the object."""
        start = i * self.part_size
        return start, min(start + self.part_size, self.size)

    def pack(self) -> bytes:
        flags = INLINE if self.inline else 0
        body = _BODY.pack(MAGIC, VERSION, flags, self.size, self.part_size, self.count, self.nonce)
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def unpack(raw: bytes) -> Manifest:
    """Parse a manifest; ``CorruptHeaderError`` on any damage or inconsistency."""
    if len(raw) != MANIFEST_SIZE:
        raise CorruptHeaderError(f"manifest is {len(raw)} bytes, expected {MANIFEST_SIZE}")
    body = raw[: _BODY.size]
    if _CHECK.unpack_from(raw, _BODY.size)[0] != xxhash.xxh3_64_intdigest(body):
        raise CorruptHeaderError("manifest checksum mismatch")
    magic, version, flags, size, part_size, count, nonce = _BODY.unpack(body)
    if magic != MAGIC or version != VERSION:
        raise CorruptHeaderError(f"not a kvstore manifest (magic {magic!r}, version {version})")
    if flags & ~INLINE:
        raise CorruptHeaderError(f"manifest flags {flags:#x} unknown")
    if not MIN_PART <= part_size <= MAX_PART or not HEADER_SIZE <= size <= MAX_OBJECT_BYTES:
        raise CorruptHeaderError(f"manifest sizes out of range: object {size}, part {part_size}")
    manifest = Manifest(size, part_size, nonce, bool(flags & INLINE))
    if manifest.count != count:
        raise CorruptHeaderError(f"manifest says {count} parts, its sizes make {manifest.count}")
    return manifest


def parse(raw: bytes) -> Manifest | None:
    """``unpack`` that answers None for a damaged manifest."""
    try:
        return unpack(raw)
    except CorruptHeaderError:
        return None


def pieces(manifest: Manifest, offset: int, length: int) -> Iterator[tuple[int, int, int, int]]:
    """``(part, offset in the part, start, end in the data)`` for a write of ``length``
    bytes at ``offset``: one piece per part it touches."""
    pos, end = offset, offset + length
    while pos < end:
        i = pos // manifest.part_size
        part_end = min(manifest.part_range(i)[1], end)
        yield i, pos - i * manifest.part_size, pos - offset, part_end - offset
        pos = part_end


def covered(manifest: Manifest, filled: Sequence[int]) -> bool:
    """Whether ``filled[i]`` bytes written into each part i cover the whole object."""
    return all(n >= end - start for n, (start, end) in zip(filled, map(manifest.part_range, range(manifest.count))))


def manifest_key(prefix: str, key: ObjectKey) -> str:
    return f"{prefix}m:{key.printable()}"


def part_keys(prefix: str, key: ObjectKey, manifest: Manifest) -> list[str]:
    base = f"{prefix}p:{key.printable()}:{manifest.nonce.hex()}:"
    return [f"{base}{i}" for i in range(manifest.count)]


def inline_key(prefix: str, key: ObjectKey) -> str:
    return f"{prefix}i:{key.printable()}"


def data_keys(prefix: str, key: ObjectKey, manifest: Manifest) -> list[str]:
    """The keys holding the object's bytes: its inline value, or its parts in order."""
    return [inline_key(prefix, key)] if manifest.inline else part_keys(prefix, key, manifest)


__all__ = [
    "Manifest",
    "unpack",
    "parse",
    "pieces",
    "covered",
    "manifest_key",
    "part_keys",
    "inline_key",
    "data_keys",
    "INLINE",
    "MANIFEST_SIZE",
    "NONCE_SIZE",
    "DELETE_IF_SAME",
]
