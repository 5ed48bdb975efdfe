"""The store process's own part: tenancy-scoped reads under leases, the reaper, and stats,
over the one store core (``kvstore.store.TieredStore``).

Server side, one event loop (host-tier calls are synchronous and never awaited between a
check and the action it guards).  Every key here is already tenant-scoped by the servicer:
this module never sees protobufs or tokens.

* Tiers (opened through ``kvstore.store.registry``): the host pools, one per tenant (a memfd
  each, ``tiers.host``: a tenant's puts and promotions take room, and evict, only in its own
  pool, found from the key's tenant mark; same-host clients get their tenant's pool through
  ``kvstore.server.shmgate``), then SSD (``--ssd-dir``, one partition per tenant with its
  quota), then Redis (``--redis``), fastest first.  The write-down checks every object
  before copying it down (clients can write their pool).
* Quotas (``kvstore.server.tenants``): leases held per tenant here, reservations in
  ``PutPath``, streams and connections at the edges.
* The core does lookups (a failing tier is a miss), promotion, deletes and the write-down.
* ``lease`` finds an object (promoting it from a lower tier into the host pool: read,
  verified by that tier, straight into a reserved slot) and grants a lease that also *pins*
  the slot (a host buffer reference, ``HostTier.pin``): until the lease is released or
  expires, the slot is neither evicted, freed nor reused, even if the object is deleted
  meanwhile (it is hidden at once and freed when the pin goes).  So while a lease is within
  its TTL the bytes at its offset cannot change, and a same-host client that finished its
  copy in time needs no answer from us (see the proto).  ``LeaseBook`` binds each lease to
  its tenant and its pinned key; ``release_leases`` (one call may carry many ids) drops the
  pins and re-checks validity for clients that ask.
* ``acquire``/``release``: a buffer reference (not a lease) for a stream; ``tickets``: the
  data channel's single-use tickets (``kvstore.server.tickets``).
* A reaper task aborts expired reservations, forgets expired leases (and their pins) and
  data tickets, so memory comes back even when no client asks.
* ``snapshot``, ``tenant_doc``, ``stats_doc`` (``kvstore.server.storestats``): the gauges of
  ``/metrics`` and the ``Stats`` document.
* ``aclose``: abort uncommitted puts, finish promotions and write-throughs, release leases
  and pins, close the tiers (the shm file is unlinked).
* ``events`` (``--kv-events``): the tiers' residency and the clients' descriptions as KV
  events per tenant (``kvstore.store.kvevents``; published by ``kvstore.server.kvpublish``);
  the host pool is ``CPU`` (ownership ``kvstore``), SSD and Redis ``STORAGE``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from kvstore.errors import LeaseError, TierUnavailableError
from kvstore.integrity import DEFAULT_TENANT, Keyring, KeySource, load_keys
from kvstore.keys import ChunkHash, ObjectKey
from kvstore.server.config import ServerConfig
from kvstore.server.kvpublish import EventPublisher, start_publisher
from kvstore.server.leases import LeaseBook
from kvstore.server.metrics import ServerMetrics, ServerObserver
from kvstore.server.redis_tenants import open_tenant_redis, redis_specs
from kvstore.server.reservations import PutPath
from kvstore.server.storestats import StoreStats
from kvstore.server.tenants import Tenants
from kvstore.server.tickets import DEFAULT_LIMIT as DEFAULT_TICKETS
from kvstore.server.tickets import TicketBook
from kvstore.store.kvevents import DescriptionRefused, EventRecorder
from kvstore.store.lookup import trusted_key
from kvstore.store.registry import open_tiers, tier_specs
from kvstore.store.tiered import TieredStore
from kvstore.wire.kv import CPU, LOCAL, REMOTE, STORAGE, Medium
from tiers.base import Tier
from tiers.host import HostTier

log = logging.getLogger("kvstore.server.servicer")
MEDIA = {
    "host": Medium(CPU, LOCAL, "kvstore"),
    "ssd": Medium(STORAGE, LOCAL, "ssd"),
    "redis": Medium(STORAGE, REMOTE, "redis"),
}


@dataclass(frozen=True, slots=True)
class Granted:
    """A leased object in the shared segment."""

    lease_id: int
    offset: int
    length: int
    ttl: float
    tier: str


class ServerStore(StoreStats):
    """Tiers and bookkeeping of one store process (see the module docstring)."""

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[Tier],
        cfg: ServerConfig,
        metrics: ServerMetrics,
        tenants: Tenants | None = None,
        clock: Callable[[], float] = time.monotonic,
        keys: KeySource | None = None,
        events: EventRecorder | None = None,
        publisher: EventPublisher | None = None,
    ) -> None:
        """``events``: the recorder of KV events (``cfg.kv_events``) and ``publisher`` the one
        that serves them, started; this store closes it after its own tiers."""
        self.tenants = tenants if tenants is not None else Tenants({}, {}, None)
        self.core = TieredStore(
            host,
            lower,
            cfg.write_policy,
            observer=ServerObserver(metrics),
            verify_writes=True,
            keys=self._keys_of(keys),
        )
        self.host, self.lower = host, self.core.lower
        self.cfg = cfg
        self.metrics = metrics
        self.leases = LeaseBook(on_drop=lambda tenant: self.tenants.give(tenant, "leases"))
        self.puts = PutPath(self.core, cfg, metrics, self.tenants, clock)
        # data-channel tickets (kvstore.server.tickets): each tenant its own budget, the table their sum
        budget = sum(limits.tickets for limits in self.tenants.limits.values()) or DEFAULT_TICKETS
        self.tickets = TicketBook(cfg.data_ticket_ttl, budget, clock=clock, tenants=self.tenants)
        self._clock = clock
        self._reaper: asyncio.Task | None = None
        self._closing = False
        self.started = time.time()
        self.events, self.publisher = events, publisher
        metrics.bind(self.snapshot)

    def _keys_of(self, keys: KeySource | None):
        """Each object's tenant's MAC keys, by its namespace's tenant mark (``default``
        without tenants), encrypting at rest when the tenant's ``encrypt`` is on; None
        without keys (a core built by a test)."""
        if keys is None:
            return None
        tenant_of, limits = self.tenants.tenant_of, self.tenants.limits
        rings: dict[str, Keyring] = {}

        def ring_of(key: ObjectKey) -> Keyring:
            tenant = tenant_of(key) or DEFAULT_TENANT
            ring = rings.get(tenant)
            if ring is None:
                on = tenant in limits and limits[tenant].encrypt
                ring = rings[tenant] = keys.keyring(tenant).encrypting(on)
            return ring

        return ring_of

    @classmethod
    async def open(cls, cfg: ServerConfig, metrics: ServerMetrics, tenants: Tenants) -> ServerStore:
        """Create the tenants' host pools and open the lower tiers; start the reaper.  Every
        spec is checked before anything is opened (a bad URL fails first)."""
        specs = tier_specs(
            cfg,
            host={"pin": False, "pools": tenants.host_bytes, "pool_of": tenants.tenant_of},
            ssd={"quotas": tenants.ssd_bytes, "partition": tenants.tenant_of},
            lower=redis_specs(cfg.redis, tenants.limits),
        )  # per tenant: docs/redis-tenants.md
        keys = load_keys(cfg.keys_file)  # before opening: a bad keys file fails first
        tiers = await open_tiers(specs)
        events = publisher = None
        try:
            tiers += await open_tenant_redis(cfg.redis, tenants)
            if cfg.kv_events:
                events = EventRecorder(MEDIA, stream_of=tenants.tenant_of, budget=tenants.descriptions)
                events.attach(tiers)
                publisher = start_publisher(cfg, events, tenants)
        except BaseException:
            for tier in reversed(tiers):
                await tier.aclose()
            raise
        host = tiers[0]
        assert isinstance(host, HostTier)  # tier_specs puts the host pool first
        store = cls(host, tiers[1:], cfg, metrics, tenants, keys=keys, events=events, publisher=publisher)
        store._reaper = asyncio.get_running_loop().create_task(store._reap_forever())
        return store

    @property
    def tiers(self) -> list[Tier]:
        return [self.host, *self.lower]

    def check_open(self) -> None:
        if self._closing:
            raise TierUnavailableError("the store is shutting down")

    # --- lookup -------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> tuple[list[str], list[int]]:
        """Tier name and object size of each key of the contiguous hit (parallel lists).
        ``keys`` are scoped ``ObjectKey``s or their canonical bytes (the servicer's fast
        path); the core (``kvstore.store.lookup``) asks the host pool under one lock, and the
        lower tiers only about what it misses.  A failing tier holds nothing."""
        with self.metrics.timer("lookup"):
            found = await self.core.lookup(keys)
        c = self.metrics.counters
        c.lookups += 1
        c.lookup_keys += len(keys)
        for name, hits in found.by_tier.items():
            c.bump(c.lookup_hits, name, hits)
        return found.tiers, cast("list[int]", found.sizes)  # a sized lookup: every hit has its size

    # --- reads --------------------------------------------------------------------------

    def lease_ttl(self, lease_ms: int) -> float:
        """Seconds for a requested TTL: 0 is the default; capped at ``max_lease_ttl``."""
        return self.cfg.lease_ttl if lease_ms <= 0 else min(lease_ms / 1000.0, self.cfg.max_lease_ttl)

    async def lease(self, key: ObjectKey, tenant: str, ttl: float) -> Granted | None:
        self.tenants.take(tenant, "leases")  # CapacityError at the tenant's quota
        try:
            granted = await self._lease(key, tenant, ttl)
        except BaseException:
            self.tenants.give(tenant, "leases")
            raise
        if granted is None:
            self.tenants.give(tenant, "leases")
        return granted

    async def _lease(self, key: ObjectKey, tenant: str, ttl: float) -> Granted | None:
        with self.metrics.timer("get"):
            tier = self.host.name
            lease = self.host.lease(key, ttl)
            if lease is None and (promoted := await self.promote(key)) is not None:
                tier, lease = promoted, self.host.lease(key, ttl)
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

    async def acquire(self, key: ObjectKey, path: str = "stream") -> tuple[memoryview, str] | None:
        """A view of the object under a buffer reference (``release`` ends it)."""
        tier = self.host.name
        view = self.host.acquire(key)
        if view is None and (promoted := await self.promote(key)) is not None:
            tier, view = promoted, self.host.acquire(key)
        c = self.metrics.counters
        if view is None:
            c.bump(c.get_misses, path)
            return None
        c.bump(c.gets, (path, tier))
        return view, tier

    def release(self, key: ObjectKey, sent: int) -> None:
        self.host.release(key)
        self.metrics.counters.bump(self.metrics.counters.bytes, ("host", "read"), sent)

    async def promote(self, key: ObjectKey) -> str | None:
        """Bring ``key`` into the host pool from the first lower tier holding it; the tier's
        name, or None (miss, or no room).  Concurrent callers share one promotion."""
        return await self.core.promote(key)

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
        return await self.core.delete(key)

    def describe(self, key: ObjectKey, parent: ChunkHash | None, tokens: Sequence[int], lora: str, tenant: str) -> bool:
        """A client's description of ``key`` (its tokens) for the KV events; False when the
        store publishes none.  Beyond ``tenant``'s description quota: ``CapacityError``,
        counted as its ``described_bytes`` or ``described`` refusal."""
        if self.events is None:
            return False
        try:
            self.events.describe(key, parent, tokens, lora or None)
        except DescriptionRefused as err:
            self.tenants.refuse(tenant, err.what)
            raise
        return True

    # --- reaper, stats, shutdown --------------------------------------------------------

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(1.0, self.cfg.lease_ttl / 4, self.cfg.put_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.reap()

    def reap(self) -> None:
        self.puts.reap()
        self.tickets.sweep()
        for key in self.leases.sweep(self._clock()):
            self._unpin(key)
        self.host.stats()  # sweeps the host's lease table (counts expiries)

    async def aclose(self, timeout: float = 10.0) -> None:
        """Graceful end (see the module docstring).  Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait([self._reaper])
        await self.core.promoter.drain(timeout)
        await self.puts.aclose(timeout)
        for lease_id in self.leases.ids():
            self.host.release_lease(lease_id)
            self._unpin(self.leases.forget(lease_id))
        await self.core.aclose(timeout)
        if self.publisher is not None:
            self.publisher.close()


__all__ = ["Granted", "ServerStore", "trusted_key"]
