"""SGLang's page keys as kvstore object keys; runs in SGLang's scheduler process (no SGLang import).

* **Page hash.**  SGLang names a page by a hex sha256 chained over the pages before it
  (``sglang.srt.mem_cache.utils.get_storage_hash_str``, seeded by the request's namespace of
  ``extra_key`` and ``cache_salt``).  That digest is the object's ``ChunkHash`` as it is, so
  the printable object key shows SGLang's key; any other string is hashed (sha256, its own
  domain) into one.
* **Namespace** (``backend_namespaces``): an ``Identity`` of the model, the rank's shard
  (TP, PP, attention context parallel and decode context parallel ranks), the backend's
  ``scope`` (the tenant) and SGLang's storage layout, so pages of other models, shards or
  tenants are never found.  MLA KV is the same on every TP rank, so KV pages of an MLA model
  use a namespace without the TP rank (``shared``); Mamba states are TP-sharded always.
* **Tag**: the pool's name and a digest of its page format (the host pool's class, layout,
  dtype, page size and bytes), so a page written by a pool of another layout misses instead
  of loading wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from kvstore.keys import ROOT, ChunkHash, Identity, Namespace, ObjectKey

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_DOMAIN = b"kvstore/sglang-hicache/key/v1\x00"
RANK_SHARDED_POOLS = frozenset({"mamba"})  # TP-sharded even where the model's KV is replicated (MLA)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of a model's pages one backend holds (SGLang's ``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    logical_page_size: int | None = None
    is_mla: bool = False


@dataclass(frozen=True, slots=True)
class Namespaces:
    rank: Namespace  # this TP rank's own pages
    shared: Namespace  # pages every TP rank holds alike (MLA KV); == rank for other models

    def of_pool(self, pool: str) -> Namespace:
        return self.rank if pool in RANK_SHARDED_POOLS else self.shared


def backend_namespaces(model: str, scope: str, shard: Shard) -> Namespaces:
    """The namespaces of one backend (see the module docstring)."""
    extra = json.dumps(
        {
            "attn_cp": [shard.attn_cp_rank, shard.attn_cp_size],
            "dcp": [shard.dcp_rank, shard.dcp_size, shard.logical_page_size],
        },
        sort_keys=True,
    )

    def ns(tp_rank: int, tp_size: int) -> Namespace:
        return Identity(
            model=model,
            revision="",
            kv_dtype="sglang-page",
            layout_id="sglang-hicache",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=shard.pp_rank,
            pp_size=shard.pp_size,
            scope=scope,
            engine_config=hashlib.sha256(extra.encode()).hexdigest(),
        ).namespace()

    rank = ns(shard.tp_rank, shard.tp_size)
    return Namespaces(rank, ns(0, 1) if shard.is_mla else rank)


def page_hash(key: str) -> ChunkHash:
    """The ``ChunkHash`` of SGLang's page key (see the module docstring)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"SGLang page key must be a non-empty string, got {key!r}")
    if _HEX64.match(key):
        return ChunkHash(bytes.fromhex(key))
    return ChunkHash(hashlib.sha256(_DOMAIN + key.encode()).digest())


def format_tag(pool: str, page_format: dict[str, object]) -> str:
    """The object tag of ``pool``'s pages in ``page_format`` (at most 28 characters)."""
    digest = hashlib.sha256(json.dumps([pool, page_format], sort_keys=True, default=str).encode()).hexdigest()
    name = re.sub(r"[^A-Za-z0-9_]", "_", pool)[:15] or "pool"
    return f"{name}-{digest[:12]}"


def object_keys(ns: Namespace, tag: str, keys: list[str]) -> list[ObjectKey]:
    return [ObjectKey(ns, page_hash(k), tag) for k in keys]


def parents(keys: list[ObjectKey], prefix_keys: list[str] | None) -> list[ChunkHash]:
    """The parent hash of each page: the page before it, in ``keys`` or the last of
    ``prefix_keys`` (SGLang's pages before the batch), else ``ROOT``."""
    first = page_hash(prefix_keys[-1]) if prefix_keys else ROOT
    return [first, *(ChunkHash(k[32:64]) for k in keys[:-1])]


__all__ = [
    "RANK_SHARDED_POOLS",
    "Namespaces",
    "Shard",
    "backend_namespaces",
    "format_tag",
    "object_keys",
    "page_hash",
    "parents",
]
