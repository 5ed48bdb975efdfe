"""The KV events of a store: what each of its tiers holds, as ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events (``kvstore.wire.kv``).

Runs wherever a store core runs: the connector's scheduler process (events handed to vLLM's
own publisher) and the store process (its own publisher, one stream per tenant).

Two sources meet here:

* **Residency**, from the tiers themselves (``tiers.base.Residency``): each tier says what it
  publishes and what it drops, and why (evicted, expired, corrupt, deleted).  That is the
  truth of what lives where; the recorder is the listener of every tier it is attached to.
* **Descriptions**, from whoever knows an object's tokens (``describe``): the connector's
  scheduler when it plans a save or finds a hit (the request's tokens are at hand), the
  store process when a client describes what it put or read (the ``Describe`` RPC).  A
  store only knows keys and bytes, so this is the only way tokens reach an event.

An object is *announced* in a tier (``BlockStored``) once it is both there and described,
whichever comes first; it is announced removed (``BlockRemoved``, with the reason) only if it
was announced there.  So a subscriber never sees an event it cannot use: every
``BlockStored`` carries its tokens, and no ``BlockRemoved`` names a block it never saw.  What
stays undescribed (an SSD object that survived a restart, until a lookup or a put describes
it again) is counted in ``undescribed`` and never announced.

Bounds: one entry per object held by an attached tier (its description, 4 bytes a token,
and where it is); descriptions of objects no tier holds (described before their put, or
after their removal) are kept for the last ``spare`` of them per stream (one stream's
descriptions never push out another's); events not yet taken for the last ``max_pending``
(older ones are dropped and counted: a publisher that stopped taking them must not grow the
process).  With ``budget`` (the store process: each tenant's quota), the descriptions a
stream holds (of held objects and spare ones alike) are counted in entries and bytes
(``cost``: the tokens' 4 bytes each plus ``ENTRY_COST`` for the entry itself); a new
description beyond the stream's budget first pushes out that stream's own spare ones and,
when they are not enough, is refused (``DescriptionRefused``, a ``CapacityError``, naming
the budget exceeded).

Thread-safe: tiers call in from any thread with their own lock held, so ``_lock`` is taken
last and nothing here calls a tier while holding it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvstore.errors import CapacityError
from kvstore.keys import ChunkHash, ObjectKey
from kvstore.wire.kv import Description, Kind, KVEvent, Medium, wire_hash
from tiers.base import Removal, Tier, listen

StreamOf = Callable[[ObjectKey], "str | None"]
Budget = Callable[[str], "tuple[int, int]"]  # stream -> (description bytes, entries) it may hold
ENTRY_COST = 256  # bytes a description costs beyond its tokens: entry, key, array header (an estimate)


class DescriptionRefused(CapacityError):
    """A description beyond its stream's budget; ``what``: ``described_bytes`` or
    ``described`` (the quota exceeded)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


def cost(desc: Description) -> int:
    """Bytes a description is counted for (see the module docstring)."""
    return ENTRY_COST + 4 * len(desc.tokens) + len(desc.lora or "")


class _Entry:
    """One object some attached tier holds: its description and, per tier, whether it was
    announced there."""

    __slots__ = ("desc", "tiers")

    def __init__(self, desc: Description | None) -> None:
        self.desc = desc
        self.tiers: dict[str, bool] = {}


