"""The store process's core: tiers, lookups, leased and streamed reads, deletes, stats.

Server side, one event loop (host-tier calls are synchronous and never awaited between a
check and the action it guards).  Every key here is already tenant-scoped by the servicer:
this module never sees protobufs or tokens.

* Tiers: a shared host pool (``HostTier(shared=True)``, a 0600 file in /dev/shm that
  same-host clients map), then SSD (``--ssd-dir``), then Redis (``--redis``), fastest first.
* ``lookup`` answers the contiguous prefix of keys present in some tier, with the fastest
  tier and the object size of each hit.  A lower tier that fails is a miss for that tier.
* ``get_leased`` finds an object (promoting it from a lower tier into the host pool: read,
  verified by that tier, straight into a reserved slot) and grants a lease that also *pins*
  the slot (a host buffer reference, ``HostTier.pin``): until the lease is released or
  expires, the slot is neither evicted, freed nor reused, even if the object is deleted
  meanwhile (it is hidden at once and freed when the pin goes).  So while a lease is within
  its TTL the bytes at its offset cannot change, and a same-host client that finished its
  copy in time needs no answer from us (see the proto).  ``LeaseBook`` binds each lease to
  its tenant and its pinned key; ``release_leases`` (one call may carry many ids) drops the
  pins and re-checks validity for clients that ask.
* ``open_read``/``close_read`` hold a buffer reference (not a lease) for a stream.
* A reaper task aborts expired reservations and forgets expired leases (dropping their
  pins) periodically, so memory comes back even when no client asks (a client killed with
  queued releases, say).
* ``aclose`` (graceful shutdown): abort uncommitted puts, release leases and their pins,
  finish write-throughs, close the tiers (the shm file is unlinked).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass

from kvstore.errors import CapacityError, LeaseError, TierError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import ServerMetrics, Snapshot
from kvstore.server.reservations import PutPath
from kvstore.server.leases import LeaseBook
from kvstore.store.tiered import sizes_in
from tiers.base import Tier
from tiers.host import HostTier

log = logging.getLogger("kvstore.server.servicer")


@dataclass(frozen=True, slots=True)
class Granted:
    """A leased object in the shared segment."""

    lease_id: int
    offset: int
    length: int
    ttl: float
    tier: str


class ServerStore:
    """Tiers and bookkeeping of one store process (see the module docstring)."""

    def __init__(self, host: HostTier, lower: Sequence[Tier], cfg: ServerConfig,
                 metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.lower = list(lower)
        self.cfg = cfg
        self.metrics = metrics
        self.leases = LeaseBook()
        self.puts = PutPath(host, self.lower, cfg, metrics, clock)
        self._clock = clock
        self._promoting: dict[ObjectKey, asyncio.Task] = {}
        self._reaper: asyncio.Task | None = None
        self._closing = False
        self.started = time.time()
        metrics.bind(self.snapshot)

    @classmethod
    async def open(cls, cfg: ServerConfig, metrics: ServerMetrics) -> "ServerStore":
        """Create the shared host pool and open the lower tiers; start the reaper."""
        redis_cfg = _redis_config(cfg.redis) if cfg.redis else None  # a bad URL fails first
        host = HostTier(cfg.host_capacity, shared=True, pin=False)  # pin=False: no torch here
        lower: list[Tier] = []
        try:
            if cfg.ssd_dir is not None:
                from tiers.ssd import SSDTier

                lower.append(await SSDTier.open(cfg.ssd_dir, cfg.ssd_capacity))
            if redis_cfg is not None:
                from tiers.redis import RedisTier  # lazily: redis-py only with --redis

                lower.append(await RedisTier.open(redis_cfg))
        except BaseException:
            for tier in lower:
                with suppress(Exception):
                    await tier.aclose()
            host.close()
            raise
        store = cls(host, lower, cfg, metrics)
        store._reaper = asyncio.get_running_loop().create_task(store._reap_forever())
        return store

    @property
    def tiers(self) -> list[Tier]:
        return [self.host, *self.lower]

    @property
    def segment_path(self) -> str:
        assert self.host.shm_path is not None
        return self.host.shm_path

    def check_open(self) -> None:
        if self._closing:
            raise TierUnavailableError("the store is shutting down")

    # --- lookup -------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> tuple[list[str], list[int]]:
        """Tier name and object size of each key of the contiguous hit (parallel lists).
        ``keys`` are scoped ``ObjectKey``s or their canonical bytes (the servicer's fast
        path).  The host pool answers the whole batch under one lock; only when it misses
        some key is each lower tier asked once, in a batch, about the keys no faster tier
        holds (a tier with a batch ``present``, like Redis, is then asked for the sizes of
        its hits inside the contiguous prefix only, concurrently).  A failing tier holds
        nothing."""
        with self.metrics.timer("lookup"):
            sizes = self.host.sizes_sync(keys)
            n = _prefix(sizes)
            if n < len(keys) and self.lower:
                tiers = await self._lookup_lower(keys, sizes)
                counts = {name: tiers.count(name) for name in set(tiers)}
            else:
                tiers, counts = [self.host.name] * n, {self.host.name: n} if n else {}
        c = self.metrics.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        for name, hits in counts.items():
            c.bump(c.lookup_hits, name, hits)
        return tiers, sizes[:len(tiers)]  # type: ignore[return-value]

    async def _lookup_lower(self, raw: Sequence[bytes], sizes: list[int | None]) -> list[str]:
        """Complete ``sizes`` (the host's answer) from the lower tiers; the tier name of each
        key of the contiguous hit."""
        keys = [k if type(k) is ObjectKey else trusted_key(k) for k in raw]
        where: list[Tier | None] = [None if s is None else self.host for s in sizes]
        for tier in self.lower:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            found = await self._find_in(tier, [keys[i] for i in todo])
            for i, (there, size) in zip(todo, found):
                if there:
                    where[i], sizes[i] = tier, size
        n = await self._fill_sizes(keys, where, sizes, _prefix(where))
        return [t.name for t in where[:n]]  # type: ignore[union-attr]

    async def _find_in(self, tier: Tier, keys: Sequence[ObjectKey]) -> list[tuple[bool, int | None]]:
        """(present, size or None if not known yet) of each key in ``tier``: a network
        tier's batch ``present`` (sizes follow for the prefix only), else ``sizes_in``."""
        try:
            present = getattr(tier, "present", None)
            if present is not None:
                return [(bool(there), None) for there in await present(keys)]
            return [(size is not None, size) for size in await sizes_in(tier, keys)]
        except TierError as err:
            self._tier_failed(tier, "lookup", err)
            return [(False, None)] * len(keys)

    async def _fill_sizes(self, keys: Sequence[ObjectKey], where: list[Tier | None],
                          sizes: list[int | None], n: int) -> int:
        """Ask for the unknown sizes among the first ``n`` hits; the prefix that survives
        (an object gone meanwhile ends it)."""
        todo = [i for i in range(n) if sizes[i] is None]
        if not todo:
            return n

        async def size(i: int) -> int | None:
            try:
                return await where[i].size_of(keys[i])  # type: ignore[union-attr]
            except TierError as err:
                self._tier_failed(where[i], "lookup", err)  # type: ignore[arg-type]
                return None

        for i, found in zip(todo, await asyncio.gather(*(size(i) for i in todo))):
            sizes[i] = found
        return next((i for i in range(n) if sizes[i] is None), n)

    # --- reads --------------------------------------------------------------------------

    def lease_ttl(self, lease_ms: int) -> float:
        """Seconds for a requested TTL: 0 is the default; capped at ``max_lease_ttl``."""
        return self.cfg.lease_ttl if lease_ms <= 0 else min(lease_ms / 1000.0, self.cfg.max_lease_ttl)

    async def get_leased(self, key: ObjectKey, tenant: str, ttl: float) -> Granted | None:
        with self.metrics.timer("get"):
            tier = self.host.name
            lease = self.host.lease(key, ttl)
            if lease is None:
                tier = await self.promote(key)
                lease = self.host.lease(key, ttl) if tier is not None else None
            place = self.host.pin(key) if lease is not None else None
        c = self.metrics.counters
        if lease is None or place is None:
            if lease is not None:
                self.host.release_lease(lease.lease_id)
            c.bump(c.get_misses, "shm")
            return None
        # The pin (a reference) is held until the lease is released or expires: the lease
        # keeps the object from eviction, the pin keeps its slot from a delete's free.
        offset, size = place
        self.leases.grant(lease.lease_id, tenant, lease.expires_at, key)
        c.leases_granted += 1
        c.bump(c.gets, ("shm", tier))
        c.bump(c.bytes, ("host", "read"), size)
        return Granted(lease.lease_id, offset, size, ttl, tier)

    async def open_read(self, key: ObjectKey, path: str = "stream") -> tuple[memoryview, str] | None:
        """A view of the object under a buffer reference (``close_read`` ends it)."""
        tier = self.host.name
        view = self.host.acquire(key)
        if view is None:
            tier = await self.promote(key)
            view = self.host.acquire(key) if tier is not None else None
        c = self.metrics.counters
        if view is None:
            c.bump(c.get_misses, path)
            return None
        c.bump(c.gets, (path, tier))
        return view, tier

    def close_read(self, key: ObjectKey, sent: int) -> None:
        self.host.release(key)
        self.metrics.counters.bump(self.metrics.counters.bytes, ("host", "read"), sent)

    async def promote(self, key: ObjectKey) -> str | None:
        """Bring ``key`` into the host pool from the first lower tier holding it; the tier's
        name, or None (miss, or no room).  Concurrent callers share one promotion."""
        task = self._promoting.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._promote(key))
            self._promoting[key] = task
            task.add_done_callback(
                lambda t, k=key: self._promoting.pop(k, None) if self._promoting.get(k) is t else None)
        return await asyncio.shield(task)

    async def _promote(self, key: ObjectKey) -> str | None:
        c = self.metrics.counters
        with self.metrics.timer("promote"):
            for tier in self.lower:
                try:
                    size = await tier.size_of(key)
                except TierError as err:
                    self._tier_failed(tier, "promote", err)
                    continue
                if size is None:
                    continue
                try:
                    handle = self.host.put_start_sync(key, size)
                except CapacityError:
                    handle = None
                if handle is None:
                    c.fail("promote_no_room")
                    return None
                n = None
                try:
                    n = await tier.read_into(key, handle.buffer)
                except TierError as err:
                    self._tier_failed(tier, "promote", err)
                finally:
                    published = self.host.put_commit_sync(handle, n == size)
                if published and n == size:
                    c.bump(c.promotions, tier.name)
                    c.bump(c.bytes, (tier.name, "read"), size)
                    return tier.name
            return None

    # --- leases -------------------------------------------------------------------------

    def renew_lease(self, lease_id: int, tenant: str, ttl: float) -> float:
        if not self.leases.owned(lease_id, tenant):
            raise LeaseError(f"lease {lease_id} is unknown, released or expired")
        try:
            lease = self.host.renew_lease(lease_id, ttl)
        except LeaseError:  # expired, or its object deleted: the client's copy is a miss
            self._unpin(self.leases.forget(lease_id))
            raise
        self.leases.renew(lease_id, lease.expires_at)
        return ttl

    def release_leases(self, lease_ids: Sequence[int], tenant: str) -> list[bool]:
        """Per lease: True when it was still valid (a copy made under it is good); its pin
        is dropped either way.  False also when its object was deleted meanwhile (the bytes
        were pinned, but the conservative answer costs nothing)."""
        out = []
        for lease_id in lease_ids:
            valid = self.leases.owned(lease_id, tenant)
            if valid:
                pinned = self.leases.forget(lease_id)
                try:
                    self.host.check_lease(lease_id)
                except LeaseError:
                    valid = False
                valid = self.host.release_lease(lease_id) and valid
                self._unpin(pinned)
            out.append(valid)
        c = self.metrics.counters
        c.release_calls += 1
        c.leases_released += sum(out)
        return out

    def _unpin(self, key: ObjectKey | None) -> None:
        """Drop the buffer reference a lease held (its slot is freed now if it was deleted)."""
        if key is not None:
            self.host.release(key)

    # --- delete -------------------------------------------------------------------------

    async def delete(self, key: ObjectKey) -> bool:
        """Remove ``key`` from every tier (a write-through or promotion of it first settles,
        so neither can bring it back)."""
        await self.puts.settle_key(key)
        task = self._promoting.get(key)
        if task is not None:
            await asyncio.wait([task])
        deleted = self.host.delete_sync(key)
        for tier in self.lower:
            try:
                deleted = await tier.delete(key) or deleted
            except TierError as err:
                self._tier_failed(tier, "delete", err)
        return deleted

    # --- reaper, stats, shutdown --------------------------------------------------------

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(1.0, self.cfg.lease_ttl / 4, self.cfg.put_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.reap()

    def reap(self) -> None:
        self.puts.reap()
        for key in self.leases.sweep(self._clock()):
            self._unpin(key)
        self.host.stats()  # sweeps the host's lease table (counts expiries)

    def snapshot(self) -> Snapshot:
        """Gauges for ``/metrics`` and ``Stats`` (thread-safe: tier stats lock themselves).
        Leases held are those handed to clients and not yet released or reaped: each still
        pins its slot, even when its object was deleted."""
        tiers = {t.name: t.stats().as_dict() for t in self.tiers}
        host = tiers[self.host.name]
        return Snapshot(len(self.leases), int(host["leases_expired"]), len(self.puts.table), tiers)

    def stats_doc(self) -> dict[str, object]:
        """The ``Stats`` document (on the loop: expired leases and reservations are reaped
        first, so the answer never counts what a reaper pass would drop)."""
        self.reap()
        snap = self.snapshot()
        breakers = {name: {k: v for k, v in s.items() if k.startswith("breaker_")}
                    for name, s in snap.tiers.items() if "breaker_open" in s}
        return {
            "server": {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
                       "closing": self._closing},
            "tiers": snap.tiers,
            "store": self.metrics.counters.as_json(),
            "leases": {"held": snap.leases_held, "expired": snap.leases_expired,
                       "granted": self.metrics.counters.leases_granted,
                       "released": self.metrics.counters.leases_released,
                       "release_calls": self.metrics.counters.release_calls},
            "puts_in_flight": snap.puts_in_flight,
            "write_throughs_in_flight": self.puts.writes_in_flight,
            "breakers": breakers,
        }

    async def aclose(self, timeout: float = 10.0) -> None:
        """Graceful end (see the module docstring).  Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait([self._reaper])
        if self._promoting:
            await asyncio.wait(list(self._promoting.values()), timeout=timeout)
        await self.puts.aclose(timeout)
        for lease_id in self.leases.ids():
            self.host.release_lease(lease_id)
            self._unpin(self.leases.forget(lease_id))
        for tier in self.lower:
            try:
                await tier.aclose()
            except Exception as err:  # noqa: BLE001 - closing the rest matters more
                log.warning("closing %s failed: %s", tier.name, err)
        self.host.close()

    def _tier_failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.metrics.counters.fail(f"{tier.name}_{op}_error")
        log.warning("%s %s failed: %s", tier.name, op, err)


def _prefix(found: list) -> int:
    """Length of the run before the first None (one C-level scan)."""
    try:
        return found.index(None)
    except ValueError:
        return len(found)


trusted_key = functools.partial(bytes.__new__, ObjectKey)
"""``ObjectKey`` from canonical bytes whose parts were already validated (no checks: ~5x
faster than ``ObjectKey(namespace, hash, tag)``)."""


def _redis_config(url: str):
    from tiers.redis_config import RedisConfig

    return RedisConfig.from_url(url)


__all__ = ["Granted", "ServerStore", "trusted_key"]
