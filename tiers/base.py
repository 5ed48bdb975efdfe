"""The one small interface every storage tier implements (host DRAM, SSD, Redis, remote).

Contract (docs/architecture.md#tiers):

* Objects are whole, self-describing byte strings in the ``kvstore.codec`` format, named by
  ``ObjectKey``.  A tier never exposes half an object: puts are two-phase
  (``put_start`` → write → ``put_commit(ok)``), and a failed or abandoned put leaves nothing.
* Reads land in **caller-provided buffers** (``read_into``) and return a verified object:
  header, key and payload checksum checked.  A damaged object is a *miss*: it is deleted
  and counted in ``stats().corrupt``; it never reaches the caller.
* Expected shortfalls are return values: a miss is ``None``, no room is ``None`` from
  ``put_start`` / ``PutResult.NO_ROOM`` from ``put``.  An object that can never fit raises
  ``CapacityError``; I/O failure raises ``TierError``.
* Lookups: ``size_of``/``contains`` for one key; ``sizes``/``present`` answer *per key*
  for a batch; ``lookup`` answers the *contiguous prefix* of ``keys`` present (chunk i+1
  without chunk i is useless).  A lookup that cannot reach its backend raises ``TierError``
  or answers a miss; it never answers a key present that is not.
* ``parent`` (on put) names the previous chunk's key so eviction can drop chain tails
  before their parents.
* **Residency.**  A tier tells its ``residency`` listener (when one is set) each object it
  publishes and each it drops, with the reason (``Removal``), as it happens: the truth of
  what each tier holds, for KV events and traces (``kvstore.store.kvevents``).  Calls may
  come from any thread, with the tier's own lock held: a listener must be quick, must not
  block and must never call back into the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, Self, runtime_checkable

from kvstore.keys import ObjectKey


class Removal(Enum):
    """Why an object left a tier."""

    EVICTED = "evicted"  # its room was needed (or the backend dropped it: Redis maxmemory)
    EXPIRED = "expired"  # its TTL ran out (Redis ``ttl_s``)
    CORRUPT = "corrupt"  # it failed verification and was deleted
    DELETED = "deleted"  # someone deleted it
    RESET = "reset"  # its engine reset its cache (weights may have changed in memory)


@runtime_checkable
class Residency(Protocol):
    """Told what a tier publishes and drops (see the module docstring)."""

    def stored(self, tier: str, key: ObjectKey) -> None: ...

    def removed(self, tier: str, key: ObjectKey, reason: Removal) -> None: ...


class _Listeners:
    """Several residency listeners of one tier, told in order."""

    def __init__(self, *listeners: Residency) -> None:
        self.listeners = listeners

    def stored(self, tier: str, key: ObjectKey) -> None:
        for listener in self.listeners:
            listener.stored(tier, key)

    def removed(self, tier: str, key: ObjectKey, reason: Removal) -> None:
        for listener in self.listeners:
            listener.removed(tier, key, reason)


def listen(tier: Tier, listener: Residency) -> None:
    """Add ``listener`` to those ``tier`` tells what it publishes and drops."""
    current = getattr(tier, "residency", None)
    # TierBase's attribute, which the Tier protocol leaves out (a tier need not offer it)
    tier.residency = listener if current is None else _Listeners(current, listener)  # type: ignore[attr-defined]


class PutResult(Enum):
    STORED = "stored"  # newly published
    EXISTS = "exists"  # already present (content addressing makes this a success)
    NO_ROOM = "no_room"  # nothing could be evicted to make room right now
    FAILED = "failed"  # the write failed; nothing was published


@dataclass(slots=True)
class PutHandle:
    """An object being written.  ``buffer`` is a writable view where the tier offers one
    (the host tier hands out the slot itself, so producers write in place)."""

    key: ObjectKey
    size: int
    parent: ObjectKey | None = None
    buffer: memoryview | None = None
    token: object = None  # tier-private state (slot offset, temp file, ...)
    offset: int = -1  # where ``buffer`` starts in the tier's pool, when it has one


@dataclass(slots=True)
class TierStats:
    """Counters of one tier.  ``hits``/``misses`` count ``read_into`` calls."""

    name: str
    objects: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    put_failures: int = 0
    evictions: int = 0
    corrupt: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "extra"}
        d.update(self.extra)
        return d


@runtime_checkable
class Tier(Protocol):
    """Everything the store core (``kvstore.store``) asks of a tier.  ``TierBase`` gives
    the batch questions defaults for a backend with nothing better."""

    name: str

    async def size_of(self, key: ObjectKey) -> int | None:
        """Total object bytes (header + payload), or None when absent."""

    async def contains(self, key: ObjectKey) -> bool: ...

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        """``size_of`` of each key (None: absent), answered as a batch where the backend can
        (one lock, one round trip)."""

    async def present(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is present, *per key* (a key after a missing one is still
        answered)."""

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        """How many of ``keys``, from the first, are present (the contiguous prefix).  The
        cheapest question for a backend that answers prefixes (the store process)."""

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        """Copy the verified object into ``buf``; its length, or None on a miss."""

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        """Reserve room for an object of ``size`` bytes; None when there is no room now."""

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        """Write part of the object at ``offset`` (for tiers without ``handle.buffer``)."""

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        """Publish (ok=True) or abandon the object; True when it is now visible."""

    async def delete(self, key: ObjectKey) -> bool: ...

    def stats(self) -> TierStats: ...

    async def aclose(self) -> None: ...


