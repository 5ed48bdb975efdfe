"""``KVStoreHiCache``: SGLang's ``HiCacheStorage`` (its L3) over kvstore's store core.

Runs inside SGLang's scheduler process, one backend per TP/PP rank, called from its
HiCache controller's prefetch and backup threads.  SGLang builds it through its ``dynamic``
backend (``--hicache-storage-backend dynamic`` with ``module_path`` and ``class_name`` in
the extra config, docs/sglang-hicache.md) as ``KVStoreHiCache(storage_config, kwargs)``.

* **Store.**  A ``TieredStore`` of the connector's tiers (``connector.lower.tier_specs``,
  ``keys_of``): a host staging pool, then the SSD directory, the store process
  (``kvstore serve``, whose tenants the token picks) and Redis, as the extra config says
  (``adapters.sglang_hicache.settings``), on a private I/O loop (``connector.ioloop``).
* **Pages.**  Each SGLang page of each pool is one kvstore object: its bytes exactly as the
  host pool's ``get_data_page(flat=True)`` gives them, parented to the page before it
  (``extra_info.prefix_keys``) for prefix-aware eviction, named as ``names`` says.
* **API.**  v1: ``get``/``batch_get`` (tensors, ``None`` per missing page), ``set``/
  ``batch_set``, ``exists``, ``batch_exists`` (the contiguous prefix present),
  ``batch_get_v1``/``batch_set_v1`` (host pool indices; SGLang uses them when the extra
  config sets ``interface_v1``).  v2, per pool (``register_mem_host_pool_v2``):
  ``batch_exists_v2`` with the ``all_pages`` and ``trailing_pages`` hit policies (KV,
  Mamba and sliding-window pools; ``block_groups`` is refused by name),
  ``batch_get_v2``/``batch_set_v2``.
* **Failures** are misses: a tier error or a damaged object reads as a missing page, so
  SGLang recomputes; bad input (an unknown pool, indices that do not cover the keys) raises
  ``ValueError`` naming it.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from adapters.sglang_hicache.names import Shard, backend_namespaces, format_tag, object_keys, parents
from adapters.sglang_hicache.settings import WHERE, HiCacheSettings, parse_settings
from connector.ioloop import IOLoop, call_before_exit
from connector.lower import keys_of, tier_specs
from kvstore import codec
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkHash, ObjectKey
from kvstore.store.tiered import TieredStore
from tiers.base import PutResult

log = logging.getLogger("kvstore.sglang_hicache")
TIMEOUT_S = 120.0  # one batch call (SGLang batches at most 128 pages)
KV = str(PoolName.KV)
_DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def _shard(cfg: HiCacheStorageConfig) -> Shard:
    return Shard(
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
        attn_cp_rank=cfg.attn_cp_rank,
        attn_cp_size=cfg.attn_cp_size,
        dcp_rank=cfg.dcp_rank,
        dcp_size=cfg.dcp_size,
        logical_page_size=cfg.logical_page_size,
        is_mla=cfg.is_mla_model,
    )


def _flat_bytes(page: torch.Tensor) -> torch.Tensor:
    """A page's bytes as a flat uint8 view (a contiguous copy when it is not contiguous)."""
    return page.detach().contiguous().reshape(-1).view(torch.uint8)


def pool_format(pool: Any) -> dict[str, object]:
    """What changes the bytes of a host pool's pages (the tag's digest, ``names``)."""
    page = pool.get_dummy_flat_data_page()
    return {
        "class": type(pool).__name__,
        "layout": getattr(pool, "layout", None),
        "dtype": str(page.dtype),
        "page_size": getattr(pool, "page_size", None),
        "page_bytes": page.numel() * page.element_size(),
        "format": getattr(pool, "storage_format_tag", None),
    }


