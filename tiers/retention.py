"""Retention policies of the host DRAM tier (``tiers.host``): the order in which a put that
needs room evicts a pool's LIVE objects.

Runs wherever a host tier lives (the engine's connector, the store process).  Bookkeeping
only: each ``tiers.host_pool.HostPool`` owns one policy, and ``tiers.host_slots.SlotOps``
calls it under the tier's lock.  A policy is told of every publish (``add``), use
(``touch``) and removal (``forget``), and answers ``order()``: the LIVE objects, the first
to go first.  It decides nothing else: the tier skips what is protected (referenced,
leased, being written), ``tiers.eviction.pick_victim`` takes the first chain tail of that
order (a parent only when no tail qualifies), and the plan keeps a put that cannot fit
from evicting anything.  So a policy changes which objects stay, never what a lookup of
a held object returns, nor any reader's or lease's guarantee.

Policies (``kvstore.config.RetentionPolicy``: the host tier's ``retention`` option, the
``host_retention`` setting of every store):

* ``REUSE`` (the default): objects used once (stored, not read, leased or saved again
  since) go before reused ones, least recently used first within each class (an LRU-2
  order: a flood of prompts seen once cannot push out the blocks that are reused).  A use
  counts as a reuse only ``reuse_window`` seconds or more after the object's last use; a
  key evicted and stored again joins the reused class (the policy remembers the hashes of
  the keys it evicted, at most twice as many as it holds).
* ``ADAPTIVE``: the two classes of ``REUSE``, each with the share of the pool it may keep
  adapted online to which class's evicted keys come back (ARC's rule, ``AdaptiveRetention``).
* ``LRU``: least recently used first, nothing else (the baseline the others are measured
  against, ``kvstore bench trace``).

Over any policy, ``Hints`` (session hints, ``connector.sessions``): objects of an ended
session go first, objects of a session pinned to come back go last, within a bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kvstore.config import RetentionPolicy
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.keys import ObjectKey


class Slot(Protocol):
    """What a policy needs of an object's record (``tiers.host_slots.Entry``)."""

    used: float  # when last used (a policy's stamp)


Entry = TypeVar("Entry", bound=Slot)


def parse_policy(value: object) -> RetentionPolicy:
    """A policy from itself or its name; ``ConfigError`` naming the option otherwise."""
    if isinstance(value, RetentionPolicy):
        return value
    names = [p.value for p in RetentionPolicy]
    if isinstance(value, str) and value.strip().lower() in names:
        return RetentionPolicy(value.strip().lower())
    raise ConfigError(f"host tier retention must be one of {', '.join(names)}, got {value!r}")


class Retention(Generic[Entry]):
    """Plain LRU (``RetentionPolicy.LRU``), and the interface every policy offers."""

    policy = RetentionPolicy.LRU

    def __init__(self, reuse_window: float) -> None:
        self.reuse_window = reuse_window
        self.objects: dict[ObjectKey, Entry] = {}  # least recently used first
        self._stamp = float("-inf")

    def __len__(self) -> int:
        return len(self.objects)

    def stamp(self, now: float) -> float:
        """``now``, as one float object shared by every use within a sixteenth of the reuse
        window (an object's last-use time then costs it a reference, not a float)."""
        if not now - self._stamp < self.reuse_window / 16:
            self._stamp = float(now)
        return self._stamp

    def add(self, key: ObjectKey, entry: Entry, now: float) -> None:
        """``key`` was published (LIVE now)."""
        entry.used = self.stamp(now)
        self.objects[key] = entry

    def touch(self, key: ObjectKey, entry: Entry, now: float, use: bool) -> None:
        """``key`` was read, acquired, leased or saved again (``use=False``: a hold of the
        store's own, such as the write-down's, which is no reuse)."""
        entry.used = self.stamp(now)
        objects = self.objects
        del objects[key]
        objects[key] = entry  # re-insert: most recently used

    def forget(self, key: ObjectKey, *, evicted: bool) -> None:
        """``key`` left the pool (evicted, or deleted when not ``evicted``)."""
        del self.objects[key]

    def order(self) -> Iterator[tuple[ObjectKey, Entry]]:
        """Every LIVE ``(key, entry)``, the first to evict first (consumed lazily)."""
        return iter(self.objects.items())


