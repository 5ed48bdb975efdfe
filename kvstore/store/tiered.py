"""TieredStore: the embedded default store (host DRAM + optional lower tiers such as SSD).

Runs wherever the caller runs (the connector's scheduler/worker, the store process).

* ``lookup`` answers the contiguous prefix of keys found in any tier, with the tier of each
  hit (the fastest that has it).  A key missing everywhere ends the hit.
* ``get_into`` copies a verified object into a caller buffer: from the host tier, or from
  the first lower tier that has it, promoting it into the host tier on the way.
* ``put`` publishes into the host tier and, under write-through, into every lower tier
  before it returns; ``put_payload`` encodes straight into the host slot (no staging copy).
* Every object is whole and verified wherever it comes from (``tiers.base`` contract).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore import codec
from kvstore.config import StoreConfig, WritePolicy
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier


@dataclass(frozen=True, slots=True)
class LookupResult:
    looked_up: int
    tiers: tuple[str, ...]  # tier name of each hit, for the contiguous prefix

    @property
    def hits(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True, slots=True)
class GetResult:
    length: int
    tier: str
    seconds: float


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    keys_looked_up: int = 0
    keys_hit: dict[str, int] = field(default_factory=dict)
    gets: dict[str, int] = field(default_factory=dict)
    get_misses: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)
    read_seconds: dict[str, float] = field(default_factory=dict)
    promotions: int = 0
    puts: dict[str, int] = field(default_factory=dict)
    put_failures: dict[str, int] = field(default_factory=dict)

    def add(self, table: str, tier: str, n: float = 1) -> None:
        d = getattr(self, table)
        d[tier] = d.get(tier, 0) + n


class TieredStore:
    """Host DRAM on top, then ``lower`` tiers in order (fastest first)."""

    def __init__(self, host: HostTier, lower: Sequence[Tier] = (),
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> None:
        self.host = host
        self.lower = list(lower)
        self.write_policy = write_policy
        self.counters = StoreCounters()

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> "TieredStore":
        lower: list[Tier] = []
        if cfg.ssd_dir is not None:
            from tiers.ssd import SSDTier

            lower.append(SSDTier(cfg.ssd_dir, cfg.ssd_capacity))
        return cls(HostTier(cfg.host_capacity), lower, cfg.write_policy)

    @property
    def tiers(self) -> list[Tier]:
        return [self.host, *self.lower]

    async def lookup(self, keys: Sequence[ObjectKey]) -> LookupResult:
        """The contiguous prefix of ``keys`` present in some tier, with the fastest tier of
        each hit.  Each tier is asked once, in a batch, about the keys no faster tier has
        (one round trip for network tiers)."""
        where = await self._where_many(keys)
        found: list[str] = []
        for name in where:
            if name is None:
                break
            found.append(name)
        c = self.counters
        c.lookups += 1
        c.keys_looked_up += len(keys)
        for name in found:
            c.add("keys_hit", name)
        return LookupResult(len(keys), tuple(found))

    async def present(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is held by some tier (batched per tier; no counters touched)."""
        return [name is not None for name in await self._where_many(keys)]

    async def _where_many(self, keys: Sequence[ObjectKey]) -> list[str | None]:
        where: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, name in enumerate(where) if name is None]
            if not todo:
                break
            flags = await present_in(tier, [keys[i] for i in todo])
            for i, there in zip(todo, flags):
                if there:
                    where[i] = tier.name
        return where

    async def contains(self, key: ObjectKey) -> bool:
        """Whether any tier holds ``key`` (no counters touched)."""
        return await self._where(key) is not None

    async def _where(self, key: ObjectKey) -> Tier | None:  # one key: no batching needed
        for tier in self.tiers:
            if await tier.contains(key):
                return tier
        return None

    async def get_into(self, key: ObjectKey, buf: memoryview) -> GetResult | None:
        """The verified object in ``buf``, from the fastest tier holding it, or None."""
        for tier in self.tiers:
            t0 = time.perf_counter()
            n = await tier.read_into(key, buf)
            if n is None:
                continue
            seconds = time.perf_counter() - t0
            self._count_read(tier.name, n, seconds)
            if tier is not self.host:
                await self._promote(key, memoryview(buf)[:n])
            return GetResult(n, tier.name, seconds)
        self.counters.get_misses += 1
        return None

    async def promote(self, key: ObjectKey) -> bool:
        """Make ``key`` resident in the host tier, reading it (verified) from the first lower
        tier that has it straight into a host slot.  False on a miss or no room."""
        return await self.promote_from(key) is not None

    async def promote_from(self, key: ObjectKey) -> str | None:
        """Like ``promote``; the name of the tier it came from ("host" when already
        resident), or None on a miss or no room."""
        if await self.host.contains(key):
            return self.host.name
        for tier in self.lower:
            size = await tier.size_of(key)
            if size is None:
                continue
            handle = await self.host.put_start(key, size)
            if handle is None:
                return None
            t0 = time.perf_counter()
            n = None
            try:
                n = await tier.read_into(key, handle.buffer)
            finally:
                published = await self.host.put_commit(handle, n == size)
            if n == size:
                self._count_read(tier.name, n, time.perf_counter() - t0)
                self.counters.promotions += published
                return tier.name if published else None
        return None

    def _count_read(self, tier: str, n: int, seconds: float) -> None:
        c = self.counters
        c.add("gets", tier)
        c.add("bytes_read", tier, n)
        c.add("read_seconds", tier, seconds)

    async def _promote(self, key: ObjectKey, obj: memoryview) -> None:
        parent = codec.decode_header(obj).parent
        if await put_bytes(self.host, key, obj, self._parent_key(key, parent)) is PutResult.STORED:
            self.counters.promotions += 1

    @staticmethod
    def _parent_key(key: ObjectKey, parent: ChunkHash) -> ObjectKey | None:
        return None if parent == ROOT else ObjectKey(key.namespace, parent, key.tag)

    async def put(self, key: ObjectKey, obj: memoryview, parent: ObjectKey | None = None) -> PutResult:
        """Publish a complete encoded object; the host tier's result is returned."""
        result = await put_bytes(self.host, key, obj, parent)
        self._count_put(self.host.name, result)
        await self._write_through(key, obj, parent)
        return result

    async def put_payload(self, key: ObjectKey, geometry: codec.ObjectGeometry, payload,
                          parent_hash: ChunkHash = ROOT) -> PutResult:
        """Encode ``payload`` straight into a host slot, then write through from that slot."""
        parent = self._parent_key(key, parent_hash)
        if await self.host.contains(key):
            result = PutResult.EXISTS
        else:
            result = await self._encode_into_host(key, geometry, payload, parent_hash, parent)
        self._count_put(self.host.name, result)
        view = self.host.acquire(key) if result is not PutResult.NO_ROOM else None
        if view is None:
            return result
        try:
            await self._write_through(key, view, parent)
        finally:
            self.host.release(key)
        return result

    async def _encode_into_host(self, key, geometry, payload, parent_hash, parent) -> PutResult:
        handle = await self.host.put_start(key, codec.object_size(geometry), parent)
        if handle is None:
            return PutResult.NO_ROOM
        ok = False
        try:
            codec.encode_into(handle.buffer, key, geometry, payload, parent_hash)
            ok = True
        finally:
            published = await self.host.put_commit(handle, ok)
        return PutResult.STORED if published else PutResult.FAILED

    async def _write_through(self, key: ObjectKey, obj: memoryview, parent: ObjectKey | None) -> None:
        if self.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        for tier in self.lower:
            self._count_put(tier.name, await put_bytes(tier, key, obj, parent))

    def _count_put(self, tier: str, result: PutResult) -> None:
        if result is PutResult.STORED:
            self.counters.add("puts", tier)
        elif result in (PutResult.NO_ROOM, PutResult.FAILED):
            self.counters.add("put_failures", tier)

    async def delete(self, key: ObjectKey) -> bool:
        deleted = [await tier.delete(key) for tier in self.tiers]
        return any(deleted)

    def stats(self) -> dict[str, object]:
        return {"store": self.counters, "tiers": {t.name: t.stats() for t in self.tiers}}

    async def aclose(self) -> None:
        for tier in self.tiers:
            await tier.aclose()

    async def __aenter__(self) -> "TieredStore":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def present_in(tier: Tier, keys: Sequence[ObjectKey]) -> list[bool]:
    """Which of ``keys`` ``tier`` holds: its batch ``present`` when it has one (network
    tiers: one round trip), else its batch ``sizes`` (the host pool: one lock), else
    ``contains`` per key.  A failing tier holds nothing."""
    from kvstore.errors import TierError

    batch = getattr(tier, "present", None)
    try:
        if batch is not None:
            return list(await batch(keys))
        if getattr(tier, "sizes", None) is not None:
            return [size is not None for size in await sizes_in(tier, keys)]
        return [await tier.contains(k) for k in keys]
    except TierError:
        return [False] * len(keys)


async def sizes_in(tier: Tier, keys: Sequence[ObjectKey]) -> list[int | None]:
    """The object size of each of ``keys`` in ``tier`` (None: not there): its batch
    ``sizes`` when it has one (the host pool answers under one lock), else ``size_of`` per
    key.  ``TierError`` propagates: the caller decides what a failing tier means."""
    batch = getattr(tier, "sizes", None)
    if batch is not None:
        return list(await batch(keys))
    return [await tier.size_of(k) for k in keys]
