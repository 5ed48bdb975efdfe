"""First-fit offset allocator over one contiguous region (pure bookkeeping, no I/O).

Used by ``tiers/host.py`` to carve its one large buffer into slots; runs wherever that tier
runs.  Not thread-safe: its owner locks around it.

* Every slot length is rounded up to ``alignment``; the managed span is ``capacity`` rounded
  down to ``alignment`` (a partial last unit is never handed out).
* Free ranges ("holes") are kept sorted by offset (``bisect``), and a freed slot is merged
  with free neighbours on both sides, so adjacent holes never coexist.
* Each slot's *requested* size is remembered in one array of 8 bytes per alignment unit,
  allocated once: no per-slot Python objects, which keeps the host index small
  (``size_of(offset)``) and makes double frees detectable.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from kvstore.errors import ConfigError


class SlotAllocator:
    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if alignment <= 0:
            raise ConfigError(f"alignment must be positive, got {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment if capacity > 0 else 0
        if self.capacity <= 0:
            raise ConfigError(f"capacity {capacity} holds no {alignment}-byte unit")
        self._starts: list[int] = [0]  # sorted offsets of holes
        self._holes: dict[int, int] = {0: self.capacity}  # hole offset -> length
        # requested size at a slot's first unit; 0 = free
        self._sizes = array("Q", bytes(8 * (self.capacity // alignment)))
        self.used_bytes = 0

    def aligned(self, size: int) -> int:
        """The slot length ``size`` bytes occupy."""
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int | None:
        """Offset of a new slot of at least ``size`` bytes (lowest fitting hole), or None."""
        if size <= 0:
            raise ConfigError(f"allocation size must be positive, got {size}")
        need = self.aligned(size)
        for i, start in enumerate(self._starts):
            if self._holes[start] >= need:
                self._take(i, start, need)
                self._sizes[start // self.alignment] = size
                return start
        return None

    def free(self, offset: int) -> int:
        """Return a slot; the length of the (coalesced) hole that now contains it."""
        size = self.size_of(offset)
        if not size:
            raise RuntimeError(f"free of offset {offset}: unknown or already freed")
        self._sizes[offset // self.alignment] = 0
        length = self.aligned(size)
        self.used_bytes -= length
        return self._add_hole(offset, length)

    def shrink(self, offset: int, size: int) -> None:
        """The slot at ``offset`` now holds only ``size`` bytes (no more than it was given);
        whole units past its new end become free."""
        old = self.size_of(offset)
        if not 0 < size <= old:
            raise RuntimeError(f"shrink of offset {offset} from {old} to {size} bytes")
        self._sizes[offset // self.alignment] = size
        freed = self.aligned(old) - self.aligned(size)
        if freed:
            self.used_bytes -= freed
            self._add_hole(offset + self.aligned(size), freed)

    def size_of(self, offset: int) -> int:
        """Requested size of the slot at ``offset`` (0 when no slot starts there)."""
        if offset < 0 or offset % self.alignment or offset >= self.capacity:
            return 0
        return self._sizes[offset // self.alignment]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        return max(self._holes.values(), default=0)

    def holes(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every hole, by offset."""
        return [(s, self._holes[s]) for s in self._starts]

    def _take(self, i: int, start: int, need: int) -> None:
        rest = self._holes.pop(start) - need
        if rest:
            self._starts[i] = start + need
            self._holes[start + need] = rest
        else:
            del self._starts[i]
        self.used_bytes += need

    def _add_hole(self, start: int, length: int) -> int:
        i = bisect_left(self._starts, start)
        end = start + length
        if i < len(self._starts) and self._starts[i] == end:  # merge the next hole
            length += self._holes.pop(end)
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._holes[prev] == start:  # merge into the previous hole
                self._holes[prev] += length
                return self._holes[prev]
        self._starts.insert(i, start)
        self._holes[start] = length
        return length
