"""Content-addressed keys: namespaces, chained chunk hashes and object keys.

Used on every side (scheduler, worker, server).  The contract (docs/architecture.md#object-keys):

* ``Namespace`` is a sha256 digest of the canonical encoding of the full computation
  identity (``Identity``) plus the sharing scope (tenant or ``cache_salt``).  Two
  configurations that could produce different KV bytes never share a namespace.
* ``chunk_hash[i] = sha256(DOMAIN || namespace || chunk_hash[i-1] || kind || n_tokens ||
  tokens_i (uint32 little-endian) || extra_keys_i)``, with ``chunk_hash[-1] = ROOT``.
  sha256 is deterministic across processes and hosts; Python's ``hash()`` never appears.
* A namespace scoped to a tenant (``Namespace.scoped``, the store process's keys) starts
  with the tenant's mark (``tenant_mark``: 8 bytes of a sha256 of the tenant's name), so
  whoever holds a scoped key can tell its tenant without a table of namespaces.
* ``ObjectKey`` is ``namespace (32) || chunk_hash (32) || tag``; its bytes are its canonical
  form and ``printable()`` is its one printable form (Redis keys, file names).

``ChunkHash``, ``Namespace`` and ``ObjectKey`` are ``bytes`` subclasses: typed, immutable,
hashable, and as small as possible, because the host index keeps one key per object.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Self

import numpy as np

from kvstore.errors import ConfigError
from kvstore.layout import validate_chunk_size

DIGEST_SIZE = 32
_DOMAIN_NS = b"kvstore/ns/v1\x00"
_DOMAIN_CHUNK = b"kvstore/chunk/v1\x00"
_DOMAIN_TENANT = b"kvstore/tenant/v1\x00"
TENANT_MARK_SIZE = 8
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class _Digest(bytes):
    """A 32-byte digest of one specific meaning (subclasses are distinct types)."""

    __slots__ = ()

    def __new__(cls, raw: bytes) -> Self:
        if len(raw) != DIGEST_SIZE:
            raise ConfigError(f"{cls.__name__} must be {DIGEST_SIZE} bytes, got {len(raw)}")
        return super().__new__(cls, raw)

    @classmethod
    def fromhex(cls, text: str) -> Self:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as err:
            raise ConfigError(f"invalid {cls.__name__} hex {text!r}") from err

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hex()[:16]}…)"

    __str__ = __repr__

    @classmethod
    def _trusted(cls, raw: bytes) -> Self:
        """Construct from a digest we just computed (skips the length check)."""
        return bytes.__new__(cls, raw)


class Namespace(_Digest):
    """Digest of a computation identity plus sharing scope."""

    __slots__ = ()

    def scoped(self, tenant: str) -> Namespace:
        """The effective namespace of ``self`` inside an authenticated tenant."""
        digest = hashlib.sha256(_DOMAIN_NS + b"tenant\x00" + tenant.encode() + b"\x00" + self).digest()
        return Namespace(tenant_mark(tenant) + digest[TENANT_MARK_SIZE:])

    @property
    def mark(self) -> bytes:
        """The tenant mark a scoped namespace starts with (meaningless for an unscoped one)."""
        return bytes(self[:TENANT_MARK_SIZE])


def tenant_mark(tenant: str) -> bytes:
    """The first ``TENANT_MARK_SIZE`` bytes of every namespace scoped to ``tenant``."""
    if not tenant:
        raise ConfigError("tenant must be a non-empty string")
    return hashlib.sha256(_DOMAIN_TENANT + tenant.encode()).digest()[:TENANT_MARK_SIZE]


class ChunkHash(_Digest):
    """The chained hash of one chunk of tokens (and its whole prefix)."""

    __slots__ = ()


ROOT = ChunkHash(bytes(DIGEST_SIZE))


class ChunkKind(Enum):
    FULL = 0
    PARTIAL = 1


@dataclass(frozen=True, slots=True)
class Identity:
    """Everything that changes the bytes of the KV cache, plus the sharing scope.

    ``layout_id`` names backend, page shape, physical layout and block size
    (e.g. ``"cpu:LBHNC:bs128"``); ``scope`` is the tenant or ``cache_salt`` ("" = global).
    ``revision`` is the hub commit (or the revision given), ``weights`` a digest of every
    byte of the config and weight files, ``engine_config`` a digest of the engine settings
    that change KV bytes (``connector.identity``; "" where a caller has none).
    ``weights_version`` names weights updated in memory since the engine loaded its files
    (``connector.epoch``; "" for the files' own weights, untouched).
    """

    model: str
    revision: str
    kv_dtype: str
    layout_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    adapter: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    scope: str = ""
    weights: str = ""
    engine_config: str = ""
    weights_version: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout_id"):
            if not getattr(self, name):
                raise ConfigError(f"identity field {name!r} must not be empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size", "pp_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"identity field {name!r} must be positive")
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError("tp_rank/pp_rank must lie in [0, size)")

    def canonical(self) -> bytes:
        """Canonical encoding: sorted-key compact JSON, UTF-8."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def namespace(self) -> Namespace:
        return Namespace(hashlib.sha256(_DOMAIN_NS + self.canonical()).digest())


def _encode_extra(extra: bytes | str | Sequence[bytes | str] | None) -> bytes:
    if extra is None:
        return b""
    items = [extra] if isinstance(extra, (bytes, str)) else list(extra)
    out = bytearray()
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ConfigError("tokens must be a flat sequence of ids")
    if arr.size and arr.dtype.kind not in "iu":  # floats would truncate into another prompt's key
        raise ConfigError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ConfigError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_hashes(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    chunk_size: int = 256,
    extra_keys: Sequence[bytes | str | Sequence[bytes | str] | None] | None = None,
    include_partial: bool = False,
    parent: ChunkHash = ROOT,
) -> list[ChunkHash]:
    """Chained hashes of the full chunks of ``tokens`` (plus the partial tail if asked).

    ``extra_keys[i]`` (optional) carries what else changes chunk i's KV (multimodal item
    hashes, ...).  A partial tail is hashed with its own kind and length, so it never
    collides with a full chunk.
    """
    validate_chunk_size(chunk_size, 1)
    raw = _tokens_bytes(tokens)
    n_tokens = len(raw) // 4
    n_full = n_tokens // chunk_size
    ends = [chunk_size * (i + 1) for i in range(n_full)]
    if include_partial and n_tokens % chunk_size:
        ends.append(n_tokens)
    out: list[ChunkHash] = []
    start = 0
    base = hashlib.sha256(_DOMAIN_CHUNK + namespace)  # copied per chunk: hashes the prefix once
    full_tag = struct.pack("<BI", ChunkKind.FULL.value, chunk_size)
    view = memoryview(raw)
    for i, end in enumerate(ends):
        h = base.copy()
        h.update(parent)
        if end - start == chunk_size:
            h.update(full_tag)
        else:
            h.update(struct.pack("<BI", ChunkKind.PARTIAL.value, end - start))
        h.update(view[start * 4 : end * 4])
        if extra_keys is not None and i < len(extra_keys):
            h.update(_encode_extra(extra_keys[i]))
        parent = ChunkHash._trusted(h.digest())
        out.append(parent)
        start = end
    return out


class ObjectKey(bytes):
    """``namespace || chunk_hash || tag``: the address of one stored object.

    ``tag`` distinguishes several objects of one chunk (rank, group, layer group);
    it is 1–32 characters of ``[A-Za-z0-9_-]``.
    """

    __slots__ = ()

    def __new__(cls, namespace: Namespace, chunk_hash: ChunkHash, tag: str = "r0") -> ObjectKey:
        if not isinstance(namespace, Namespace) or not isinstance(chunk_hash, ChunkHash):
            raise ConfigError("ObjectKey needs a Namespace and a ChunkHash")
        if not _TAG_RE.fullmatch(tag):  # fullmatch: "$" alone would accept a trailing newline
            raise ConfigError(f"invalid object tag {tag!r}: 1-32 characters of [A-Za-z0-9_-]")
        return super().__new__(cls, namespace + chunk_hash + tag.encode())

    @classmethod
    def from_bytes(cls, raw: bytes) -> ObjectKey:
        if len(raw) <= 2 * DIGEST_SIZE:
            raise ConfigError(f"object key bytes too short ({len(raw)})")
        try:
            tag = raw[2 * DIGEST_SIZE :].decode("ascii")
        except UnicodeDecodeError as err:
            raise ConfigError("object key tag is not ASCII") from err
        return cls(Namespace(raw[:DIGEST_SIZE]), ChunkHash(raw[DIGEST_SIZE : 2 * DIGEST_SIZE]), tag)

    @classmethod
    def parse(cls, text: str) -> ObjectKey:
        """Inverse of ``printable()``."""
        parts = text.split(".")
        if len(parts) != 3:
            raise ConfigError(f"malformed object key {text!r}: expected NS.HASH.TAG")
        key = cls(Namespace.fromhex(parts[0]), ChunkHash.fromhex(parts[1]), parts[2])
        if key.printable() != text:  # fromhex tolerates spaces/upper case: one printable form only
            raise ConfigError(f"object key {text!r} is not in canonical printable form")
        return key

    @property
    def namespace(self) -> Namespace:
        return Namespace(self[:DIGEST_SIZE])

    @property
    def chunk_hash(self) -> ChunkHash:
        return ChunkHash(self[DIGEST_SIZE : 2 * DIGEST_SIZE])

    @property
    def tag(self) -> str:
        return self[2 * DIGEST_SIZE :].decode("ascii")

    def printable(self) -> str:
        """``<namespace hex>.<chunk hash hex>.<tag>``: safe as a file name and a Redis key."""
        return f"{self[:DIGEST_SIZE].hex()}.{self[DIGEST_SIZE : 2 * DIGEST_SIZE].hex()}.{self.tag}"

    def __repr__(self) -> str:
        return f"ObjectKey({self[:4].hex()}….{self[DIGEST_SIZE : DIGEST_SIZE + 6].hex()}….{self.tag})"

    __str__ = __repr__


def object_keys(namespace: Namespace, hashes: Sequence[ChunkHash], tag: str = "r0") -> list[ObjectKey]:
    return [ObjectKey(namespace, h, tag) for h in hashes]