class ReuseRetention(Retention[Entry]):
    """``RetentionPolicy.REUSE``: see the module docstring."""

    policy = RetentionPolicy.REUSE

    def __init__(self, reuse_window: float) -> None:
        super().__init__(reuse_window)
        self.objects = {}  # used once (stored, not used since)
        self.reused: dict[ObjectKey, Entry] = {}  # read, leased or saved again since stored
        # Keys evicted, as their hash (at most twice as many as the pool holds, oldest
        # dropped first): one stored again is a reuse.  A hash collision only misplaces an
        # object in the order.
        self.ghosts: OrderedDict[int, bool] = OrderedDict()

    def __len__(self) -> int:
        return len(self.objects) + len(self.reused)

    def add(self, key: ObjectKey, entry: Entry, now: float) -> None:
        returning = self.ghosts.pop(hash(key), False)
        entry.used = self.stamp(now)
        (self.reused if returning else self.objects)[key] = entry

    def touch(self, key: ObjectKey, entry: Entry, now: float, use: bool) -> None:
        """A use of an object used once, ``reuse_window`` or more after its last use, moves
        it to the reused class (uses closer together are one: a lookup, its load, retries)."""
        once = self.objects
        if key in once:
            stamp = self.stamp(now)
            del once[key]
            reuse = use and stamp - entry.used >= self.reuse_window
            (self.reused if reuse else once)[key] = entry
            entry.used = stamp
        else:
            reused = self.reused
            del reused[key]
            reused[key] = entry

    def forget(self, key: ObjectKey, *, evicted: bool) -> None:
        """An evicted key is remembered as a ghost, a deleted one forgotten."""
        if self.objects.pop(key, None) is None:
            del self.reused[key]
        ghosts, mark = self.ghosts, hash(key)
        if not evicted:
            ghosts.pop(mark, None)
            return
        ghosts[mark] = True
        ghosts.move_to_end(mark)
        while len(ghosts) > max(64, 2 * len(self)):
            ghosts.popitem(last=False)

    def order(self) -> Iterator[tuple[ObjectKey, Entry]]:
        """Used-once objects, then reused ones, least recently used first in each."""
        for objects in (self.objects, self.reused):
            yield from objects.items()


class AdaptiveRetention(ReuseRetention[Entry]):
    """``RetentionPolicy.ADAPTIVE``: the two classes of ``REUSE`` (used once, reused; what
    counts as a reuse is the same), but the share of the pool each may keep adapts, as in
    ARC (Megiddo and Modha, FAST'03), to which class's evicted keys come back: each class
    has its own ghosts (hashes of the keys it evicted, at most as many as the pool holds),
    a key stored again that the used-once class evicted raises that class's target share,
    one the reused class evicted lowers it.  The class over its target goes first.  So
    reused objects that stopped being used age out, where ``REUSE`` keeps them forever.
    No parameter beyond ``reuse_window``."""

    policy = RetentionPolicy.ADAPTIVE

    def __init__(self, reuse_window: float) -> None:
        super().__init__(reuse_window)
        self.reused_ghosts: OrderedDict[int, bool] = OrderedDict()  # keys the reused class evicted
        self.target = 0.0  # objects the used-once class may keep before it goes first

    def add(self, key: ObjectKey, entry: Entry, now: float) -> None:
        mark, once_ghosts, reused_ghosts = hash(key), self.ghosts, self.reused_ghosts
        if mark in once_ghosts:
            self.target = min(len(self) + 1.0, self.target + max(len(reused_ghosts) / len(once_ghosts), 1.0))
            del once_ghosts[mark]
        elif mark in reused_ghosts:
            self.target = max(0.0, self.target - max(len(once_ghosts) / len(reused_ghosts), 1.0))
            del reused_ghosts[mark]
        else:
            Retention.add(self, key, entry, now)  # new: used once
            return
        entry.used = self.stamp(now)
        self.reused[key] = entry

    def forget(self, key: ObjectKey, *, evicted: bool) -> None:
        once = self.objects.pop(key, None) is not None
        if not once:
            del self.reused[key]
        mark = hash(key)
        if not evicted:
            self.ghosts.pop(mark, None)
            self.reused_ghosts.pop(mark, None)
            return
        ghosts = self.ghosts if once else self.reused_ghosts
        ghosts[mark] = True
        ghosts.move_to_end(mark)
        while len(ghosts) > max(64, len(self)):
            ghosts.popitem(last=False)

    def order(self) -> Iterator[tuple[ObjectKey, Entry]]:
        """The class over its target share first (the used-once class while it holds more
        than ``target`` objects), then the other; least recently used first in each."""
        once_first = len(self.objects) > self.target or not self.reused
        first, then = (self.objects, self.reused) if once_first else (self.reused, self.objects)
        yield from first.items()
        yield from then.items()


