"""The self-describing object format: one byte layout for host slots, Redis, SSD and gRPC.

An object is a fixed 256-byte header followed by the payload::

    header  magic "KVSO", version, header size, codec, dtype, geometry (layers, pages per
            layer, page bytes, tokens), raw and stored payload length, xxh3-128 of the
            stored payload, layout id, key (namespace, chunk hash, tag), parent chunk hash,
            how many of its tokens were generated (zero bytes in older objects: none),
            the MAC's key id and 16-byte keyed MAC (``kvstore.integrity``; zero: not
            sealed), and finally xxh3-64 of all preceding header bytes.  Flag bit 0 of
            the flags field: the stored payload is encrypted (below).
    payload layer-major [layers][pages][page bytes]; pages are opaque (never reinterpreted).

An *encrypted* object (``kvstore.integrity.encrypt``, the copy written to SSD and Redis for a
tenant with encryption at rest) keeps the header's logical fields, key id and MAC, sets the
flag, and stores ``AES-256-GCM(payload in its codec) || tag (16) || nonce (12)``: its stored
length is the plaintext's plus ``AEAD_OVERHEAD``, its checksum that of the stored bytes, so
a tier verifies it like any other object.  ``aead_fields`` is what the tag authenticates
besides the ciphertext.

Encoding and decoding work in caller-provided buffers: the hot path never allocates a
payload-sized buffer.  Every read from a tier goes through ``verify()``; any damage raises a
specific ``ObjectFormatError`` subclass, which the caller turns into a counted miss.
lz4 exists for tiers where a sampled ratio pays (``sample_ratio``); it allocates, so it is
off by default (bf16 KV compresses to ~1.00, see docs/limits.md#compression).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from enum import Enum

import lz4.block
import xxhash

from kvstore.errors import (
    ChecksumMismatchError,
    ConfigError,
    CorruptHeaderError,
    KeyMismatchError,
)
from kvstore.keys import DIGEST_SIZE, ROOT, ChunkHash, ObjectKey

MAGIC = b"KVSO"
VERSION = 1
HEADER_SIZE = 256
_FIELDS = struct.Struct("<4sHHBBHIIQIQQ16s32s32s32sB32s32s")
_EXTRA = struct.Struct("<I")  # after _FIELDS: generated tokens (0 in objects written before it)
_SEAL = struct.Struct("<H16s")  # after _EXTRA: MAC key id (0: unsealed) and MAC
_SEAL_AT = _FIELDS.size + _EXTRA.size
# What the MAC covers besides the payload (``kvstore.integrity``): the header up to the
# namespace, then chunk hash, tag, parent and generated tokens, minus codec/stored length/
# checksum (an lz4 copy keeps its MAC); then the key id.
_NS_AT, _NS_END = 96, 128
_MAC_DOMAIN = b"kvstore-object-mac/1\0"
_AEAD_DOMAIN = b"kvstore-object-aead/1\0"
FLAG_ENCRYPTED = 1
AEAD_TAG, AEAD_NONCE = 16, 12
AEAD_OVERHEAD = AEAD_TAG + AEAD_NONCE  # after the ciphertext: tag, then nonce
_CHECK = struct.Struct("<Q")
_CHECK_AT = HEADER_SIZE - _CHECK.size
assert _SEAL_AT + _SEAL.size <= _CHECK_AT
MAX_OBJECT_BYTES = 1 << 40

_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "uint8", "fp8")


class Codec(Enum):
    NONE = 0
    LZ4 = 1


@dataclass(frozen=True, slots=True)
class ObjectGeometry:
    """Shape of a chunk object's payload: ``num_layers × pages_per_layer × page_bytes``."""

    num_layers: int
    pages_per_layer: int
    page_bytes: int
    dtype: str = "bf16"
    layout_id: str = "opaque"
    num_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "pages_per_layer", "page_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"object geometry {name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(_DTYPES)}")
        if not 0 < len(self.layout_id.encode()) <= 32:
            raise ConfigError("layout id must be 1-32 bytes")
        if self.payload_bytes > MAX_OBJECT_BYTES:
            raise ConfigError("object geometry exceeds the 1 TiB object limit")

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.pages_per_layer * self.page_bytes

    @property
    def layer_bytes(self) -> int:
        return self.pages_per_layer * self.page_bytes


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    key: ObjectKey
    parent: ChunkHash
    geometry: ObjectGeometry
    codec: Codec
    raw_len: int
    stored_len: int
    checksum: bytes
    generated: int = 0  # how many of its tokens an engine generated (the rest were prompt)
    key_id: int = 0  # the MAC's key id (``kvstore.integrity``); 0: not sealed
    mac: bytes = bytes(16)
    encrypted: bool = False  # the stored payload is AES-GCM ciphertext, tag and nonce

    @property
    def total_len(self) -> int:
        return HEADER_SIZE + self.stored_len

    @property
    def plain_len(self) -> int:
        """Stored bytes of the payload in its codec, before encryption."""
        return self.stored_len - AEAD_OVERHEAD if self.encrypted else self.stored_len


