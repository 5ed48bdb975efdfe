"""The one small interface every storage tier implements (host DRAM, SSD, Redis, remote).

Contract (DESIGN §6):

* Objects are whole, self-describing byte strings in the ``kvstore.codec`` format, named by
  ``ObjectKey``.  A tier never exposes half an object: puts are two-phase
  (``put_start`` → write → ``put_commit(ok)``), and a failed or abandoned put leaves nothing.
* Reads land in **caller-provided buffers** (``read_into``) and return a verified object:
  header, key and payload checksum checked.  A damaged object is a *miss*: it is deleted
  and counted in ``stats().corrupt``; it never reaches the caller.
* Expected shortfalls are return values: a miss is ``None``, no room is ``None`` from
  ``put_start`` / ``PutResult.NO_ROOM`` from ``put``.  An object that can never fit raises
  ``CapacityError``; I/O failure raises ``TierError``.
* ``lookup`` answers the *contiguous prefix* of ``keys`` present: chunk i+1 without chunk
  i is useless.
* ``parent`` (on put) names the previous chunk's key so eviction can drop chain tails
  before their parents.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

from kvstore.keys import ObjectKey


class PutResult(Enum):
    STORED = "stored"    # newly published
    EXISTS = "exists"    # already present (content addressing makes this a success)
    NO_ROOM = "no_room"  # nothing could be evicted to make room right now
    FAILED = "failed"    # the write failed; nothing was published


@dataclass(slots=True)
class PutHandle:
    """An object being written.  ``buffer`` is a writable view where the tier offers one
    (the host tier hands out the slot itself, so producers write in place)."""

    key: ObjectKey
    size: int
    parent: ObjectKey | None = None
    buffer: memoryview | None = None
    token: object = None  # tier-private state (slot offset, temp file, ...)
    offset: int = -1      # where ``buffer`` starts in the tier's pool, when it has one


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
    name: str

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        """How many of ``keys``, from the first, are present (contiguous prefix)."""

    async def contains(self, key: ObjectKey) -> bool: ...

    async def size_of(self, key: ObjectKey) -> int | None:
        """Total object bytes (header + payload), or None when absent."""

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


async def lookup_prefix(tier: Tier, keys: Sequence[ObjectKey]) -> int:
    """Contiguous-prefix lookup by ``contains`` for tiers without a batch index."""
    n = 0
    for key in keys:
        if not await tier.contains(key):
            break
        n += 1
    return n
