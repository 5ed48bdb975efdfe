"""Host DRAM tier: one large buffer (pinned when CUDA is present) carved into slots.

Runs wherever a store lives (inside the engine's worker, or in the store process); it is the
staging area for every other tier.  Contract of ``tiers.base.Tier`` plus:

* **Zero copy.**  ``put_start`` hands out the slot itself as ``PutHandle.buffer``;
  ``acquire``/``release`` lend a view of a stored slot to readers.
* **No payload checksum here.**  This memory is ours: commit decodes only the 256-byte
  header (key and length must match the handle) and reads never re-hash.  Checksums are
  verified where bytes arrive from a lower tier or the network, before they are put here.
* **Protection.**  A buffer reference (``acquire``, an in-flight ``read_into``) protects the
  *memory*: a referenced slot is never freed, and a referenced object never evicted.  A
  lease protects the *object* from eviction for a TTL; an expiring lease frees nothing.
  ``delete`` removes an object from lookup at once (dropping its leases) and frees its slot
  when the last reference is released ("doomed" until then).
* **Eviction** (only when a put needs room) is prefix-aware: among complete objects with
  no reference and no valid lease, chain tails (no child in this tier) go first, in LRU
  order, and a parent only when no tail qualifies.  Incomplete objects are never evicted.
* **Puts of existing keys.**  ``put_start`` for a key being written, or whose deleted copy
  is still referenced, returns None.  For a key already stored it reserves a slot as usual
  (None only if no room); its commit keeps the stored copy (same key, same bytes), frees
  the new slot and returns True.  Callers check ``contains`` first (``put_bytes`` does).

* **Shared pool** (``shared=True``): the buffer is a file in /dev/shm (``shm_path``) that
  another process maps with ``attach_shared(path, capacity)`` to move slot bytes by offset,
  while this tier keeps all bookkeeping (see ``tiers.host_shm``).  ``close`` unlinks the
  file and releases the mapping; reads then raise ``TierUnavailableError``.

Keys and slots: at most one slot per key is ever *referenced*, so ``release(key)`` is
unambiguous.  Thread-safe: sync methods (``*_sync``, ``acquire``, ``lease``...) may be
called from copy threads; the async methods are thin wrappers for the event loop.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.codec import decode_header
from kvstore.errors import CapacityError, ConfigError, CorruptHeaderError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.lifecycle import Clock, Lease, LeaseTable
from tiers.allocator import SlotAllocator
from tiers.base import PutHandle, TierBase, TierStats
from tiers.eviction import pick_victim
from tiers.host_slots import Entry, SlotState, allocate, transition
from tiers.host_shm import SharedPoolView, attach_shared, create_shared, remove_stale_pools

EvictCallback = Callable[[ObjectKey, memoryview], None]


class HostTier(TierBase):
    """Host DRAM tier over one buffer; see the module docstring for the contract."""

    def __init__(self, capacity_bytes: int, *, alignment: int = 4096, pin: bool | None = None,
                 clock: Clock = time.monotonic, name: str = "host",
                 on_evict: EvictCallback | None = None, shared: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"host tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._alloc = SlotAllocator(capacity_bytes, alignment)
        self._shm: SharedPoolView | None = None
        if shared:
            self._shm = create_shared(capacity_bytes, pin=pin)
            self.array, self.tensor = self._shm.array, self._shm.tensor
        else:
            self.array, self.tensor = allocate(capacity_bytes, pin)
        self.shm_path: str | None = None if self._shm is None else self._shm.path
        # Writable, 1-D, uint8.  None (with array and tensor) once a shared pool is released.
        self.buffer: memoryview | None = memoryview(self.array)
        self._on_evict = on_evict  # called under _lock: must be quick, must not call the tier
        # _lock guards _index, _pending, _doomed, _alloc, _leases, _stats, _refs, _closed, _shm,
        # array/buffer/tensor and every Entry field.  Copies of slot bytes happen outside it,
        # under a reference.
        self._lock = threading.Lock()
        self._index: dict[ObjectKey, Entry] = {}    # LIVE; insertion order = LRU, oldest first
        self._pending: dict[ObjectKey, Entry] = {}  # PENDING
        self._doomed: dict[ObjectKey, Entry] = {}   # DOOMED
        self._leases = LeaseTable(clock=clock)
        self._stats = TierStats(name, capacity_bytes=self._alloc.capacity)
        self._refs = 0
        self._closed = False

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

    def size_of_sync(self, key: ObjectKey) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else self._alloc.size_of(entry.offset)

    def sizes_sync(self, keys: Sequence[bytes]) -> list[int | None]:
        """``size_of_sync`` of every key under ONE lock acquisition (a 512-key Lookup asks
        once, not 512 times).  Like ``size_of``, it neither touches the LRU order nor counts
        hits.  Keys may also be their canonical bytes (the index compares bytes)."""
        with self._lock:
            get, size_of = self._index.get, self._alloc.size_of
            return [None if (entry := get(key)) is None else size_of(entry.offset) for key in keys]

    # --- reads -----------------------------------------------------------------------

    def read_into_sync(self, key: ObjectKey, buf) -> int | None:
        """Copy the object into ``buf`` (memcpy, outside the lock); its length or None."""
        dst = memoryview(buf).cast("B")
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            size = self._alloc.size_of(entry.offset)
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

    def acquire(self, key: ObjectKey) -> memoryview | None:
        """A view of the stored object, valid until ``release(key)``; None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            view = self._view(entry)
            self._hold(key, entry)
            return view

    def pin(self, key: ObjectKey) -> tuple[int, int] | None:
        """Like ``acquire``, for a reader in another process that maps the shared pool:
        ``(offset, size)`` of the object, held until ``release(key)``; None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._hold(key, entry)
            return entry.offset, self._alloc.size_of(entry.offset)

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
        if self._alloc.aligned(size) > self._alloc.capacity:
            raise CapacityError(f"{size}-byte object exceeds host tier {self.name!r} ({self._alloc.capacity} bytes)")
        with self._lock:
            if self._closed:
                raise TierUnavailableError(f"host tier {self.name!r} is closed")
            if key in self._pending or key in self._doomed:
                return None  # a concurrent write, or a deleted copy still referenced
            offset = self._make_room(size)
            if offset is None:
                return None
            entry = self._pending[key] = Entry(offset)
            return PutHandle(key, size, parent, self.buffer[offset : offset + size], entry, offset)

    def put_write_sync(self, handle: PutHandle, offset: int, data) -> None:
        src = memoryview(data).cast("B")
        handle.buffer[offset : offset + len(src)] = src

    def put_commit_sync(self, handle: PutHandle, ok: bool = True) -> bool:
        """Publish the object if ok and its header names ``handle.key`` and ``handle.size``."""
        ok = ok and self._header_matches(handle)
        with self._lock:
            entry = handle.token
            if self._pending.get(handle.key) is not entry:
                raise RuntimeError(f"commit of {handle.key!r}: not pending (committed twice?)")
            del self._pending[handle.key]
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

    def delete_sync(self, key: ObjectKey) -> bool:
        """Remove from lookup now (and drop its leases); free the slot once unreferenced."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._leases.drop_all(key)
            self._unlink(entry)
            if entry.refs:
                transition(entry, SlotState.DOOMED)
                self._doomed[key] = entry
            else:
                self._free(entry)
            return True

    # --- leases ----------------------------------------------------------------------

    def lease(self, key: ObjectKey, ttl: float) -> Lease | None:
        """Protect a stored object from eviction for ``ttl`` seconds; None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._touch(key, entry)
            return self._leases.grant(key, ttl)

    def renew_lease(self, lease_id: int, ttl: float) -> Lease:
        with self._lock:
            return self._leases.renew(lease_id, ttl)

    def release_lease(self, lease_id: int) -> bool:
        with self._lock:
            return self._leases.release_lease(lease_id)

    def check_lease(self, lease_id: int) -> Lease:
        """The lease if still valid; ``LeaseError`` if unknown, released, expired or deleted."""
        with self._lock:
            return self._leases.check(lease_id)

    # --- stats and introspection -----------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            self._leases.sweep()
            extra = {"leases_held": len(self._leases), "leases_expired": self._leases.expired_total,
                     "refs_held": self._refs, "pending": len(self._pending), "doomed": len(self._doomed)}
            return dataclasses.replace(self._stats, objects=len(self._index),
                                       bytes_used=self._alloc.used_bytes, extra=extra)

    def slots(self) -> list[tuple[ObjectKey, int, int, SlotState]]:
        """``(key, offset, size, state)`` of every reserved slot (tests, debugging)."""
        with self._lock:
            groups = (self._index, self._pending, self._doomed)
            return [(k, e.offset, self._alloc.size_of(e.offset), e.state)
                    for group in groups for k, e in group.items()]

    @property
    def allocator(self) -> SlotAllocator:
        return self._alloc

    # --- async Tier protocol: thin wrappers; copies run on the calling thread, so large
    # copies belong on a copy thread through the sync methods ----------------------------

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        return self.lookup_sync(keys)

    async def size_of(self, key: ObjectKey) -> int | None:
        return self.size_of_sync(key)

    async def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        return self.sizes_sync(keys)

    async def read_into(self, key: ObjectKey, buf) -> int | None:
        return self.read_into_sync(key, buf)

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        return self.put_start_sync(key, size, parent)

    async def put_write(self, handle: PutHandle, offset: int, data) -> None:
        self.put_write_sync(handle, offset, data)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        return self.put_commit_sync(handle, ok)

    async def delete(self, key: ObjectKey) -> bool:
        return self.delete_sync(key)

    def close(self) -> None:
        """Refuse new puts.  A private buffer stays readable until the tier is dropped.  A
        shared pool is released: its file is unlinked now (other processes' mappings stay
        valid), reads raise ``TierUnavailableError``, and the mapping is unmapped once no
        view of it is alive (acquired views, in-flight copies, put handles keep it)."""
        with self._lock:
            self._closed = True
            shm, self._shm = self._shm, None
            if shm is not None:
                self.array = self.buffer = self.tensor = None
        if shm is not None:
            shm.close()

    async def aclose(self) -> None:
        """``close()``, for the Tier protocol and ``async with``."""
        self.close()

    async def __aenter__(self) -> HostTier:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # --- internals: caller holds _lock -----------------------------------------------

    def _view(self, entry: Entry) -> memoryview:
        if self.buffer is None:
            raise TierUnavailableError(f"host tier {self.name!r} is closed: its shared pool is released")
        return self.buffer[entry.offset : entry.offset + self._alloc.size_of(entry.offset)]

    def _touch(self, key: ObjectKey, entry: Entry) -> None:
        del self._index[key]
        self._index[key] = entry  # re-insert: most recently used

    def _hold(self, key: ObjectKey, entry: Entry) -> None:
        entry.refs += 1
        self._refs += 1
        self._touch(key, entry)

    def _unhold(self, key: ObjectKey, entry: Entry) -> None:
        if entry.refs <= 0:
            raise RuntimeError(f"release of {key!r}, which holds no reference")
        entry.refs -= 1
        self._refs -= 1
        if not entry.refs and entry.state is SlotState.DOOMED:
            del self._doomed[key]
            self._free(entry)

    def _free(self, entry: Entry) -> None:
        transition(entry, SlotState.FREED)
        self._alloc.free(entry.offset)

    def _unlink(self, entry: Entry) -> None:
        """Leave the chain: the parent (if it was counted) loses a child."""
        if entry.parent is not None:
            entry.parent.children -= 1
            entry.parent = None

    def _publish(self, handle: PutHandle, entry: Entry) -> None:
        transition(entry, SlotState.LIVE)
        parent = self._index.get(handle.parent) if handle.parent is not None else None
        if parent is not None:
            parent.children += 1
            entry.parent = parent
        self._index[handle.key] = entry
        self._stats.puts += 1
        self._stats.bytes_written += handle.size

    def _make_room(self, size: int) -> int | None:
        """A slot for ``size`` bytes, evicting victims until a hole fits; None if impossible."""
        while (offset := self._alloc.alloc(size)) is None:
            victim = self._pick_victim()
            if victim is None:
                return None
            self._evict(victim)
        return offset

    def _pick_victim(self) -> ObjectKey | None:
        """Among objects neither referenced nor leased.  A linear scan from the LRU end:
        cheap while the oldest objects are unpinned."""
        return pick_victim((key, bool(entry.children)) for key, entry in self._index.items()
                           if not (entry.refs or self._leases.held(key)))

    def _evict(self, key: ObjectKey) -> None:
        entry = self._index.pop(key)
        try:
            if self._on_evict is not None:
                self._on_evict(key, self._view(entry))
        finally:
            self._unlink(entry)
            self._free(entry)
            self._stats.evictions += 1

    @staticmethod
    def _header_matches(handle: PutHandle) -> bool:
        """Header only (256 bytes): the payload is not re-hashed in memory we own."""
        try:
            header = decode_header(handle.buffer)
        except CorruptHeaderError:
            return False
        return header.key == handle.key and header.total_len == handle.size


__all__ = ["EvictCallback", "HostTier", "SharedPoolView", "SlotState", "attach_shared",
           "remove_stale_pools"]