def object_size(geometry: ObjectGeometry) -> int:
    """Bytes of an uncompressed object with this geometry (header + payload)."""
    return HEADER_SIZE + geometry.payload_bytes


def payload_view(buf, header: ObjectHeader) -> memoryview:
    return memoryview(buf).cast("B")[HEADER_SIZE : header.total_len]


def layer_view(buf, geometry: ObjectGeometry, layer: int) -> memoryview:
    """The bytes of one layer's pages inside an uncompressed object."""
    if not 0 <= layer < geometry.num_layers:
        raise ConfigError(f"layer {layer} out of range [0, {geometry.num_layers})")
    start = HEADER_SIZE + layer * geometry.layer_bytes
    return memoryview(buf).cast("B")[start : start + geometry.layer_bytes]


def checksum(data) -> bytes:
    return xxhash.xxh3_128_digest(data)


def pack_header(header: ObjectHeader) -> bytes:
    g, key = header.geometry, header.key
    tag = key.tag.encode()
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        header.codec.value,
        _DTYPES.index(g.dtype),
        FLAG_ENCRYPTED if header.encrypted else 0,
        g.num_layers,
        g.pages_per_layer,
        g.page_bytes,
        g.num_tokens,
        header.raw_len,
        header.stored_len,
        header.checksum,
        g.layout_id.encode().ljust(32, b"\0"),
        bytes(key.namespace),
        bytes(key.chunk_hash),
        len(tag),
        tag.ljust(32, b"\0"),
        bytes(header.parent),
    )
    body = (fields + _EXTRA.pack(header.generated) + _SEAL.pack(header.key_id, header.mac)).ljust(_CHECK_AT, b"\0")
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def encode_into(
    buf, key: ObjectKey, geometry: ObjectGeometry, payload=None, parent: ChunkHash = ROOT, generated: int = 0
) -> ObjectHeader:
    """Seal an uncompressed object in ``buf``.

    With ``payload`` it is copied in first; without, the caller already wrote the payload
    at ``buf[HEADER_SIZE:]`` (for example gathered straight from the engine's pages).
    ``generated``: how many of its tokens were generated by the engine (not prompt).
    """
    view = memoryview(buf).cast("B")
    size = object_size(geometry)
    if len(view) < size:
        raise ConfigError(f"buffer of {len(view)} bytes cannot hold a {size}-byte object")
    body = view[HEADER_SIZE:size]
    if payload is not None:
        src = memoryview(payload).cast("B")
        if len(src) != geometry.payload_bytes:
            raise ConfigError(f"payload is {len(src)} bytes, geometry says {geometry.payload_bytes}")
        body[:] = src
    n = geometry.payload_bytes
    header = ObjectHeader(key, parent, geometry, Codec.NONE, n, n, checksum(body), generated)
    view[:HEADER_SIZE] = pack_header(header)
    return header


