"""Chains of chunk keys bound to one namespace, and the sealed objects stored under them, for
tests on the client and the store side alike (plain values: no process, no I/O).

``Chain`` is the one way tests make chained keys: each chunk's hash is derived from its
parent's hash (``kvstore.keys.chunk_hashes``), so key i+1's parent is key i, and the chain
remembers that link for every key it made (``parent_of``), so an object can be sealed with
its parent's hash in its header (``seal``).  The tokens of a chain are a function of its
seed only: the same ``(n, seed)`` gives the same keys, a different seed a different chain.

    CHAIN = Chain(namespace("client-test"))        # 16-token chunks, tag "r0"
    links = CHAIN.links(3, seed=7)                 # tokens (3, 16), hashes, keys
    objs = [CHAIN.seal(key, 2 * MiB, seed=i) for i, key in enumerate(links.keys)]

``tenant`` scopes the keys as a store process does for an authenticated tenant: the chunk
hashes stay those of the unscoped namespace, the key's namespace is ``Namespace.scoped``.

Every object is a real ``kvstore.codec`` object (header, key, payload checksum) with a
payload that depends only on the key and size (``make_object``) or on an explicit seed
(``sealed``), so a test can rebuild the expected bytes and compare a read-back byte for byte.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvstore import codec
from kvstore.keys import ROOT, ChunkHash, Identity, Namespace, ObjectKey, chunk_hashes, object_keys

TOKEN_IDS = 50_000  # token ids of a chain are drawn from [0, TOKEN_IDS)


def namespace(model: str) -> Namespace:
    """The namespace of a one-layer bf16 test identity named ``model``."""
    return Identity(model, "r0", "bf16", "test:opaque", 1, 1, 1).namespace()


class Links(NamedTuple):
    """One chain: ``tokens[i]`` are chunk i's token ids, ``hashes[i]`` its chained hash."""

    tokens: np.ndarray  # shape (n, chunk_tokens)
    hashes: list[ChunkHash]
    keys: list[ObjectKey]


class Chain:
    """Chained keys of one namespace (see the module docstring)."""

    def __init__(self, ns: Namespace, *, chunk_tokens: int = 16, tag: str = "r0", tenant: str = "") -> None:
        self.namespace = ns
        self.chunk_tokens = chunk_tokens
        self.tag = tag
        self.key_namespace = ns.scoped(tenant) if tenant else ns
        self._parents: dict[ObjectKey, ObjectKey | None] = {}

    def scoped(self, tenant: str) -> Chain:
        """The same chains as the store keeps them for ``tenant`` (hashes unchanged)."""
        return Chain(self.namespace, chunk_tokens=self.chunk_tokens, tag=self.tag, tenant=tenant)

    def links(self, n: int, seed: int = 0) -> Links:
        """Tokens, hashes and keys of a chain of ``n`` chunks of random token ids."""
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, TOKEN_IDS, n * self.chunk_tokens).reshape(n, self.chunk_tokens)
        hashes = chunk_hashes(self.namespace, tokens.reshape(-1), self.chunk_tokens)
        keys = object_keys(self.key_namespace, hashes, self.tag)
        self._parents.update(zip(keys, [None, *keys[:-1]]))
        return Links(tokens, hashes, keys)

    def keys(self, n: int, seed: int = 0) -> list[ObjectKey]:
        """The keys of ``links(n, seed)``."""
        return self.links(n, seed).keys

    def parent_of(self, key: ObjectKey) -> ObjectKey | None:
        """The key of ``key``'s parent chunk; None for the first chunk of a chain."""
        return self._parents[key]

    @property
    def made(self) -> set[ObjectKey]:
        """Every key this chain has made so far."""
        return set(self._parents)

    def seal(self, key: ObjectKey, size: int, seed: int) -> np.ndarray:
        """An object of exactly ``size`` bytes under ``key`` (made by this chain), its header
        naming its parent's hash (``ROOT`` for the first chunk), its payload drawn from ``seed``."""
        parent = self.parent_of(key)
        return sealed(key, size, seed, ROOT if parent is None else parent.chunk_hash)


def keys_of(ns: Namespace, n: int, seed: int = 0) -> list[ObjectKey]:
    """Keys of one prefix chain of ``n`` chunks (4 counting tokens each, offset by ``seed``)."""
    return object_keys(ns, chunk_hashes(ns, np.arange(n * 4) + seed * 100_000, 4))


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
