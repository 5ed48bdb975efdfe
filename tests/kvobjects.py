"""Sealed test objects and key chains shared by the tier and store tests.

Every object is a real ``kvstore.codec`` object (header, key, payload checksum) with a
payload that depends only on the key and size (or an explicit seed), so a test can rebuild
the expected bytes and compare a read-back byte for byte.
"""
from __future__ import annotations

import numpy as np

from kvstore import codec
from kvstore.keys import ROOT, ChunkHash, Identity, Namespace, ObjectKey, chunk_hashes, object_keys


def namespace(model: str) -> Namespace:
    return Identity(model, "r0", "bf16", "test:opaque", 1, 1, 1).namespace()


def keys_of(ns: Namespace, n: int, seed: int = 0) -> list[ObjectKey]:
    """Keys of one prefix chain of ``n`` chunks (4 tokens each)."""
    return object_keys(ns, chunk_hashes(ns, np.arange(n * 4) + seed * 100_000, 4))


def chain(ns: Namespace, n: int, seed: int = 0) -> tuple[list[ChunkHash], list[ObjectKey]]:
    """Hashes and keys of a chain of ``n`` random 16-token chunks."""
    hashes = chunk_hashes(ns, np.random.default_rng(seed).integers(0, 50000, n * 16), 16)
    return hashes, object_keys(ns, hashes)


def make_object(key: ObjectKey, size: int) -> np.ndarray:
    """An object of exactly ``size`` bytes whose payload is a function of key and size."""
    return sealed(key, size, size + key[-1] + 256 * key[-2])


def sealed(key: ObjectKey, size: int, seed: int, parent: ChunkHash = ROOT) -> np.ndarray:
    """An object of exactly ``size`` bytes with a payload drawn from ``seed``."""
    geom = codec.ObjectGeometry(1, 1, size - codec.HEADER_SIZE, "bf16", "test:opaque")
    buf = np.empty(size, np.uint8)
    payload = np.random.default_rng(seed).integers(0, 256, geom.payload_bytes, dtype=np.uint8)
    codec.encode_into(buf, key, geom, payload, parent)
    return buf
