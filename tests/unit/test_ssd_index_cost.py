"""What one SSD reservation costs (``tiers.ssd_index``): it works through its own partition
only.  Issue 23: with 80,000 small objects of tenant b, each of a's write-throughs summed and
scanned all of them on the store's event loop.  Here b's entries count every time anything
looks at them, and a's reservations, evictions and reads must not."""

from __future__ import annotations

from kvstore.keys import ChunkHash, Namespace, ObjectKey
from tiers.ssd_index import Entry, Index


class Watched(Entry):
    """An entry that counts each look at its partition (every scan reads it)."""

    looks = 0

    @property
    def part(self):
        Watched.looks += 1
        return self._part

    @part.setter
    def part(self, value):
        self._part = value


def key(tenant: str, i: int) -> ObjectKey:
    return ObjectKey(Namespace(tenant.encode().ljust(32, b"\0")), ChunkHash(i.to_bytes(32, "big")), "r0")


def test_a_reservation_never_looks_at_another_partitions_objects():
    b_objects, size = 80_000, 64
    index = Index(10 << 20, partition=lambda k: bytes(k[:1]).decode(), quotas={"a": 64 * 1024, "b": b_objects * size})
    for i in range(b_objects):
        index.add(key("b", i), Watched(size, None, i))
    for i in range(16):  # a's partition, full
        index.add(key("a", i), Entry(4096, key("a", i - 1) if i else None, i))
    index.begin_read(key("a", 15))
    Watched.looks = 0
    for i in range(16, 48):  # a's write-throughs: each evicts a's own
        victims = index.reserve(4096, key("a", i))
        assert victims and all(k[:1] == b"a" for k, _ in victims)
        index.add(key("a", i), Entry(4096, None, i))
        index.release(4096, key("a", i))
    assert index.reserve(64 * 1024, key("a", 99)) is None  # a's pinned object: no room, nothing evicted
    index.end_read(key("a", 15))
    assert Watched.looks == 0  # b's 80,000 objects were never looked at
    assert index.objects_by["b"] == b_objects and index.used_by["a"] == 64 * 1024


def test_reading_pins_count_as_unevictable_bytes_until_the_last_reader_ends():
    index = Index(8192, partition=lambda k: bytes(k[:1]).decode(), quotas={"a": 8192})
    index.add(key("a", 0), Entry(4096, None, 0))
    index.add(key("a", 1), Entry(4096, None, 1))
    index.begin_read(key("a", 0))
    index.begin_read(key("a", 1))
    index.begin_read(key("a", 1))
    assert index.reserve(4096, key("a", 2)) is None  # both pinned
    index.end_read(key("a", 1))
    assert index.reserve(4096, key("a", 2)) is None  # one reader of it remains
    index.end_read(key("a", 1))
    assert [k for k, _ in index.reserve(4096, key("a", 2))] == [key("a", 1)]
    index.remove(key("a", 0))  # removed while read: no longer counted
    index.end_read(key("a", 0))
    assert index.reading_by["a"] == 0 and index.used_by["a"] == 0
