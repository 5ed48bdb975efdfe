"""LMCache's object keys as kvstore object keys; runs in LMCache's server process (no LMCache import).

LMCache addresses an L2 object by ``ObjectKey(chunk_hash, model_name, kv_rank,
object_group_id, cache_salt)``.  Here:

* **Namespace**: an ``Identity`` of LMCache's ``model_name``, the adapter's ``scope`` (the
  tenant scope of the config) and LMCache's ``cache_salt`` (its per-user isolation), so
  objects of other models, scopes or salts are never found.  The store process scopes every
  key to the tenant of the token on top (``kvstore.keys.Namespace.scoped``).
* **Chunk hash**: sha256, in a domain of its own, over LMCache's chunk hash (any length),
  its ``kv_rank`` and ``object_group_id``: one kvstore object per LMCache object.
* **Tag**: ``lmc`` for every object, so a batch of one namespace is one ``Lookup``.

The mapping is one way: a kvstore key does not give LMCache's key back (so the adapter does
not list its keys).
"""

from __future__ import annotations

import hashlib
import json
import struct

from kvstore.keys import ChunkHash, Identity, Namespace, ObjectKey

TAG = "lmc"
LAYOUT_ID = "lmcache-l2-object"
_DOMAIN = b"kvstore/lmcache-l2/key/v1\x00"


def namespace_of(model_name: str, scope: str, cache_salt: str) -> Namespace:
    """The namespace of one model's objects under one scope and cache salt."""
    return Identity(
        model=model_name,
        revision="",
        kv_dtype="lmcache-object",
        layout_id=LAYOUT_ID,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        scope=json.dumps([scope, cache_salt]),
    ).namespace()


def chunk_hash_of(chunk_hash: bytes, kv_rank: int, object_group_id: int) -> ChunkHash:
    """The kvstore chunk hash of one LMCache object (see the module docstring)."""
    fields = struct.pack("<qqI", kv_rank, object_group_id, len(chunk_hash))
    return ChunkHash(hashlib.sha256(_DOMAIN + fields + bytes(chunk_hash)).digest())


class KeyMapper:
    """LMCache keys → kvstore keys for one adapter (its ``scope``), namespaces memoized."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._namespaces: dict[tuple[str, str], Namespace] = {}

    def key(self, chunk_hash: bytes, model_name: str, kv_rank: int, object_group_id: int, cache_salt: str) -> ObjectKey:
        ns_key = (model_name, cache_salt)
        ns = self._namespaces.get(ns_key)
        if ns is None:
            ns = self._namespaces[ns_key] = namespace_of(model_name, self.scope, cache_salt)
        return ObjectKey(ns, chunk_hash_of(chunk_hash, kv_rank, object_group_id), TAG)


__all__ = ["LAYOUT_ID", "TAG", "KeyMapper", "chunk_hash_of", "namespace_of"]