class EventRecorder:
    """Residency listener and event source (see the module docstring).  ``media``: tier name
    → its ``Medium`` (tiers not named are not followed); ``stream_of(key)``: the stream
    (tenant) of a key, None for a key no stream publishes; ``group_idx``: the engine's KV
    cache group, when the publisher knows it."""

    def __init__(
        self,
        media: Mapping[str, Medium],
        *,
        stream_of: StreamOf | None = None,
        group_idx: int | None = None,
        spare: int = 4096,
        max_pending: int = 100_000,
        budget: Budget | None = None,
    ) -> None:
        self.media = dict(media)
        self._stream_of = stream_of or (lambda key: "")
        self._group = group_idx
        self._spare_max = spare
        self._budget = budget
        # _lock guards _entries, _spare, _pending, the counters below and held_bytes/held.
        self._lock = threading.Lock()
        self._entries: dict[ObjectKey, _Entry] = {}
        self._spare: dict[str | None, OrderedDict[ObjectKey, Description]] = {}
        self.held_bytes: Counter[str | None] = Counter()  # stream -> bytes of its descriptions
        self.held: Counter[str | None] = Counter()  # stream -> its descriptions
        self._pending: deque[KVEvent] = deque(maxlen=max_pending)
        self.counts: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0, "dropped": 0, "undescribed": 0}

    # --- set-up -------------------------------------------------------------------------

    def attach(self, tiers: Iterable[Tier]) -> None:
        """Listen to every tier named in ``media``; objects a tier already holds (an SSD
        directory after a restart) are known from now on, announced once described."""
        for tier in tiers:
            if tier.name not in self.media:
                continue
            for key in getattr(tier, "keys", lambda: [])():
                self.stored(tier.name, key)
            listen(tier, self)

    def clear(self, streams: Iterable[str]) -> None:
        """Start an epoch: ``AllBlocksCleared`` on each stream (whatever an earlier epoch of
        this publisher announced is gone or will be announced again)."""
        with self._lock:
            for stream in streams:
                self._emit(KVEvent(Kind.CLEARED, stream))
                self.counts["cleared"] += 1

    # --- descriptions -------------------------------------------------------------------

    def describe(
        self, key: ObjectKey, parent: ChunkHash | None, tokens: Sequence[int], lora: str | None = None
    ) -> None:
        """``key`` holds the KV of ``tokens`` after chunk ``parent`` (None: a chain's first).
        Announces it in every tier that already holds it."""
        with self._lock:
            entry = self._entries.get(key)
            stream = self._stream_of(key)
            if entry is None:
                spare = self._spare.setdefault(stream, OrderedDict())
                if key not in spare:
                    desc = Description.of(parent, tokens, lora)
                    self._count(stream, desc)
                    spare[key] = desc
                    if len(spare) > self._spare_max:
                        self._uncount(stream, spare.popitem(last=False)[1])
                return
            if entry.desc is not None:
                return
            desc = Description.of(parent, tokens, lora)
            self._count(stream, desc)
            entry.desc = desc
            for tier, announced in entry.tiers.items():
                if not announced:
                    entry.tiers[tier] = True
                    self.counts["undescribed"] -= 1
                    self._stored_event(key, entry.desc, tier)

    def description(self, key: ObjectKey) -> Description | None:
        """What ``describe`` said of ``key`` (None: nothing, or forgotten)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.desc is not None:
                return entry.desc
            return self._spare.get(self._stream_of(key), OrderedDict()).get(key)

    # --- residency (tiers.base.Residency) ------------------------------------------------

    def stored(self, tier: str, key: ObjectKey) -> None:
        if tier not in self.media:
            return
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(self._spare.get(self._stream_of(key), OrderedDict()).pop(key, None))
            if tier in entry.tiers:
                return
            entry.tiers[tier] = entry.desc is not None
            if entry.desc is None:
                self.counts["undescribed"] += 1
            else:
                self._stored_event(key, entry.desc, tier)

    def removed(self, tier: str, key: ObjectKey, reason: Removal) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or tier not in entry.tiers:
                return
            if entry.tiers.pop(tier):
                self._emit(
                    KVEvent(
                        Kind.REMOVED,
                        self._stream_of(key),
                        self.media[tier],
                        wire_hash(key.chunk_hash),
                        reason=reason.value,
                        group_idx=self._group,
                    )
                )
                self.counts["removed"] += 1
            else:
                self.counts["undescribed"] -= 1
            if not entry.tiers:
                del self._entries[key]
                if entry.desc is not None:
                    stream = self._stream_of(key)
                    spare = self._spare.setdefault(stream, OrderedDict())
                    spare[key] = entry.desc
                    if len(spare) > self._spare_max:
                        self._uncount(stream, spare.popitem(last=False)[1])

    # --- events -------------------------------------------------------------------------

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        with self._lock:
            events = list(self._pending)
            self._pending.clear()
        return events

    def holdings(self) -> dict[str, int]:
        """Objects known per tier (described or not)."""
        with self._lock:
            out: dict[str, int] = {}
            for entry in self._entries.values():
                for tier in entry.tiers:
                    out[tier] = out.get(tier, 0) + 1
            return out

    def _count(self, stream: str | None, desc: Description) -> None:
        """Count ``desc`` against ``stream``'s budget, pushing out its own spare descriptions
        (oldest first) to make room; ``DescriptionRefused`` when that is not enough.
        Caller holds ``_lock``."""
        size = cost(desc)
        if self._budget is not None and stream is not None:
            max_bytes, max_entries = self._budget(stream)
            spare = self._spare.get(stream)
            while spare and (self.held_bytes[stream] + size > max_bytes or self.held[stream] + 1 > max_entries):
                self._uncount(stream, spare.popitem(last=False)[1])
            if self.held_bytes[stream] + size > max_bytes:
                raise DescriptionRefused(
                    f"stream {stream!r} holds {self.held_bytes[stream]} bytes of "
                    f"descriptions; {size} more exceed its {max_bytes}",
                    "described_bytes",
                )
            if self.held[stream] + 1 > max_entries:
                raise DescriptionRefused(
                    f"stream {stream!r} holds {self.held[stream]} descriptions, its quota", "described"
                )
        self.held_bytes[stream] += size
        self.held[stream] += 1

    def _uncount(self, stream: str | None, desc: Description) -> None:
        """Caller holds ``_lock``."""
        self.held_bytes[stream] -= cost(desc)
        self.held[stream] -= 1

    def _stored_event(self, key: ObjectKey, desc: Description, tier: str) -> None:
        """Caller holds ``_lock``."""
        parent = None if desc.parent is None else wire_hash(desc.parent)
        self._emit(
            KVEvent(
                Kind.STORED,
                self._stream_of(key),
                self.media[tier],
                wire_hash(key.chunk_hash),
                parent,
                desc.tokens,
                desc.lora,
                group_idx=self._group,
            )
        )
        self.counts["stored"] += 1

    def _emit(self, event: KVEvent) -> None:
        """Caller holds ``_lock``.  An event of no stream is not published."""
        if event.stream is None:
            return
        if len(self._pending) == self._pending.maxlen:
            self.counts["dropped"] += 1
        self._pending.append(event)


__all__ = ["Budget", "DescriptionRefused", "ENTRY_COST", "EventRecorder", "StreamOf", "cost"]
