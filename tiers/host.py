"""Host DRAM tier: one large buffer (pinned when CUDA is present) carved into slots.

Runs wherever a store lives (inside the engine's worker, or in the store process); it is the
staging area for every other tier.  Contract of ``tiers.base.Tier`` plus:

* **Zero copy.**  ``put_start`` hands out the slot itself; ``acquire`` lends a view of one.
* **No payload checksum here.**  This memory is ours: commit decodes only the 256-byte
  header (key and length must match the handle) and reads never re-hash.  Checksums are
  verified where bytes arrive from a lower tier or the network, before they are put here.
* **Protection.**  A buffer reference (``acquire``, an in-flight ``read_into``) protects the
  *memory*: a referenced slot is never freed, and a referenced object never evicted.  A
  lease protects the *object* from eviction for a TTL; an expiring lease frees nothing
  (``tiers.host_leases``).
  ``delete`` removes an object from lookup at once (dropping its leases) and frees its slot
  when the last reference is released ("doomed" until then).
* **Eviction** (only when a put needs room): chain tails before parents, then in the order
  of the ``retention`` policy (``tiers.retention``; by default objects used once before
  reused ones, least recently used first); planned first, so a put that cannot fit
  (NO_ROOM) evicts nothing.  The order, and what counts as a reuse: ``tiers.host_slots``.
* **Pools.**  One pool by default (``shared=True``: a file in /dev/shm that another process
  maps, ``tiers.host_shm``; ``close`` unlinks it); with ``pools={name: bytes}`` and
  ``pool_of(key) -> name`` (the store process) a memfd per tenant (``tiers.host_pool``): a
  put takes room, and evicts, only in its key's pool; offsets are within that pool.
* **Puts of existing keys.**  ``put_start`` of a key being written or still referenced after
  its delete returns None; of a key already stored it reserves a slot whose commit keeps the
  stored copy, frees the new slot and returns True (``put_bytes`` checks ``contains`` first).

Keys and slots: at most one slot per key is ever *referenced*, so ``release(key)`` is
unambiguous.  Thread-safe: sync methods (``*_sync``, ``acquire``, ``lease``...) may be
called from copy threads; the async methods are thin wrappers for the event loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvstore.codec import decode_header
from kvstore.errors import CapacityError, ConfigError, CorruptHeaderError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.lifecycle import Clock, LeaseTable
from tiers.allocator import SlotAllocator
from tiers.base import MemoryTierBase, PutHandle, Removal, TierStats
from tiers.host_leases import HostLeases
from tiers.host_pool import HostPool, make_pools
from tiers.host_shm import MemfdPool, SharedPoolView, attach_shared, remove_stale_pools
from tiers.host_slots import Entry, SlotOps, SlotState, transition
from tiers.retention import Hint, RetentionPolicy, parse_policy

if TYPE_CHECKING:
    import numpy as np

EvictCallback = Callable[[ObjectKey, memoryview], None]
PoolOf = Callable[[bytes], "str | None"]


class HostTier(SlotOps, HostLeases, MemoryTierBase):
    """Host DRAM tier over one buffer; see the module docstring for the contract."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        alignment: int = 4096,
        pin: bool | None = None,
        clock: Clock = time.monotonic,
        name: str = "host",
        on_evict: EvictCallback | None = None,
        shared: bool = False,
        pools: Mapping[str, int] | None = None,
        pool_of: PoolOf | None = None,
        reuse_window_s: float = 1.0,
        retention: RetentionPolicy | str = RetentionPolicy.REUSE,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"host tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._pools: dict[str, HostPool] = {}
        self._pool_of = pool_of
        self._reuse_window = reuse_window_s
        self.retention = parse_policy(retention)
        try:
            self._pools.update(
                make_pools(capacity_bytes, alignment, pin, shared, pools, pool_of, reuse_window_s, self.retention)
            )
        except BaseException:
            self._release_pools()
            raise
        one = self._pools.get("") if pools is None else None
        self._one: HostPool | None = one
        self._alloc = one.alloc if one is not None else None
        self.shm_path: str | None = None if one is None else one.path
        # Writable, 1-D, uint8 (one pool only; None with several, and once released).
        self.array: np.ndarray | None = one.array if one is not None else None
        self.tensor: Any = one.tensor if one is not None else None  # a torch view when pinned
        self.buffer: memoryview | None = one.buffer if one is not None else None
        self._on_evict = on_evict  # called under _lock: must be quick, must not call the tier
        # _lock guards _index, _pending, _doomed, _pools (each pool's allocator, LRU and
        # counters), _leases, _stats, _refs, _closed, array/buffer/tensor and every Entry
        # field.  Copies of slot bytes happen outside it, under a reference.
        self._lock = threading.Lock()
        self._index: dict[ObjectKey, Entry] = {}  # LIVE (LRU order lives in each pool)
        self._pending: dict[ObjectKey, Entry] = {}  # PENDING
        self._doomed: dict[ObjectKey, Entry] = {}  # DOOMED
        self._leases = LeaseTable(clock=clock)
        capacity = sum(p.alloc.capacity for p in self._pools.values())
        self._stats = TierStats(name, capacity_bytes=capacity)
        self._refs = 0
        self._closed = False

    def _release_pools(self) -> None:
        for pool in self._pools.values():
            pool.release()

    # --- lookups ---------------------------------------------------------------------

    def lookup_sync(self, keys: Sequence[ObjectKey]) -> int:
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._index:
                n += 1
            return n

    def contains_sync(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._index

    def writing_sync(self, key: ObjectKey) -> bool:
        """Whether a put of ``key`` is in progress (or a deleted copy is still referenced):
        a new ``put_start`` of it would answer None although there may be room."""
        with self._lock:
            return key in self._pending or key in self._doomed

    def hint_sync(self, keys: Sequence[ObjectKey], hint: Hint) -> None:
        """Session hints on ``keys`` (``tiers.retention.Hints``); keys not here yet wait."""
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                pool = entry.pool if entry is not None else self._pool_for(key)
                if pool is not None:
                    pool.hints.set(
                        key, hint, None if entry is None else pool.alloc.aligned(pool.alloc.size_of(entry.offset))
                    )

    def size_of_sync(self, key: ObjectKey) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.pool.alloc.size_of(entry.offset)

    def sizes_sync(self, keys: Sequence[bytes]) -> list[int | None]:
        """``size_of_sync`` of every key under ONE lock acquisition (a 512-key Lookup asks
        once, not 512 times).  Like ``size_of``, it neither touches the LRU order nor counts
        hits.  Keys may also be their canonical bytes (the index compares bytes)."""
        with self._lock:
            get = cast("dict[bytes, Entry]", self._index).get  # ObjectKey is bytes: the index compares bytes
            if self._one is not None:
                size_of = self._one.alloc.size_of
                return [None if (entry := get(key)) is None else size_of(entry.offset) for key in keys]
            return [None if (entry := get(key)) is None else entry.pool.alloc.size_of(entry.offset) for key in keys]

    # --- reads -----------------------------------------------------------------------

    def read_into_sync(self, key: ObjectKey, buf: memoryview) -> int | None:
        """Copy the object into ``buf`` (memcpy, outside the lock); its length or None."""
        dst = memoryview(buf).cast("B")
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            size = entry.pool.alloc.size_of(entry.offset)
            if len(dst) < size:
                raise ConfigError(f"read buffer of {len(dst)} bytes cannot hold {size}")
            src = self._view(entry)  # taken under the lock: close() may drop self.buffer
            self._hold(key, entry)
            self._stats.hits += 1
            self._stats.bytes_read += size
        try:
            dst[:size] = src
        finally:
            with self._lock:
                self._unhold(key, entry)
        return size

    def acquire(self, key: ObjectKey, *, use: bool = True) -> memoryview | None:
        """A view of the stored object, valid until ``release(key)``; None on a miss.
        ``use=False``: a hold of the store's own (the write-down), not a reuse."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            view = self._view(entry)
            self._hold(key, entry, use)
            return view

    def pin(self, key: ObjectKey) -> tuple[int, int] | None:
        """Like ``acquire``, for a reader in another process that maps the shared pool:
        ``(offset, size)`` of the object, held until ``release(key)``; None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._hold(key, entry)
            return entry.offset, entry.pool.alloc.size_of(entry.offset)

    def release(self, key: ObjectKey) -> None:
        with self._lock:
            entry = self._index.get(key) or self._doomed.get(key)
            if entry is None:
                raise RuntimeError(f"release of {key!r}, which holds no reference")
            self._unhold(key, entry)

    # --- two-phase put ---------------------------------------------------------------

    def put_start_sync(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if size <= 0:
            raise ConfigError(f"object size must be positive, got {size}")
        if self._one is not None and self._one.alloc.aligned(size) > self._one.alloc.capacity:
            raise CapacityError(
                f"{size}-byte object exceeds host tier {self.name!r} ({self._one.alloc.capacity} bytes)"
            )
        with self._lock:
            if self._closed:
                raise TierUnavailableError(f"host tier {self.name!r} is closed")
            if key in self._pending or key in self._doomed:
                return None  # a concurrent write, or a deleted copy still referenced
            pool = self._pool_for(key)
            if pool is None or pool.buffer is None:
                return None  # a key no pool takes
            if pool.alloc.aligned(size) > pool.alloc.capacity:
                raise CapacityError(
                    f"{size}-byte object exceeds pool {pool.name!r} of host tier "
                    f"{self.name!r} ({pool.alloc.capacity} bytes)"
                )
            offset = self._make_room(size, pool)
            if offset is None:
                return None
            entry = self._pending[key] = Entry(offset, pool)
            pool.pending += 1
            return PutHandle(key, size, parent, pool.buffer[offset : offset + size], entry, offset)

    def put_write_sync(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        src = memoryview(data).cast("B")
        assert handle.buffer is not None  # a host put always hands out its slot
        handle.buffer[offset : offset + len(src)] = src

    def put_shrink_sync(self, handle: PutHandle, size: int) -> None:
        """A reserved slot turned out to hold a shorter object (a decrypted one,
        ``kvstore.store.promote``): ``handle`` and the slot now cover ``size`` bytes."""
        with self._lock:
            entry = self._pending.get(handle.key)
            if entry is None or entry is not handle.token:
                raise RuntimeError(f"shrink of {handle.key!r}: not pending")
            entry.pool.alloc.shrink(entry.offset, size)
        assert handle.buffer is not None  # a host put always hands out its slot
        handle.size = size
        handle.buffer = handle.buffer[:size]

    def put_commit_sync(self, handle: PutHandle, ok: bool = True) -> bool:
        """Publish the object if ok and its header names ``handle.key`` and ``handle.size``."""
        ok = ok and self._header_matches(handle)
        with self._lock:
            entry = self._pending.get(handle.key)
            if entry is None or entry is not handle.token:
                raise RuntimeError(f"commit of {handle.key!r}: not pending (committed twice?)")
            del self._pending[handle.key]
            entry.pool.pending -= 1
            if not ok or handle.key in self._doomed:
                self._stats.put_failures += 1
                self._free(entry)
                return False
            if handle.key in self._index:  # stored meanwhile: keep that copy
                self._free(entry)
                self._touch(handle.key, self._index[handle.key])
                return True
            self._publish(handle, entry)
            return True

    def delete_sync(self, key: ObjectKey, reason: Removal = Removal.DELETED) -> bool:
        """Remove from lookup now (and drop its leases); free the slot once unreferenced.
        ``reason``: what the residency listener is told (``CORRUPT`` for a damaged object)."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            entry.pool.forget(key, evicted=False)
            self._leases.drop_all(key)
            self._unlink(entry)
            if entry.refs:
                transition(entry, SlotState.DOOMED)
                self._doomed[key] = entry
            else:
                self._free(entry)
            self._removed(key, reason)
            return True

    def clear_sync(self, reason: Removal = Removal.DELETED) -> int:
        """Remove every published object (``delete_sync`` each: a slot still referenced is
        freed once released); puts in flight are left to finish.  Returns how many."""
        with self._lock:
            keys = list(self._index)
        return sum(self.delete_sync(key, reason) for key in keys)

    # --- stats and introspection -----------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            self._leases.sweep()
            extra: dict[str, float] = {
                "leases_held": len(self._leases),
                "leases_expired": self._leases.expired_total,
                "refs_held": self._refs,
                "pending": len(self._pending),
                "doomed": len(self._doomed),
            }
            used = sum(p.alloc.used_bytes for p in self._pools.values())
            return dataclasses.replace(self._stats, objects=len(self._index), bytes_used=used, extra=extra)

    def pool_stats(self, pool: str) -> dict[str, int]:
        """Objects, bytes used, capacity, evictions and pending puts of one pool."""
        with self._lock:
            return self._pools[pool].stats()

    @property
    def pools(self) -> list[str]:
        return list(self._pools)

    def pool_of(self, key: bytes) -> str | None:
        """The name of the pool ``key`` lives in (or would be put in); None: no pool takes it."""
        pool = self._pool_for(key)
        return None if pool is None else pool.name

    def pool_memfd(self, pool: str) -> MemfdPool:
        """The memfd of one pool of a tier built with ``pools`` (to hand to its clients)."""
        with self._lock:
            memfd = self._pools[pool].memfd
        if memfd is None:
            raise TierUnavailableError(f"pool {pool!r} of host tier {self.name!r} has no descriptor")
        return memfd

    def slots(self) -> list[tuple[ObjectKey, int, int, SlotState]]:
        """``(key, offset, size, state)`` of every reserved slot (tests, debugging)."""
        with self._lock:
            groups = (self._index, self._pending, self._doomed)
            return [
                (k, e.offset, e.pool.alloc.size_of(e.offset), e.state) for group in groups for k, e in group.items()
            ]

    @property
    def allocator(self) -> SlotAllocator:
        """The allocator of a one-pool tier."""
        if self._alloc is None:
            raise RuntimeError(f"host tier {self.name!r} has several pools: no single allocator")
        return self._alloc

    def close(self) -> None:
        """Refuse new puts.  A private buffer stays readable until the tier is dropped.  A
        shared pool is released: its file is unlinked now (other processes' mappings stay
        valid), reads raise ``TierUnavailableError``, and the mapping is unmapped once no
        view of it is alive (acquired views, in-flight copies, put handles keep it)."""
        with self._lock:
            self._closed = True
            shared = [p for p in self._pools.values() if p.shm is not None]
            if shared and self._one is not None:
                self.array = self.buffer = self.tensor = None
        for pool in shared:
            pool.release()

    async def aclose(self) -> None:
        """``close()``, for the Tier protocol and ``async with``."""
        self.close()

    # --- internals: caller holds _lock -----------------------------------------------

    def _pool_for(self, key: bytes) -> HostPool | None:
        if self._one is not None:
            return self._one
        assert self._pool_of is not None  # make_pools refuses pools without a pool_of
        name = self._pool_of(key)
        return None if name is None else self._pools.get(name)

    @staticmethod
    def _header_matches(handle: PutHandle) -> bool:
        """Header only (256 bytes): the payload is not re-hashed in memory we own."""
        try:
            header = decode_header(handle.buffer)
        except CorruptHeaderError:
            return False
        return header.key == handle.key and header.total_len == handle.size


__all__ = ["EvictCallback", "HostTier", "SharedPoolView", "SlotState", "attach_shared", "remove_stale_pools"]