def decode_header(buf) -> ObjectHeader:
    """Parse and check a header; raise ``CorruptHeaderError`` on any inconsistency."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptHeaderError(f"object shorter than its header ({len(view)} bytes)")
    head = bytes(view[:HEADER_SIZE])
    if head[:4] != MAGIC:
        raise CorruptHeaderError("bad magic: not a kvstore object")
    if _CHECK.unpack_from(head, _CHECK_AT)[0] != xxhash.xxh3_64_intdigest(head[:_CHECK_AT]):
        raise CorruptHeaderError("header checksum mismatch")
    (
        _,
        version,
        hsize,
        codec,
        dtype,
        flags,
        layers,
        pages,
        page_bytes,
        tokens,
        raw_len,
        stored_len,
        digest,
        layout,
        ns,
        chash,
        tag_len,
        tag,
        parent,
    ) = _FIELDS.unpack_from(head)
    if version != VERSION or hsize != HEADER_SIZE:
        raise CorruptHeaderError(f"unsupported object version {version} / header size {hsize}")
    try:
        geometry = ObjectGeometry(layers, pages, page_bytes, _DTYPES[dtype], layout.rstrip(b"\0").decode(), tokens)
        key = ObjectKey.from_bytes(ns + chash + tag[:tag_len])
        codec_e = Codec(codec)
    except (ConfigError, IndexError, ValueError, UnicodeDecodeError) as err:
        raise CorruptHeaderError(f"invalid header field: {err}") from err
    if flags & ~FLAG_ENCRYPTED:
        raise CorruptHeaderError(f"unknown header flags {flags:#x}")
    plain = stored_len - AEAD_OVERHEAD if flags & FLAG_ENCRYPTED else stored_len
    if raw_len != geometry.payload_bytes or plain < 0 or (codec_e is Codec.NONE and plain != raw_len):
        raise CorruptHeaderError("header lengths disagree with its geometry")
    (generated,) = _EXTRA.unpack_from(head, _FIELDS.size)
    if generated > max(tokens, 0):
        raise CorruptHeaderError(f"header says {generated} generated tokens of {tokens}")
    key_id, mac = _SEAL.unpack_from(head, _SEAL_AT)
    return ObjectHeader(
        key,
        ChunkHash(parent),
        geometry,
        codec_e,
        raw_len,
        stored_len,
        digest,
        generated,
        key_id,
        mac,
        bool(flags & FLAG_ENCRYPTED),
    )


def verify(buf, expected_key: ObjectKey | None = None, length: int | None = None) -> ObjectHeader:
    """Check header, length, key and payload checksum of the object in ``buf``."""
    header = decode_header(buf)
    view = memoryview(buf).cast("B")
    if length is not None and length != header.total_len:
        raise CorruptHeaderError(f"object is {length} bytes, header says {header.total_len}")
    if len(view) < header.total_len:
        raise CorruptHeaderError(f"object truncated: {len(view)} of {header.total_len} bytes")
    if expected_key is not None and header.key != expected_key:
        raise KeyMismatchError(f"object holds {header.key!r}, expected {expected_key!r}")
    if checksum(view[HEADER_SIZE : header.total_len]) != header.checksum:
        raise ChecksumMismatchError(f"payload checksum mismatch for {header.key!r}")
    return header


# --- lz4: a cold-path codec for tiers where it pays -------------------------------------


def compress(obj) -> bytes:
    """An LZ4 copy of an uncompressed, verified object (allocates: not for hot paths)."""
    header = verify(obj)
    if header.codec is not Codec.NONE or header.encrypted:
        raise ConfigError(f"object {header.key!r} is already {header.codec.name}-compressed or encrypted")
    packed = lz4.block.compress(payload_view(obj, header), store_size=False)
    new = dataclasses.replace(header, codec=Codec.LZ4, stored_len=len(packed), checksum=checksum(packed))
    return pack_header(new) + packed


def decompress_into(obj, out) -> ObjectHeader:
    """Verify an object of any codec and write its uncompressed form into ``out``."""
    header = verify(obj)
    if header.encrypted:
        raise ConfigError(f"object {header.key!r} is encrypted: decrypt it first (kvstore.integrity)")
    if header.codec is Codec.NONE:
        if len(memoryview(out).cast("B")) < header.total_len:
            raise ConfigError(f"buffer cannot hold a {header.total_len}-byte object")
        memoryview(out).cast("B")[: header.total_len] = memoryview(obj).cast("B")[: header.total_len]
        return header
    try:
        raw = lz4.block.decompress(payload_view(obj, header), uncompressed_size=header.raw_len)
    except lz4.block.LZ4BlockError as err:
        raise ChecksumMismatchError(f"lz4 payload does not decode: {err}") from err
    if len(raw) != header.raw_len:  # a valid stream of the wrong size is damage, not a bad argument
        raise ChecksumMismatchError(f"lz4 payload decodes to {len(raw)} bytes, header says {header.raw_len}")
    new = encode_into(out, header.key, header.geometry, raw, header.parent, header.generated)
    if header.key_id:
        new = set_mac(out, header.key_id, header.mac)
    return new


def sample_ratio(payload, sample_bytes: int = 1 << 20) -> float:
    """Compression ratio (raw/compressed) of an lz4 sample of ``payload``; ≥1.1 may pay."""
    view = memoryview(payload).cast("B")[:sample_bytes]
    return len(view) / max(1, len(lz4.block.compress(view, store_size=False)))


__all__ = [
    "HEADER_SIZE",
    "Codec",
    "ObjectGeometry",
    "ObjectHeader",
    "object_size",
    "encode_into",
    "decode_header",
    "verify",
    "payload_view",
    "layer_view",
    "compress",
    "decompress_into",
    "sample_ratio",
    "DIGEST_SIZE",
]


def rekey(buf, key: ObjectKey, clear_mac: bool = False) -> ObjectHeader:
    """Rewrite the key in a valid object's header in place (header checksum recomputed).

    The store process keeps objects under the tenant-scoped key and clients under their own;
    the payload and its checksum are untouched, so this costs one 256-byte header.
    ``clear_mac``: also drop the MAC (a client of the store process: the store verified it,
    and the client gets the object as it wrote it, see ``kvstore.integrity``).
    """
    view = memoryview(buf).cast("B")
    header = decode_header(view)
    if len(key.tag.encode()) > 32:
        raise ConfigError(f"key tag too long for the header: {key.tag!r}")
    new = dataclasses.replace(header, key=key)
    if clear_mac:
        new = dataclasses.replace(new, key_id=0, mac=bytes(16))
    view[:HEADER_SIZE] = pack_header(new)
    return new


def mac_input(buf, key_id: int) -> tuple[bytes, memoryview]:
    """(header fields, payload) a MAC with ``key_id`` covers in the whole, uncompressed
    object in ``buf`` (``kvstore.integrity``)."""
    view = memoryview(buf).cast("B")
    header = decode_header(view)
    if header.codec is not Codec.NONE or header.encrypted:
        raise ConfigError("a MAC is computed over an uncompressed, unencrypted object")
    if len(view) < header.total_len:
        raise CorruptHeaderError(f"object truncated: {len(view)} of {header.total_len} bytes")
    head = bytes(view[:_SEAL_AT])
    fields = b"".join(
        (_MAC_DOMAIN, head[:8], head[9:40], head[64:_NS_AT], head[_NS_END:], key_id.to_bytes(2, "little"))
    )
    return fields, view[HEADER_SIZE : header.total_len]


def set_mac(buf, key_id: int, mac: bytes) -> ObjectHeader:
    """Write the key id and MAC into a valid object's header (header checksum recomputed)."""
    view = memoryview(buf).cast("B")
    new = dataclasses.replace(decode_header(view), key_id=key_id, mac=bytes(mac))
    view[:HEADER_SIZE] = pack_header(new)
    return new


def aead_fields(buf) -> bytes:
    """What an encrypted object's AES-GCM tag authenticates besides the ciphertext: a domain
    string and every header field but the namespace (``mac_input`` says why), the flags,
    stored length and checksums (they differ between the plaintext and encrypted forms);
    so the codec, key id and MAC are bound too.  Same bytes for both forms of one object."""
    head = bytes(memoryview(buf).cast("B")[:HEADER_SIZE])
    return b"".join((_AEAD_DOMAIN, head[:10], head[12:40], head[64:_NS_AT], head[_NS_END : _SEAL_AT + _SEAL.size]))


def with_payload(header: ObjectHeader, encrypted: bool, stored_len: int, digest: bytes) -> bytes:
    """``header`` packed for the other form of its object (encrypted or not): the flag,
    stored length and payload checksum replaced."""
    return pack_header(dataclasses.replace(header, encrypted=encrypted, stored_len=stored_len, checksum=digest))
