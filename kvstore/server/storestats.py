"""What the store process tells about its state: the gauges of ``/metrics`` and the ``Stats``
document, whole (a token with ``admin``) and one tenant's part (every other token).

Server side, on the store's event loop (``snapshot`` also from the ``/metrics`` thread: tier
stats lock themselves).  ``StoreStats`` is a base of ``kvstore.server.core.ServerStore``: it
reads the store's tiers and books, and the store supplies them (and ``reap``, run before a
document is made, so it never counts what a reaper pass would drop).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from typing import cast

from kvstore.server.kvpublish import EventPublisher
from kvstore.server.leases import LeaseBook
from kvstore.server.metrics import ServerMetrics, Snapshot
from kvstore.server.redis_tenants import tenant_evictions
from kvstore.server.reservations import PutPath
from kvstore.server.statsdoc import dumpable
from kvstore.server.tenants import COUNTED, Tenants
from kvstore.server.tickets import TicketBook
from kvstore.store.kvevents import EventRecorder
from kvstore.store.tiered import TieredStore
from tiers.base import Tier
from tiers.host import HostTier


class StoreStats(ABC):
    """``snapshot``, ``tenant_doc`` and ``stats_doc`` of a store process (see the module docstring)."""

    host: HostTier
    lower: list[Tier]
    core: TieredStore
    metrics: ServerMetrics
    tenants: Tenants
    leases: LeaseBook
    puts: PutPath
    tickets: TicketBook
    events: EventRecorder | None
    publisher: EventPublisher | None
    started: float
    _closing: bool

    @property
    @abstractmethod
    def tiers(self) -> list[Tier]:
        """The host pool and the lower tiers, fastest first."""

    @abstractmethod
    def reap(self) -> None:
        """Drop what expired (reservations, leases and their pins, tickets)."""

    def snapshot(self) -> Snapshot:
        """Gauges for ``/metrics`` and ``Stats`` (thread-safe: tier stats lock themselves).
        Leases held are those handed to clients and not yet released or reaped: each still
        pins its slot, even when its object was deleted."""
        tiers = {t.name: t.stats().as_dict() for t in self.tiers}
        host = tiers[self.host.name]
        events = dict(self.events.counts) if self.events is not None else {}
        quotas = {
            (tenant, what): self.tenants.held_and_quota(tenant, what)
            for tenant in self.tenants.names
            for what in COUNTED
        }
        expired = cast(float, host["leases_expired"])  # one of HostTier.stats()'s extra counters
        return Snapshot(
            len(self.leases),
            int(expired),
            len(self.puts.table),
            tiers,
            dict(self.tenants.refused),
            events,
            quotas,
            tenant_evictions(self.lower),
        )

    def tenant_doc(self, tenant: str) -> dict[str, object]:
        """One tenant's part of ``Stats``: its pool and SSD partition, quotas, holdings and
        refusals (all a non-admin token sees)."""
        self.reap()
        tiers: dict[str, object] = {}
        if tenant in self.host.pools:
            tiers[self.host.name] = self.host.pool_stats(tenant)
        for tier in self.lower:
            if hasattr(tier, "partition_stats"):
                tiers[tier.name] = tier.partition_stats(tenant)
        counts = self.tenants.doc(tenant)
        if self.events is not None:
            max_bytes, max_entries = self.tenants.descriptions(tenant)
            counts["quota"].update(described_bytes=max_bytes, described=max_entries)
            counts["held"].update(described_bytes=self.events.held_bytes[tenant], described=self.events.held[tenant])
        return {"tenant": tenant, "tiers": tiers, "puts_in_flight": self.puts.table.of(tenant), **counts}

    def stats_doc(self) -> dict[str, object]:
        """The whole ``Stats`` document, every tenant's part included (on the loop: expired
        leases and reservations are reaped first, so the answer never counts what a reaper
        pass would drop)."""
        self.reap()
        tenants = {name: self.tenant_doc(name) for name in self.host.pools if name}
        snap = self.snapshot()
        breakers = {
            name: {k: v for k, v in s.items() if k.startswith("breaker_")}
            for name, s in snap.tiers.items()
            if "breaker_open" in s
        }
        return {
            "server": {
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 3),
                "closing": self._closing,
                "dumpable": dumpable(),
            },
            "tiers": snap.tiers,
            "store": self.metrics.counters.as_json(),
            "stage_latency": self.metrics.stage_latency(),
            "leases": {
                "held": snap.leases_held,
                "expired": snap.leases_expired,
                "granted": self.metrics.counters.leases_granted,
                "released": self.metrics.counters.leases_released,
                "release_calls": self.metrics.counters.release_calls,
            },
            "puts_in_flight": snap.puts_in_flight,
            "write_throughs_in_flight": self.core.writer.in_flight,
            "breakers": breakers,
            "data_tickets": {
                "outstanding": len(self.tickets),
                "minted": self.tickets.minted,
                "redeemed": self.tickets.redeemed,
                "refused": self.tickets.refused,
            },
            "puts_fenced": self.puts.table.fenced,
            "tenants": tenants,
            "kv_events": self._events_doc(snap),
        }

    def _events_doc(self, snap: Snapshot) -> dict[str, object] | None:
        if self.events is None:
            return None
        doc: dict[str, object] = {"recorded": snap.events, "held": self.events.holdings()}
        if self.publisher is not None:
            doc.update(
                epoch=self.publisher.epoch,
                published=dict(self.publisher.published),
                streams={t: {"endpoint": e, "replay": r} for t, (e, r) in self.publisher.endpoints.items()},
            )
        return doc


__all__ = ["StoreStats"]
