"""Bookkeeping of the SSD tier (``tiers.ssd``): what exists, in LRU order, with child
counts, reads in flight and reserved bytes, and which objects a reservation evicts.

No I/O: the tier calls it under its ``_lock`` and removes evicted files afterwards.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from kvstore.keys import ObjectKey
from tiers.eviction import pick_victim


@dataclass(slots=True)
class Entry:
    size: int
    parent: ObjectKey | None
    ino: int  # inode of the published file: removals check it, never deleting a newer put


class Index:
    """What exists, in LRU order, with child counts, readers and reservations."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[ObjectKey, Entry] = OrderedDict()  # LRU first
        self.children: Counter[ObjectKey] = Counter()  # present children per parent key
        self.readers: Counter[ObjectKey] = Counter()   # reads in flight per key
        self.used = 0
        self.reserved = 0

    def add(self, key: ObjectKey, entry: Entry) -> None:
        self.remove(key)
        self.entries[key] = entry
        self.used += entry.size
        if entry.parent is not None:
            self.children[entry.parent] += 1

    def remove(self, key: ObjectKey, only: Entry | None = None) -> Entry | None:
        """Drop ``key`` (only if its entry is still ``only``, when given)."""
        entry = self.entries.get(key)
        if entry is None or (only is not None and entry is not only):
            return None
        del self.entries[key]
        self.used -= entry.size
        if entry.parent is not None:
            self.children[entry.parent] -= 1
            if self.children[entry.parent] <= 0:
                del self.children[entry.parent]
        return entry

    def reserve(self, size: int) -> list[tuple[ObjectKey, Entry]] | None:
        """Reserve ``size`` bytes, evicting as needed; the evicted entries, or None (no room)."""
        excess = self.used + self.reserved + size - self.capacity
        evictable = sum(e.size for k, e in self.entries.items() if not self.readers[k])
        if excess > evictable:
            return None
        victims = []
        while self.used + self.reserved + size > self.capacity:
            key = self._victim()
            victims.append((key, self.remove(key)))
        self.reserved += size
        return victims

    def _victim(self) -> ObjectKey:
        """The LRU chain tail not being read; else the LRU object not being read."""
        victim = pick_victim((key, bool(self.children[key])) for key in self.entries
                             if not self.readers[key])
        if victim is None:
            raise RuntimeError("eviction found no victim although enough bytes were evictable")
        return victim
