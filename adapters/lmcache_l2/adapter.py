"""``KVStoreL2Adapter``: LMCache 0.5.6's ``L2AdapterInterface`` over kvstore's lower tiers.

Runs inside LMCache's multiprocess server, called from its store and prefetch controller
threads.  LMCache builds it through its own ``plugin`` L2 adapter type
(``lmcache.v1.distributed.l2_adapters.plugin_l2_adapter``): ``module_path``
``adapters.lmcache_l2.adapter``, ``class_name`` ``KVStoreL2Adapter``; its config class
``KVStoreL2AdapterConfig`` is found by LMCache's naming convention and parses
``adapter_params`` (``adapters.lmcache_l2.settings``; docs/lmcache-l2.md).

* **Objects.**  Each LMCache ``MemoryObj`` is one kvstore object: its ``byte_array`` exactly,
  named by ``adapters.lmcache_l2.names`` (model, scope, cache salt in the namespace), written
  through to the store process (and, with ``redis_url``/``ssd_dir``, those) by
  ``adapters.lower.LowerStore`` on a private event loop.
* **Tasks.**  ``submit_*`` returns a task id at once; the work runs on that loop; its result
  is kept for ``pop_completed_store_tasks`` / ``query_*_result`` and the operation's event fd
  (three distinct ``EventNotifier``s) is signalled.  A store task succeeds when every object
  is held by some tier (its bytes are the payload bytes); lookup and load answer a ``Bitmap``
  per key.
* **Locks.**  kvstore has no pin that outlives a read, so lookup-and-lock locks nothing and
  ``submit_unlock`` has nothing to release: an object evicted between lookup and load is a
  load miss (bit 0), which LMCache's prefetch controller already handles.
* **Usage** is LMCache's own byte accounting (``_notify_keys_stored``/``_deleted``);
  ``max_capacity_gb`` declares a capacity.  ``delete`` removes the objects from every tier.
  ``list_l2_keys`` is not offered: kvstore keys are one-way digests of LMCache's.
* **Failures** are misses: a failing tier or a damaged object is a bit 0 or a failed store
  task, counted in ``report_status()["counters"]``; bad parameters raise ``ConfigError``
  (a ``ValueError``) naming the key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey as LMCacheKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from adapters.lmcache_l2.names import LAYOUT_ID, KeyMapper
from adapters.lmcache_l2.settings import OWN_KEYS, TIER_KEYS, L2Settings, parse_settings
from adapters.lower import LowerStore
from kvstore.keys import ObjectKey

log = logging.getLogger("kvstore.lmcache_l2")
DELETE_TIMEOUT_S = 60.0


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's parameters (``adapters.lmcache_l2.settings``), as LMCache's config class."""

    def __init__(self, settings: L2Settings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> KVStoreL2AdapterConfig:
        return cls(parse_settings(d))

    @classmethod
    def help(cls) -> str:
        return (
            "kvstore L2 adapter (type plugin, module_path adapters.lmcache_l2.adapter, class_name "
            "KVStoreL2Adapter); adapter_params: " + ", ".join(sorted(TIER_KEYS | OWN_KEYS)) + " (docs/lmcache-l2.md)"
        )


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache's L2 over kvstore (see the module docstring)."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        if not isinstance(config, KVStoreL2AdapterConfig):
            config = KVStoreL2AdapterConfig.from_dict(config)
        settings = config.settings
        super().__init__(max_capacity_bytes=settings.max_capacity_bytes)
        self.settings = settings
        self.names = KeyMapper(settings.scope)
        self.store = LowerStore(settings.tiers, LAYOUT_ID, "lmcache-l2")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._sizes: dict[LMCacheKey, int] = {}  # what this adapter stored: LMCache's usage accounting
        self._closed = False
        log.info("kvstore LMCache L2 adapter: scope %r, tiers %s", settings.scope, [t.name for t in self.store.tiers])

    # --- event fds -------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # --- tasks -----------------------------------------------------------------------------------

    def _task_id(self) -> L2TaskId:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _kv_key(self, key: LMCacheKey) -> ObjectKey:
        return self.names.key(key.chunk_hash, key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)

    def _start(self, table: dict, work: Awaitable[Any], failed: Callable[[], Any], notifier: Any) -> L2TaskId:
        task_id = self._task_id()
        self.store.submit(self._complete(table, task_id, work, failed, notifier))
        return task_id

    async def _complete(
        self, table: dict, task_id: L2TaskId, work: Awaitable[Any], failed: Callable[[], Any], notifier: Any
    ) -> None:
        try:
            result = await work
        except Exception as err:  # noqa: BLE001 - a task that failed is a failed result, never lost
            log.warning("kvstore LMCache L2: task %d failed: %r", task_id, err)
            self.store.counters[f"task:{type(err).__name__}"] += 1
            result = failed()
        with self._lock:
            table[task_id] = result
        notifier.notify()

    async def _each(self, items: list, fn: Callable[[Any], Awaitable[bool]]) -> list[bool]:
        """``fn`` of every item (``LowerStore.each``); an item that raised is a failure, counted."""
        results = await self.store.each(items, fn)
        for r in results:
            if isinstance(r, BaseException):
                self.store.counters[f"task:{type(r).__name__}"] += 1
        return [r is True for r in results]

    def _pop(self, table: dict, task_id: L2TaskId) -> Any:
        with self._lock:
            return table.pop(task_id, None)

    # --- store -----------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[LMCacheKey], objects: list[Any]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"store task: {len(keys)} keys but {len(objects)} objects")
        views = [memoryview(obj.byte_array).cast("B") for obj in objects]
        return self._start(self._stores, self._store(keys, views), lambda: L2StoreResult(False, 0), self._store_efd)

    async def _store(self, keys: list[LMCacheKey], views: list[memoryview]) -> L2StoreResult:
        held = await self._each(list(zip(keys, views)), lambda kv: self._write(self._kv_key(kv[0]), kv[1]))
        with self._lock:
            stored = [(key, len(view)) for key, view, ok in zip(keys, views, held) if ok and key not in self._sizes]
            self._sizes.update(stored)
        if stored:
            self._notify_keys_stored([k for k, _ in stored], [n for _, n in stored])
        ok = all(held)
        return L2StoreResult(ok, sum(len(v) for v in views) if ok else 0)

    async def _write(self, key: ObjectKey, view: memoryview) -> bool:
        return bool(await self.store.write(key, view))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    # --- lookup and lock -------------------------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[LMCacheKey], group_layout_descs: dict) -> L2TaskId:
        return self._start(self._lookups, self._lookup(keys), lambda: Bitmap(len(keys)), self._lookup_efd)

    async def _lookup(self, keys: list[LMCacheKey]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        for i, hit in enumerate(await self.store.present([self._kv_key(k) for k in keys])):
            if hit:
                bitmap.set(i)
        return bitmap

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._lookups, task_id)

    def submit_unlock(self, keys: list[LMCacheKey]) -> None:
        return None  # nothing is pinned (module docstring: Locks)

    # --- load ------------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[LMCacheKey], objects: list[Any]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"load task: {len(keys)} keys but {len(objects)} objects")
        views = [memoryview(obj.byte_array).cast("B") for obj in objects]
        return self._start(self._loads, self._load(keys, views), lambda: Bitmap(len(keys)), self._load_efd)

    async def _load(self, keys: list[LMCacheKey], views: list[memoryview]) -> Bitmap:
        got = await self._each(list(zip(keys, views)), lambda kv: self.store.read(self._kv_key(kv[0]), kv[1]))
        bitmap = Bitmap(len(keys))
        for i, ok in enumerate(got):
            if ok:
                bitmap.set(i)
        loaded = [key for key, ok in zip(keys, got) if ok]
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop(self._loads, task_id)

    # --- delete, status, close -------------------------------------------------------------------

    def delete(self, keys: list[LMCacheKey]) -> None:
        async def remove() -> list[bool]:
            return await self._each(list(keys), lambda key: self.store.delete(self._kv_key(key)))

        removed = self.store.call(remove(), DELETE_TIMEOUT_S)
        gone = [key for key, ok in zip(keys, removed) if ok]
        with self._lock:  # an object stored before this adapter started counts 0 bytes
            sizes = [self._sizes.pop(key, 0) for key in gone]
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        return {
            "is_healthy": not self._closed,
            "tiers": [t.name for t in self.store.tiers],
            "counters": dict(self.store.counters),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.store.close()
        finally:
            for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
                notifier.close()


__all__ = ["KVStoreL2Adapter", "KVStoreL2AdapterConfig"]