class KVStoreHiCache(HiCacheStorage):
    """SGLang's L3 over kvstore (see the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.settings: HiCacheSettings = parse_settings(storage_config.extra_config, env)
        model = self.settings.model or storage_config.model_name or ""
        if not model:
            raise ConfigError(f"{WHERE}: SGLang gave no model name; set `model` so pages of different models never mix")
        self.storage_config = storage_config
        self.namespaces = backend_namespaces(model, self.settings.scope, _shard(storage_config))
        self.registered_pools: dict[str, Any] = {}
        self._tags: dict[str, str] = {}
        self._io = IOLoop("kvstore-hicache")
        cfg = self.settings.tiers
        try:
            self.store: TieredStore = self._io.run(
                TieredStore.open(
                    tier_specs(cfg), cfg.write_policy, required=cfg.lower_tiers_required, keys=keys_of(cfg)
                )
            )
        except BaseException:
            self._io.close()
            raise
        self._closed = False
        call_before_exit(self.close)
        log.info(
            "kvstore HiCache backend: model %s, scope %r, tiers %s",
            model,
            self.settings.scope,
            [t.name for t in self.store.tiers],
        )

    # --- pools ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self._register(str(host_pool_name), host_pool)

    def _register(self, name: str, pool: Any) -> None:
        self.registered_pools[name] = pool
        self._tags[name] = format_tag(name, pool_format(pool))

    def _pool(self, name: str) -> Any:
        try:
            return self.registered_pools[name]
        except KeyError:
            raise ValueError(
                f"HiCache pool {name!r} was never registered with the kvstore backend "
                f"(registered: {sorted(self.registered_pools)})"
            ) from None

    def _keys(self, pool: str, keys: Sequence[str]) -> list[ObjectKey]:
        """Object keys of ``pool``'s pages; a pool never registered (direct v1 calls with
        tensors) has the tag of an empty format."""
        tag = self._tags.get(pool) or format_tag(pool, {})
        return object_keys(self.namespaces.of_pool(pool), tag, list(keys))

    # --- the store, on the I/O loop ------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        return self._io.run(coro, TIMEOUT_S)

    async def _put(self, key: ObjectKey, parent: ChunkHash, page: torch.Tensor, tokens: int) -> bool:
        data = _flat_bytes(page)
        geometry = codec.ObjectGeometry(1, 1, data.numel(), _DTYPES.get(page.dtype, "uint8"), "sglang-page", tokens)
        try:
            result = await self.store.put_payload(key, geometry, memoryview(data.numpy()), parent)
        except KVStoreError as err:
            log.warning("kvstore HiCache: put of %s failed: %s", key.printable(), err)
            return False
        return result in (PutResult.STORED, PutResult.EXISTS)

    async def _get(self, key: ObjectKey, target: torch.Tensor) -> bool:
        want = target.numel() * target.element_size()
        buf = bytearray(codec.object_size(codec.ObjectGeometry(1, 1, want, "uint8", "sglang-page")))
        try:
            got = await self.store.read_into(key, memoryview(buf))
            if got is None:
                return False
            payload = codec.payload_view(buf, codec.decode_header(buf))
        except KVStoreError as err:  # a damaged or foreign object: a miss, never wrong bytes
            log.warning("kvstore HiCache: read of %s failed: %s", key.printable(), err)
            return False
        if len(payload) != want:
            log.warning("kvstore HiCache: %s holds %d bytes, the page has %d", key.printable(), len(payload), want)
            return False
        target.view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return True

    def _put_pages(
        self,
        pool: str,
        keys: Sequence[str],
        pages: Sequence[torch.Tensor],
        extra_info: HiCacheStorageExtraInfo | None,
        tokens: int,
    ) -> list[bool]:
        if len(keys) != len(pages):
            raise ValueError(f"HiCache set: {len(keys)} keys but {len(pages)} pages")
        if not keys:
            return []
        okeys = self._keys(pool, keys)
        prefix = extra_info.prefix_keys if extra_info is not None else None

        async def go() -> list[bool]:
            return list(
                await asyncio.gather(
                    *(self._put(k, p, page, tokens) for k, p, page in zip(okeys, parents(okeys, prefix), pages))
                )
            )

        return self._run(go())

    def _get_pages(self, pool: str, keys: Sequence[str], targets: Sequence[torch.Tensor]) -> list[bool]:
        if len(keys) != len(targets):
            raise ValueError(f"HiCache get: {len(keys)} keys but {len(targets)} target pages")
        if not keys:
            return []
        okeys = self._keys(pool, keys)

        async def go() -> list[bool]:
            return list(await asyncio.gather(*(self._get(k, t) for k, t in zip(okeys, targets))))

        return self._run(go())

    def _page_size(self, pool: str) -> int:
        return int(getattr(self._pool(pool), "page_size", 1) or 1)

    # --- v1 --------------------------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page read into its target tensor (SGLang's ``get_dummy_flat_data_page``; a
        new one of the KV host pool where none is given), or None where the store has none."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if any(t is None for t in targets):
            pool = self._pool(KV)
            targets = [pool.get_dummy_flat_data_page() if t is None else t for t in targets]
        ok = self._get_pages(KV, keys, targets)
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            raise ValueError("HiCache batch_set: no values (the kvstore backend stores the pages it is given)")
        pool = self.registered_pools.get(KV)
        return all(self._put_pages(KV, keys, list(values), None, getattr(pool, "page_size", 0) or 0))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the store holds (a contiguous prefix)."""
        if not keys:
            return 0
        okeys = self._keys(KV, keys)
        return self._run(self.store.lookup(okeys, sized=False)).hits

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._io_pool(KV, keys, host_indices, extra_info, read=True)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._io_pool(KV, keys, host_indices, extra_info, read=False)

    def _io_pool(
        self,
        name: str,
        keys: Sequence[str],
        host_indices: torch.Tensor | None,
        extra_info: HiCacheStorageExtraInfo | None,
        read: bool,
    ) -> list[bool]:
        """Pages between the store and host pool ``name`` at ``host_indices`` (page i at
        ``host_indices[i * page_size]``)."""
        pool, size = self._pool(name), self._page_size(name)
        count = host_indices.numel() if host_indices is not None else 0
        if host_indices is None or count != len(keys) * size:
            raise ValueError(
                f"HiCache pool {name!r}: {len(keys)} pages of {size} tokens need "
                f"{len(keys) * size} host indices, got {count}"
            )
        starts = [int(host_indices[i * size]) for i in range(len(keys))]
        if not read:
            return self._put_pages(name, keys, [pool.get_data_page(s, flat=True) for s in starts], extra_info, size)
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        ok = self._get_pages(name, keys, targets)
        for start, target, hit in zip(starts, targets, ok):
            if hit:
                pool.set_from_flat_data_page(start, target)
        return ok

    # --- v2, per pool ------------------------------------------------------------------------------

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._io_pool(str(t.name), t.keys or [], t.host_indices, extra_info, read=True)
            for t in transfers
        }

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._io_pool(str(t.name), t.keys or [], t.host_indices, extra_info, read=False)
            for t in transfers
        }

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of ``keys``: the KV pages present from the first, cut by each
        extra pool's hit policy (``all_pages``: each of those pages also in that pool;
        ``trailing_pages``: the last ``len(transfer.keys)`` pages before the cut in that pool),
        with every prefix length all pools can restore."""
        for t in pool_transfers or []:
            if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise ValueError(
                    f"HiCache pool {str(t.name)!r}: hit policy {t.hit_policy.value!r} is not "
                    "supported by the kvstore backend (all_pages, trailing_pages)"
                )
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(t.name)
            present = self._run(self.store.present(self._keys(name, keys[:kv_pages])))
            ok = self._restorable(present, t)
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    @staticmethod
    def _restorable(present: list[bool], transfer: PoolTransfer) -> builtins.set[int]:
        """The prefix lengths (in pages) pool ``transfer`` can restore, given which of the KV
        prefix's pages it holds."""
        n = len(present)
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            first_missing = present.index(False) if False in present else n
            return set(range(1, first_missing + 1))
        trailing = max(1, len(transfer.keys or []))
        return {p for p in range(1, n + 1) if all(present[max(0, p - trailing) : p])}

    # --- the rest -----------------------------------------------------------------------------------

    def clear(self) -> bool:
        """Not supported: the store's tiers keep their objects until they evict them (other
        backends may share them); returns False."""
        log.warning("kvstore HiCache backend: clear() is not supported; the store evicts objects itself")
        return False

    def get_stats(self) -> dict[str, object]:
        return self.store.stats()

    def close(self) -> None:
        """Write everything down and close the store (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._io.run(self.store.aclose(), TIMEOUT_S)
        finally:
            self._io.close()


__all__ = ["KVStoreHiCache", "pool_format"]
