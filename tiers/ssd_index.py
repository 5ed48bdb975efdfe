"""Bookkeeping of the SSD tier (``tiers.ssd``): what exists, in LRU order, with child
counts, reads in flight and reserved bytes, and which objects a reservation evicts.

No I/O: the tier calls it under its ``_lock`` and removes evicted files afterwards.

**Partitions** (the store process: one per tenant).  With ``partition(key) -> name`` and
``quotas={name: bytes}`` (their sum at most the capacity), a partition's objects and
reservations never exceed its quota, and a put evicts only its own partition's objects,
plus objects of no known partition (a tenant no longer configured: orphans, evicted first).
Each partition's quota is therefore also its guaranteed share: another partition's flood
never evicts it.  A put whose key belongs to no partition never fits.  Eviction plans
first: a reservation that cannot be satisfied evicts nothing.

**Cost.**  A reservation's work is bounded by its own partition: each partition keeps its
own LRU order (``lru``) and the bytes of its objects being read (``reading_by``), so the
evictable bytes are counters and the victims are searched among the partition's own
objects (plus orphans).  Another tenant's many small objects never lengthen a put (they
did: every reservation summed and scanned every object, on the event loop).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum

from kvstore.errors import ConfigError
from kvstore.keys import ObjectKey
from tiers.eviction import pick_victim

Partition = Callable[[bytes], "str | None"]


class _Every(Enum):
    ANY = "any"


ANY = _Every.ANY  # a partition argument meaning "objects of every partition"


@dataclass(slots=True)
class Entry:
    size: int
    parent: ObjectKey | None
    ino: int  # inode of the published file: removals check it, never deleting a newer put
    part: str | None = None  # its partition (None: none, or no partitions at all)


class Index:
    """What exists, in LRU order, with child counts, readers and reservations."""

    def __init__(
        self, capacity: int, partition: Partition | None = None, quotas: Mapping[str, int] | None = None
    ) -> None:
        self.capacity = capacity
        self.partition = partition
        self.quotas = dict(quotas or {})
        if (partition is None) != (quotas is None) or sum(self.quotas.values()) > capacity:
            raise ConfigError(
                f"SSD partitions need a partition function and quotas summing to at most "
                f"the capacity ({sum(self.quotas.values())} > {capacity}?)"
            )
        self.entries: OrderedDict[ObjectKey, Entry] = OrderedDict()  # LRU first
        self.lru: dict[str | None, OrderedDict[ObjectKey, Entry]] = {}  # per partition, LRU first
        self.children: Counter[ObjectKey] = Counter()  # present children per parent key
        self.readers: Counter[ObjectKey] = Counter()  # reads in flight per key
        self.reading_by: Counter[str | None] = Counter()  # bytes of objects being read, per partition
        self.used = 0
        self.reserved = 0
        self.used_by: Counter[str | None] = Counter()  # bytes per partition
        self.reserved_by: Counter[str | None] = Counter()
        self.objects_by: Counter[str | None] = Counter()

    def part_of(self, key: bytes) -> str | None:
        if self.partition is None:
            return None
        part = self.partition(key)
        return part if part in self.quotas else None

    def add(self, key: ObjectKey, entry: Entry) -> None:
        self.remove(key)
        entry.part = self.part_of(key)
        self.entries[key] = entry
        self.lru.setdefault(entry.part, OrderedDict())[key] = entry
        if self.readers[key]:
            self.reading_by[entry.part] += entry.size
        self.used += entry.size
        self.used_by[entry.part] += entry.size
        self.objects_by[entry.part] += 1
        if entry.parent is not None:
            self.children[entry.parent] += 1

    def remove(self, key: ObjectKey, only: Entry | None = None) -> Entry | None:
        """Drop ``key`` (only if its entry is still ``only``, when given)."""
        entry = self.entries.get(key)
        if entry is None or (only is not None and entry is not only):
            return None
        del self.entries[key]
        del self.lru[entry.part][key]
        if self.readers[key]:
            self.reading_by[entry.part] -= entry.size
        self.used -= entry.size
        self.used_by[entry.part] -= entry.size
        self.objects_by[entry.part] -= 1
        if entry.parent is not None:
            self.children[entry.parent] -= 1
            if self.children[entry.parent] <= 0:
                del self.children[entry.parent]
        return entry

    def begin_read(self, key: ObjectKey) -> None:
        """A read of ``key`` (present) starts: pinned against eviction, most recently used."""
        entry = self.entries[key]
        self.readers[key] += 1
        if self.readers[key] == 1:
            self.reading_by[entry.part] += entry.size
        self.entries.move_to_end(key)
        self.lru[entry.part].move_to_end(key)

    def end_read(self, key: ObjectKey) -> None:
        self.readers[key] -= 1
        if self.readers[key] > 0:
            return
        del self.readers[key]
        entry = self.entries.get(key)
        if entry is not None:
            self.reading_by[entry.part] -= entry.size

    def quota_of(self, key: bytes) -> int:
        """The most bytes ``key``'s object may take (the capacity without partitions; 0
        for a key of no partition)."""
        if self.partition is None:
            return self.capacity
        part = self.part_of(key)
        return 0 if part is None else self.quotas[part]

    def reserve(self, size: int, key: bytes | None = None) -> list[tuple[ObjectKey, Entry]] | None:
        """Reserve ``size`` bytes for ``key``, evicting as needed; the evicted entries, or
        None (no room: nothing evicted)."""
        part = None if key is None else self.part_of(key)
        if self.partition is not None and key is not None and part is None:
            return None
        own = self._over(part, size)
        if own > self._evictable_bytes(part) or self._over_all(size) > self._evictable_bytes(part, None):
            return None
        victims = []
        while self._over(part, size) > 0:
            victims.append(self._evict(part))
        while self._over_all(size) > 0:
            victims.append(self._evict(None if self._has_victim(None) else part))
        self.reserved += size
        self.reserved_by[part] += size
        return victims

    def release(self, size: int, key: bytes | None = None) -> None:
        """Give back a reservation (published or abandoned)."""
        self.reserved -= size
        self.reserved_by[None if key is None else self.part_of(key)] -= size

    def trim(self) -> list[tuple[ObjectKey, Entry]]:
        """Evict what exceeds the quotas and the capacity (after a restart with smaller ones):
        a partition's own objects for its quota, then orphans, then anything."""
        victims = []
        for part in list(self.quotas):
            while self.used_by[part] > self.quotas[part] and self._has_victim(part):
                victims.append(self._evict(part))
        for scope in (None, ANY):
            while self.used > self.capacity and self._has_victim(scope):
                victims.append(self._evict(scope))
        return victims

    def partition_stats(self, part: str) -> dict[str, int]:
        return {
            "objects": self.objects_by[part],
            "bytes_used": self.used_by[part],
            "capacity_bytes": self.quotas.get(part, 0),
        }

    # --- internals ----------------------------------------------------------------------

    def _over(self, part: str | None, size: int) -> int:
        """Bytes the partition must free for ``size`` more (0 without partitions)."""
        if part is None:
            return 0
        return self.used_by[part] + self.reserved_by[part] + size - self.quotas[part]

    def _over_all(self, size: int) -> int:
        return self.used + self.reserved + size - self.capacity

    def _candidates(self, part: str | _Every | None) -> Iterator[tuple[ObjectKey, bool]]:
        """``(key, has_children)`` of objects of ``part`` (``ANY``: every partition) not
        being read, LRU first."""
        entries: Mapping[ObjectKey, Entry] = self.entries if part is ANY else self.lru.get(part, {})
        return ((key, bool(self.children[key])) for key in entries if not self.readers[key])

    def _evictable_bytes(self, *parts: str | None) -> int:
        return sum(self.used_by[p] - self.reading_by[p] for p in set(parts))

    def _has_victim(self, part: str | _Every | None) -> bool:
        return next(self._candidates(part), None) is not None

    def _evict(self, part: str | _Every | None) -> tuple[ObjectKey, Entry]:
        """The chain tail of ``part`` not being read, least recently used first; else its
        LRU object not being read."""
        victim = pick_victim(self._candidates(part))
        if victim is None:
            raise RuntimeError("eviction found no victim although enough bytes were evictable")
        entry = self.remove(victim)
        assert entry is not None  # a candidate is an indexed object
        return victim, entry
