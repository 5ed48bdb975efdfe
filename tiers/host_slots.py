"""Slots of the host DRAM tier (``tiers.host``): their states and legal transitions, the
per-slot record, and ``SlotOps``: the moves of a slot
through its states (publish, reference, evict, free) and the eviction plan of a put.

Bookkeeping only: ``HostTier`` owns every instance and calls ``SlotOps`` (mixed into it)
with its lock held.

Eviction (only when a put needs room) is prefix-aware: among complete objects with no
reference and no valid lease, chain tails (no child in this tier) go first, and a parent
only when no tail qualifies; within either, in the order of the pool's retention policy
(``tiers.retention``: by default objects used once before reused ones, least recently
used first within each).  The write-down's own hold (``acquire(use=False)``) is not a
use.  Incomplete objects are never evicted.
It plans first: a put evicts only when freeing everything it may evict would leave a hole
it fits in, so a put that cannot fit (NO_ROOM) evicts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kvstore.errors import TierUnavailableError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle, Removal
from tiers.eviction import pick_victim

if TYPE_CHECKING:
    from kvstore.lifecycle import LeaseTable
    from tiers.base import TierStats
    from tiers.host_pool import HostPool


class SlotState(Enum):
    PENDING = "pending"  # reserved and being written: invisible, never evicted
    LIVE = "live"  # complete and in the index
    DOOMED = "doomed"  # deleted while referenced: invisible, freed at the last release
    FREED = "freed"


LEGAL = {
    SlotState.PENDING: frozenset({SlotState.LIVE, SlotState.FREED}),
    SlotState.LIVE: frozenset({SlotState.DOOMED, SlotState.FREED}),
    SlotState.DOOMED: frozenset({SlotState.FREED}),
    SlotState.FREED: frozenset(),
}


@dataclass(slots=True)
class Entry:
    """One slot.  Its requested size lives in the allocator (keeps this object small)."""

    offset: int
    pool: HostPool  # the pool the slot is carved from
    state: SlotState = SlotState.PENDING
    refs: int = 0
    children: int = 0  # LIVE objects naming this one as parent
    parent: Entry | None = None  # the parent's entry when it was LIVE at our commit
    used: float = 0.0  # when last used (the pool's shared stamp: no float each)


def transition(entry: Entry, dst: SlotState) -> None:
    """Move ``entry`` to ``dst``; an illegal transition is a broken invariant."""
    if dst not in LEGAL[entry.state]:
        raise RuntimeError(f"slot at {entry.offset}: illegal {entry.state.name} -> {dst.name}")
    entry.state = dst


class SlotOps:
    """Slot moves of ``HostTier`` (mixed into it; every method runs under its ``_lock``).
    Needs: ``name``, ``_index``, ``_doomed``, ``_leases``, ``_stats``, ``_refs``, ``_on_evict``,
    and ``TierBase``'s ``_stored``/``_removed`` (the residency listener)."""

    # What the host class provides (declared for the type checker; set by ``HostTier``).
    name: str
    _index: dict[ObjectKey, Entry]
    _doomed: dict[ObjectKey, Entry]
    _leases: LeaseTable
    _stats: TierStats
    _refs: int
    _on_evict: Callable[[ObjectKey, memoryview], None] | None
    _stored: Callable[[ObjectKey], None]
    _removed: Callable[[ObjectKey, Removal], None]

    def _view(self, entry: Entry) -> memoryview:
        pool = entry.pool
        if pool.buffer is None:
            raise TierUnavailableError(f"host tier {self.name!r} is closed: its shared pool is released")
        return pool.buffer[entry.offset : entry.offset + pool.alloc.size_of(entry.offset)]

    def _touch(self, key: ObjectKey, entry: Entry, use: bool = True) -> None:
        """A use (a read, a lease, a second save; ``use=False``: the write-down's own hold),
        told to the pool's retention policy."""
        entry.pool.retention.touch(key, entry, self._leases.clock(), use)

    def _hold(self, key: ObjectKey, entry: Entry, use: bool = True) -> None:
        entry.refs += 1
        self._refs += 1
        self._touch(key, entry, use)

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
        entry.pool.alloc.free(entry.offset)

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
        entry.pool.retention.add(handle.key, entry, self._leases.clock())
        entry.pool.hints.published(handle.key, entry.pool.alloc.aligned(handle.size))  # the slot it holds
        self._stats.puts += 1
        self._stats.bytes_written += handle.size
        self._stored(handle.key)

    def _make_room(self, size: int, pool: HostPool) -> int | None:
        """A slot of ``pool`` for ``size`` bytes, evicting victims of that pool until a hole
        fits; None, having evicted nothing, when even evicting all it may would not do."""
        offset = pool.alloc.alloc(size)
        if offset is not None:
            return offset
        first = pick_victim((key, bool(entry.children)) for key, entry in self._evictable(pool))
        if first is None:
            return None
        # The plan: when the first victim's slot alone holds the put, no survey is needed.
        need, size_of = pool.alloc.aligned(size), pool.alloc.size_of
        if pool.alloc.aligned(size_of(self._index[first].offset)) < need and not pool.fits_after_evicting(
            size, (e.offset for _, e in self._evictable(pool))
        ):
            return None
        while (offset := pool.alloc.alloc(size)) is None:
            victim = pick_victim((key, bool(entry.children)) for key, entry in self._evictable(pool))
            if victim is None:
                raise RuntimeError(f"host pool {pool.name!r}: the eviction plan found room it could not make")
            self._evict(victim)
        return offset

    def _evictable(self, pool: HostPool) -> Iterator[tuple[ObjectKey, Entry]]:
        """``(key, entry)`` of the pool's objects neither referenced nor leased, in its
        retention policy's order under the pool's session hints (a linear scan: cheap while the
        first objects are unpinned)."""
        held = self._leases.held
        order = pool.hints.order(pool.retention.order(), self._index)
        return ((key, entry) for key, entry in order if not (entry.refs or held(key)))

    def _evict(self, key: ObjectKey) -> None:
        entry = self._index.pop(key)
        entry.pool.forget(key, evicted=True)
        try:
            if self._on_evict is not None:
                self._on_evict(key, self._view(entry))
        finally:
            self._unlink(entry)
            self._free(entry)
            self._stats.evictions += 1
            entry.pool.evictions += 1
            self._removed(key, Removal.EVICTED)