class TierBase:
    """Defaults for the questions a backend may answer better: ``contains`` and ``sizes``
    from ``size_of``, ``present`` from ``sizes``, ``lookup`` from ``present``.  A backend
    overrides the ones it can batch; it must define ``size_of``.  ``residency``: the
    listener told what the tier publishes and drops (None: nobody)."""

    name: str
    residency: Residency | None = None

    def _stored(self, key: ObjectKey) -> None:
        if self.residency is not None:
            self.residency.stored(self.name, key)

    def _removed(self, key: ObjectKey, reason: Removal) -> None:
        if self.residency is not None:
            self.residency.removed(self.name, key, reason)

    async def size_of(self, key: ObjectKey) -> int | None:
        raise NotImplementedError

    async def contains(self, key: ObjectKey) -> bool:
        return await self.size_of(key) is not None

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        return [await self.size_of(key) for key in keys]

    async def present(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [size is not None for size in await self.sizes(keys)]

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        flags = await self.present(keys)
        return flags.index(False) if False in flags else len(flags)

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class MemoryTierBase(TierBase):
    """A tier whose operations never block (host memory): the async ``Tier`` protocol is a
    thin wrapper over its ``*_sync`` methods (large copies belong on a copy thread)."""

    def lookup_sync(self, keys: Sequence[ObjectKey]) -> int:
        raise NotImplementedError

    def size_of_sync(self, key: ObjectKey) -> int | None:
        raise NotImplementedError

    def sizes_sync(self, keys: Sequence[bytes]) -> list[int | None]:
        raise NotImplementedError

    def read_into_sync(self, key: ObjectKey, buf: memoryview) -> int | None:
        raise NotImplementedError

    def put_start_sync(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        raise NotImplementedError

    def put_write_sync(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        raise NotImplementedError

    def put_commit_sync(self, handle: PutHandle, ok: bool = True) -> bool:
        raise NotImplementedError

    def delete_sync(self, key: ObjectKey, reason: Removal = Removal.DELETED) -> bool:
        raise NotImplementedError

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        return self.lookup_sync(keys)

    async def size_of(self, key: ObjectKey) -> int | None:
        return self.size_of_sync(key)

    async def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        return self.sizes_sync(keys)

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        return self.read_into_sync(key, buf)

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        return self.put_start_sync(key, size, parent)

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        self.put_write_sync(handle, offset, data)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        return self.put_commit_sync(handle, ok)

    async def delete(self, key: ObjectKey, reason: Removal = Removal.DELETED) -> bool:
        return self.delete_sync(key, reason)


async def put_bytes(tier: Tier, key: ObjectKey, obj: memoryview, parent: ObjectKey | None = None) -> PutResult:
    """Two-phase put of a complete object held in ``obj``, through any tier."""
    if await tier.contains(key):
        return PutResult.EXISTS
    view = memoryview(obj).cast("B")
    handle = await tier.put_start(key, len(view), parent)
    if handle is None:
        return PutResult.NO_ROOM
    ok = False
    try:
        if handle.buffer is not None:
            handle.buffer[: len(view)] = view
        else:
            await tier.put_write(handle, 0, view)
        ok = True
    finally:
        published = await tier.put_commit(handle, ok)
    return PutResult.STORED if published else PutResult.FAILED