class Hint(Enum):
    """What whoever knows a session says of an object (``connector.sessions``)."""

    NONE = "none"  # back to the policy's own order
    RELEASED = "released"  # its session ended: it goes before every other object
    PINNED = "pinned"  # its session will come back: it goes after every other object


PENDING_HINTS = 4096  # hints waiting for their object to be published (oldest dropped first)


class Hints:
    """Session hints over a pool's retention order (one per pool, under the tier's lock).

    Released objects go first (in the order they were released), then the policy's order
    without the hinted ones, then pinned objects (the oldest pin first).  Pins are bounded:
    pinned bytes stay within ``pin_share`` of the pool, and a pin past it unpins the oldest
    pins, so no client can keep the pool to itself.  A hint on an object not (yet) in the
    pool, such as a save still being gathered, waits until it is published.  Like a policy,
    hints only reorder evictable objects: nothing referenced, leased or being written goes."""

    def __init__(self, capacity_bytes: int, pin_share: float = 0.5) -> None:
        self.released: dict[ObjectKey, None] = {}
        self.pinned: OrderedDict[ObjectKey, int] = OrderedDict()  # key -> bytes, oldest pin first
        self.pinned_bytes = 0
        self.pin_limit = int(capacity_bytes * pin_share)
        self.pending: OrderedDict[ObjectKey, Hint] = OrderedDict()

    def set(self, key: ObjectKey, hint: Hint, size: int | None) -> None:
        """Hint ``key``, an object of ``size`` bytes in the pool (None: not in it yet)."""
        if size is None:
            self.pending.pop(key, None)
            if hint is not Hint.NONE:
                self.pending[key] = hint
                if len(self.pending) > PENDING_HINTS:
                    self.pending.popitem(last=False)
            return
        self.forget(key)
        if hint is Hint.RELEASED:
            self.released[key] = None
        elif hint is Hint.PINNED and size <= self.pin_limit:
            self.pinned[key] = size
            self.pinned_bytes += size
            while self.pinned_bytes > self.pin_limit:
                self.pinned_bytes -= self.pinned.popitem(last=False)[1]

    def published(self, key: ObjectKey, size: int) -> None:
        """``key`` entered the pool: a hint waiting for it applies now."""
        if self.pending:
            hint = self.pending.pop(key, None)
            if hint is not None:
                self.set(key, hint, size)

    def forget(self, key: ObjectKey) -> None:
        """``key`` left the pool (or its hint changes)."""
        self.released.pop(key, None)
        size = self.pinned.pop(key, None)
        if size is not None:
            self.pinned_bytes -= size

    def order(
        self, base: Iterator[tuple[ObjectKey, Any]], index: dict[ObjectKey, Any]
    ) -> Iterator[tuple[ObjectKey, Any]]:
        """``base`` (the policy's order) with the released objects first and the pinned last."""
        released, pinned = self.released, self.pinned
        if not released and not pinned:
            yield from base
            return
        yield from ((key, index[key]) for key in released)
        yield from ((key, entry) for key, entry in base if key not in released and key not in pinned)
        yield from ((key, index[key]) for key in pinned)


def make_retention(policy: RetentionPolicy, reuse_window: float) -> Retention[Any]:
    """A fresh policy of one pool."""
    if policy is RetentionPolicy.REUSE:
        return ReuseRetention(reuse_window)
    if policy is RetentionPolicy.ADAPTIVE:
        return AdaptiveRetention(reuse_window)
    return Retention(reuse_window)


__all__ = [
    "AdaptiveRetention",
    "Hint",
    "Hints",
    "Retention",
    "RetentionPolicy",
    "ReuseRetention",
    "Slot",
    "make_retention",
    "parse_policy",
]
