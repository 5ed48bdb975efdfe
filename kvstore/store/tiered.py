"""TieredStore: the one store core, a host DRAM pool over lower tiers (fastest first).

Used by the embedded store (``kvstore demo``, ``kvstore bench tiers``), the store process
(``kvstore.server.core``: tenancy, leases and reservations on top) and the connector's
scheduler.  It runs on one event loop (the one its lower tiers were opened on); the host
pool's sync methods may be called from other threads, and so may ``written``.

* ``lookup``: tier name and object size of each key of the contiguous hit
  (``kvstore.store.lookup``: the host pool answers under one lock, each lower tier is asked
  once about the keys no faster tier holds, sizes only for hits inside the prefix).
* ``promote``/``read_into``: a lower-tier object read, verified, straight into a reserved
  host slot, once per key however many callers ask (``kvstore.store.promote``).
* ``put``/``put_payload`` publish into the host pool and hand the object to the write-down
  (``kvstore.store.writedown``, per the ``WritePolicy``), waiting a bounded time for room in
  its queue; ``written(key, parent)`` is the never-blocking entry for objects published by
  someone else (the store process's reservations, the connector's saves): a full queue
  drops the write-through (counted).
* **Authenticated objects** (``kvstore.integrity``): with ``keys`` (a function of an
  object's key: its tenant's ``Keyring``, or None for none), every object committed here
  is sealed with a MAC (``seal``; the connector's saves and the store process's commits
  call it too), and every object read from a lower tier is verified before it is used
  (``kvstore.store.promote.authenticate``): a forged one is a counted miss, removed.
  A tenant whose ``Keyring.encrypt`` is on has its objects encrypted on their way to SSD
  and Redis (``kvstore.store.writedown``) and decrypted on the way back
  (``kvstore.store.promote.reveal``); host memory holds them in clear.
* Tier errors (``TierError``) are misses everywhere, counted in ``counters.tier_errors`` and
  reported to the ``StoreObserver``.  Every object is whole and verified wherever it comes
  from (``tiers.base`` contract).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore import codec, integrity
from kvstore.config import StoreConfig, WritePolicy
from kvstore.errors import ConfigError, TierError
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from kvstore.store.lookup import present_many, sized_lookup
from kvstore.store.observer import StoreCounters, StoreObserver
from kvstore.store.pool import HostPool, SharedHostPool
from kvstore.store.promote import Promoter, reveal
from kvstore.store.registry import open_tiers, tier_specs
from kvstore.store.writedown import Offer, WriteDown
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier

log = logging.getLogger("kvstore.store")


@dataclass(frozen=True, slots=True)
class LookupResult:
    looked_up: int
    tiers: list[str]  # tier name of each hit, for the contiguous prefix
    sizes: list[int | None]  # object bytes of each hit (None for lower hits when not sized)
    by_tier: dict[str, int]  # hits per tier

    @property
    def hits(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True, slots=True)
class GetResult:
    length: int
    tier: str
    seconds: float


class TieredStore:
    """Host DRAM on top, then ``lower`` tiers in order (see the module docstring).  Keyword
    options: ``observer``; the write-down's ``max_writes_in_flight``, ``write_queue_bytes``,
    ``dirty_fraction`` and ``verify_writes`` (``kvstore.store.writedown``); ``put_wait_s``,
    how long ``put`` and ``put_payload`` wait for room in a full write-through queue before
    dropping."""

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[Tier] = (),
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        *,
        observer: StoreObserver | None = None,
        max_writes_in_flight: int = 2,
        write_queue_bytes: int | None = None,
        dirty_fraction: float = 0.5,
        put_wait_s: float = 10.0,
        verify_writes: bool = False,
        keys=None,
    ) -> None:
        self.host = host
        self.keys = keys
        self.pool: HostPool = SharedHostPool(host)  # what the engine connector may do with the host pool
        self.put_wait_s = put_wait_s
        self.lower = list(lower)
        self.write_policy = write_policy
        self.counters = StoreCounters()
        self.observer = observer or StoreObserver()
        self.promoter = Promoter(host, self.lower, self.counters, self.observer, keys)
        self.writer = WriteDown(
            host,
            self.lower,
            write_policy,
            self.counters,
            self.observer,
            max_in_flight=max_writes_in_flight,
            queue_bytes=write_queue_bytes,
            dirty_fraction=dirty_fraction,
            verify=verify_writes,
            keys=keys,
        )
        self._closed = False

    @classmethod
    async def open(
        cls,
        specs: Sequence[tuple[str, Mapping[str, object]]],
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        *,
        required: bool = True,
        on_left_out=None,
        **options,
    ) -> TieredStore:
        """Open ``specs`` (``kvstore.store.registry``: a ``host:`` spec first, then the lower
        tiers, fastest first) and build the store over them."""
        if not specs or not specs[0][0].startswith("host:"):
            raise ConfigError(f"the first tier of a store must be host:, got {specs[0][0] if specs else None!r}")
        tiers = await open_tiers(specs, required=required, on_left_out=on_left_out)
        try:
            return cls(tiers[0], tiers[1:], write_policy, **options)  # type: ignore[arg-type]
        except BaseException:
            for tier in reversed(tiers):
                await tier.aclose()
            raise

    @classmethod
    async def from_config(cls, cfg: StoreConfig, **options) -> TieredStore:
        """The embedded store of ``cfg``: a private host pool, then its SSD directory."""
        return await cls.open(tier_specs(cfg), cfg.write_policy, **options)

    @property
    def tiers(self) -> list[Tier]:
        return [self.host, *self.lower]

    # --- lookups ----------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], *, sized: bool = True) -> LookupResult:
        """The contiguous prefix of ``keys`` (``ObjectKey``s or their bytes) present in some
        tier: the fastest tier and, when ``sized``, the object size of each hit."""
        tiers, sizes = await sized_lookup(self.host, self.lower, keys, sized, self._failed)
        n = len(tiers)
        if n and tiers.count(tiers[0]) == n:
            by_tier = {tiers[0]: n}  # the usual answer: one tier
        else:
            by_tier = {name: tiers.count(name) for name in set(tiers)}
        c = self.counters
        c.lookups += 1
        c.keys_looked_up += len(keys)
        for name, hits in by_tier.items():
            c.add("keys_hit", name, hits)
        return LookupResult(len(keys), tiers, sizes, by_tier)

    async def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held by some tier, per key (batched per tier; not counted)."""
        return await present_many(self.host, self.lower, keys, self._failed)

    async def contains(self, key: ObjectKey) -> bool:
        """Whether any tier holds ``key`` (a failing tier holds nothing; not counted)."""
        if self.host.contains_sync(key):
            return True
        for tier in self.lower:
            try:
                if await tier.contains(key):
                    return True
            except TierError as err:
                self._failed(tier, "contains", err)
        return False

    # --- reads --------------------------------------------------------------------------------

    async def promote(self, key: ObjectKey) -> str | None:
        """Make ``key`` resident in the host pool (``kvstore.store.promote``); the tier it
        came from ("host" when it already was), or None (a miss, or no room)."""
        return await self.promoter.promote(key)

    async def read_into(self, key: ObjectKey, buf: memoryview) -> GetResult | None:
        """The verified object in ``buf``, promoted first when it lives in a lower tier (read
        straight from that tier when the pool has no room), or None."""
        t0 = time.perf_counter()
        n = self.host.read_into_sync(key, buf)
        tier: str | None = self.host.name
        if n is None and self.lower:
            tier = await self.promote(key)
            n = self.host.read_into_sync(key, buf) if tier is not None else None
            if n is None:
                tier, n = await self._read_lower(key, buf)
        if n is None:
            self.counters.get_misses += 1
            return None
        if tier is None:  # bytes read name the tier they came from
            raise LookupError(f"read of {key!r}: {n} bytes from no tier")
        seconds = time.perf_counter() - t0
        if tier == self.host.name:
            c = self.counters
            c.add("gets", tier)
            c.add("bytes_read", tier, n)
            c.add("read_seconds", tier, seconds)
        return GetResult(n, tier, seconds)

    async def _read_lower(self, key: ObjectKey, buf: memoryview) -> tuple[str | None, int | None]:
        for tier in self.lower:
            try:
                n, got = await self._read_from(tier, key, buf)
            except TierError as err:
                self._failed(tier, "read", err)
                continue
            if n is None:
                continue
            n, forged = reveal(self.keys, tier, key, got, n, self.counters)
            if forged is not None:
                await self.promoter.refuse(tier, key, forged)
            if n is None:
                continue
            if got is not buf:
                buf[:n] = got[:n]
            self.counters.add("gets", tier.name)
            self.counters.add("bytes_read", tier.name, n)
            return tier.name, n
        return None, None

    @staticmethod
    async def _read_from(tier: Tier, key: ObjectKey, buf: memoryview) -> tuple[int | None, memoryview]:
        """``tier.read_into(key, buf)`` and the buffer it read into: an encrypted copy is
        ``AEAD_OVERHEAD`` bytes longer than the object ``buf`` was sized for, so a copy that
        does not fit by that much is read into a staging buffer (an allocation, on this path
        only: the host pool had no room)."""
        try:
            return await tier.read_into(key, buf), buf
        except ConfigError:
            size = await tier.size_of(key)
            if size is None or size > len(buf) + codec.AEAD_OVERHEAD:
                raise
            staged = memoryview(bytearray(size))
            return await tier.read_into(key, staged), staged

    # --- puts ---------------------------------------------------------------------------------

    async def put(self, key: ObjectKey, obj: memoryview, parent: ObjectKey | None = None) -> PutResult:
        """Publish a complete encoded object in the host pool (its result is returned), then
        hand it to the write-down (waiting up to ``put_wait_s`` for room in its queue)."""
        result = (
            await put_bytes(self.host, key, obj, parent) if self.keys is None else self._put_sealed(key, obj, parent)
        )
        self.counters.count_put(self.host.name, result)
        if result is PutResult.STORED:
            await self.writer.submit(key, parent, self.put_wait_s)
        return result

    def _put_sealed(self, key: ObjectKey, obj: memoryview, parent: ObjectKey | None) -> PutResult:
        """``put_bytes`` into the host pool with the MAC sealed in the slot before it is
        published (the caller's bytes are not changed)."""
        if self.host.contains_sync(key):
            return PutResult.EXISTS
        view = memoryview(obj).cast("B")
        handle = self.host.put_start_sync(key, len(view), parent)
        if handle is None:
            return PutResult.NO_ROOM
        ok = False
        try:
            buf = handle.buffer
            if buf is None:  # the host tier hands out its slot
                raise LookupError(f"host tier {self.host.name}: a reservation of {key!r} without its slot")
            buf[: len(view)] = view
            self.seal(key, buf[: len(view)])
            ok = True
        finally:
            published = self.host.put_commit_sync(handle, ok)
        return PutResult.STORED if published else PutResult.FAILED

    async def put_payload(
        self, key: ObjectKey, geometry: codec.ObjectGeometry, payload, parent_hash: ChunkHash = ROOT
    ) -> PutResult:
        """Encode ``payload`` straight into a host slot (no staging copy), then write down
        (as ``put``)."""
        parent = None if parent_hash == ROOT else ObjectKey(key.namespace, parent_hash, key.tag)
        if self.host.contains_sync(key):
            result = PutResult.EXISTS
        else:
            result = self._encode_into_host(key, geometry, payload, parent_hash, parent)
        self.counters.count_put(self.host.name, result)
        if result is PutResult.STORED:
            await self.writer.submit(key, parent, self.put_wait_s)
        return result

    def _encode_into_host(self, key, geometry, payload, parent_hash, parent) -> PutResult:
        handle = self.host.put_start_sync(key, codec.object_size(geometry), parent)
        if handle is None:
            return PutResult.NO_ROOM
        ok = False
        try:
            codec.encode_into(handle.buffer, key, geometry, payload, parent_hash)
            self.seal(key, handle.buffer)
            ok = True
        finally:
            published = self.host.put_commit_sync(handle, ok)
        return PutResult.STORED if published else PutResult.FAILED

    def seal(self, key: ObjectKey, buf, *, unless_sealed: bool = False) -> None:
        """Seal the whole, uncompressed object in ``buf`` with its tenant's current MAC key
        (nothing without ``keys``).  Call it before the object is published.
        ``unless_sealed``: leave an object that already carries the current key id as it is
        (one its writer in this process sealed: the connector's worker)."""
        if self.keys is None:
            return
        ring = self.keys(key)
        if ring is None or (unless_sealed and codec.decode_header(buf).key_id == ring.current):
            return
        integrity.seal(buf, ring)
        self.counters.sealed += 1

    def written(self, key: ObjectKey, parent: ObjectKey | None) -> Offer:
        """``key`` was just published in the host pool: hand it to the write-down (any
        thread; never blocks: see ``kvstore.store.writedown`` for a full queue)."""
        return self.writer.offer(key, parent)

    # --- delete, stats, shutdown ----------------------------------------------------------------

    async def delete(self, key: ObjectKey) -> bool:
        """Remove ``key`` from every tier; its write-down or promotion in flight settles first,
        so neither can bring it back.  A failing tier is counted and skipped."""
        await self.writer.settle_key(key)
        await self.promoter.settle(key)
        deleted = self.host.delete_sync(key)
        for tier in self.lower:
            try:
                deleted = await tier.delete(key) or deleted
            except TierError as err:
                self._failed(tier, "delete", err)
        return deleted

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait for promotions and write-downs in flight (not a write-back flush)."""
        await self.promoter.drain(timeout)
        return await self.writer.drain(timeout)

    async def flush(self, timeout: float | None = None) -> bool:
        """Write everything dirty down (write-back) and wait for it."""
        return await self.writer.flush(timeout)

    def stats(self) -> dict[str, object]:
        return {
            "store": self.counters,
            "tiers": {t.name: t.stats() for t in self.tiers},
            "write_down": {
                "in_flight": self.writer.in_flight,
                "dirty_bytes": self.writer.dirty_bytes,
                "written": self.writer.written,
            },
        }

    async def settle(self, timeout: float = 30.0) -> None:
        """Let promotions finish and write everything down (``timeout`` s each), refusing new
        write-downs; the tiers stay open."""
        await self.promoter.drain(timeout)
        await self.writer.aclose(timeout)

    async def aclose(self, timeout: float = 30.0) -> None:
        """``settle``, then close the lower tiers and the host pool.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.settle(timeout)
        for tier in self.lower:
            try:
                await tier.aclose()
            except Exception as err:  # noqa: BLE001 - closing the rest matters more
                log.warning("closing %s failed: %s", tier.name, err)
        self.host.close()

    async def __aenter__(self) -> TieredStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.counters.add("tier_errors", f"{tier.name}:{op}")
        self.observer.tier_failed(tier, op, err)


__all__ = ["GetResult", "LookupResult", "TieredStore"]
