"""Counters of the store process, served two ways: the ``Stats`` RPC and Prometheus ``/metrics``.

Server side.  ``ServerCounters`` is the one record the servicer and store update (from the
event loop); the Prometheus view is derived from it at scrape time by a collector on the
server's *own* registry (no process-wide collectors, so tests may run several servers in one
process).  Stage latencies are histograms observed as they happen.  ``kvstore.server.metricshttp``
serves the registry over HTTP.

Prometheus names (all prefixed ``kvstore_server_``); every hit rate names its denominator:

* ``lookup_keys_total`` (denominator) and ``lookup_hits_total{tier}``: keys of Lookup calls
  and the contiguous hits among them, by the tier that had each; ``lookups_total``: calls.
* ``gets_total{path,tier}`` / ``get_misses_total{path}``: Get (path "shm"), GetStream
  (path "stream") and the data channel (path "tcp"); ``puts_total{path,outcome}``.
* ``bytes_total{tier,direction}``: host read = bytes served to clients, host write = bytes
  committed by clients, ssd/redis read = promotions, ssd/redis write = write-through.
* ``stage_seconds{stage}``: lookup, get, get_stream, get_tcp, put_commit, put_stream,
  put_tcp, promote, write_through.
* ``leases_held`` (gauge), ``leases_expired_total``, ``leases_granted_total``,
  ``lease_release_calls_total`` (ReleaseLease calls; clients batch their releases),
  ``puts_in_flight`` (gauge), ``tenant_refused_total{tenant,what}`` (a quota reached, a
  stream cut at its deadline), ``evictions_total{tier}``, ``tier_objects{tier}``,
  ``tier_bytes_used{tier}``, ``tier_capacity_bytes{tier}``, ``breaker_open{tier}``,
  ``failures_total{reason}``; ``tenant_evictions_total{tenant,tier}``: objects evicted
  within a tenant's own Redis budget (docs/redis-tenants.md; its refusals are
  ``tenant_refused_total{what="redis_bytes"}``).
* ``tenant_held{tenant,what}`` and ``tenant_quota{tenant,what}``: reservations, leases,
  streams, connections and data tickets each tenant holds, beside its quota.
  ``tenant_refused_total`` also counts ``permission`` (a call without the permission it
  needs), ``tickets`` and ``described_bytes`` / ``described`` (``Describe`` beyond the
  tenant's description quota); refusals of callers with no tenant yet are ``failures_total``
  (``grpc_unauthenticated``, ``grpc_request_timeout``, ``data_unauthenticated_per_peer``,
  ``shm_unauthenticated_per_peer``, ...; docs/store-bounds.md).
  ``ServerMetrics.tenant_labels`` (``--metrics-tenant-labels``) says what their ``tenant``
  label is: ``name``; ``hash`` (``tenant_label``: "t" and the first 12 hex digits of the
  name's sha256, so a scraper tells tenants apart without learning their names); ``off``
  (no per-tenant series at all; docs/exposure.md).
* ``kv_events_total{kind}`` (``--kv-events``: stored, removed, cleared, dropped) and
  ``kv_events_undescribed`` (objects held that no client described: never announced).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.metrics import quantiles
from kvstore.store.observer import StoreObserver
from tiers.base import PutResult, Tier

log = logging.getLogger("kvstore.server.servicer")

PREFIX = "kvstore_server_"
_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
STAGE_SAMPLES = 4096  # latencies kept per stage for p50/p99 (Stats, kvstore stats)
STAGES = ("lookup", "get", "get_stream", "get_tcp", "put_commit", "put_stream", "put_tcp", "promote", "write_through")


@dataclass(slots=True)
class ServerCounters:
    """Plain counters; each dict maps a label (or a label tuple) to a count."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: dict[str, int] = field(default_factory=dict)  # tier -> keys
    gets: dict[tuple[str, str], int] = field(default_factory=dict)  # (path, tier) -> calls
    get_misses: dict[str, int] = field(default_factory=dict)  # path -> calls
    puts: dict[tuple[str, str], int] = field(default_factory=dict)  # (path, outcome) -> calls
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (tier, direction) -> bytes
    promotions: dict[str, int] = field(default_factory=dict)  # from tier -> objects
    write_through: dict[tuple[str, str], int] = field(default_factory=dict)  # (tier, result)
    leases_granted: int = 0
    leases_released: int = 0  # released while still valid
    release_calls: int = 0  # ReleaseLease calls (each may carry many lease ids)
    puts_reaped: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    stages: dict[str, list[float]] = field(default_factory=dict)  # stage -> [count, seconds]

    @staticmethod
    def bump(table: dict, label, n: float = 1) -> None:
        table[label] = table.get(label, 0) + n

    def fail(self, reason: str) -> None:
        self.bump(self.failures, reason)

    def as_json(self) -> dict[str, object]:
        def flat(table: dict) -> dict[str, float]:
            return {(".".join(k) if isinstance(k, tuple) else k): v for k, v in dict(table).items()}

        return {
            "lookups": self.lookups,
            "lookup_keys": self.lookup_keys,
            "lookup_hits": flat(self.lookup_hits),
            "gets": flat(self.gets),
            "get_misses": flat(self.get_misses),
            "puts": flat(self.puts),
            "bytes": flat(self.bytes),
            "promotions": flat(self.promotions),
            "write_through": flat(self.write_through),
            "leases_granted": self.leases_granted,
            "leases_released": self.leases_released,
            "release_calls": self.release_calls,
            "puts_reaped": self.puts_reaped,
            "failures": flat(self.failures),
            "stages": {k: {"count": v[0], "seconds": v[1]} for k, v in dict(self.stages).items()},
        }


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Gauges read at scrape time (from the HTTP thread: the callable must be thread-safe)."""

    leases_held: int
    leases_expired: int
    puts_in_flight: int
    tiers: dict[str, dict[str, object]]  # tier name -> TierStats.as_dict()
    refused: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, quota) -> refusals
    events: dict[str, int] = field(default_factory=dict)  # KV events: kind -> count, "undescribed" objects
    quotas: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (tenant, what) -> (held, quota)
    tenant_evictions: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, tier) -> evicted


class ServerMetrics:
    """The counters plus the Prometheus registry that exposes them."""

    def __init__(self, snapshot: Callable[[], Snapshot] | None = None) -> None:
        self.counters = ServerCounters()
        self.tenant_labels = "name"  # name, hash or off (see the module docstring)
        self.registry = CollectorRegistry(auto_describe=False)
        self._stage = Histogram(
            PREFIX + "stage_seconds",
            "Seconds spent in each server stage",
            ["stage"],
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self._snapshot = snapshot
        self._stage_of = {stage: self._stage.labels(stage) for stage in STAGES}  # labels() locks
        self._tracer = None  # kvstore.trace.Tracer with --trace-path
        self._samples: dict[str, deque[float]] = {}  # stage -> its last latencies (p50/p99)
        self._lanes: dict[str, object] = {}
        self.registry.register(_Collector(self))

    def bind(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            return Snapshot(0, 0, 0, {})
        return self._snapshot()

    def trace_to(self, tracer) -> None:
        """Also put every observed stage in ``tracer`` (a ``kvstore.trace.Tracer``): one
        set of lanes per stage (concurrent calls overlap)."""
        from kvstore.trace import Lanes

        self._tracer = tracer
        self._lanes = {stage: Lanes(tracer, stage, 100 * i) for i, stage in enumerate(STAGES)}

    def observe(self, stage: str, seconds: float) -> None:
        if self._tracer is not None:
            now = time.monotonic()
            lanes = self._lanes.get(stage)
            if lanes is None:
                from kvstore.trace import Lanes

                lanes = self._lanes[stage] = Lanes(self._tracer, stage, 100 * len(self._lanes))
            lanes.span(stage, now - seconds, now)
        child = self._stage_of.get(stage)
        (child if child is not None else self._stage.labels(stage)).observe(seconds)
        entry = self.counters.stages.setdefault(stage, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        samples = self._samples.get(stage)
        if samples is None:
            samples = self._samples[stage] = deque(maxlen=STAGE_SAMPLES)
        samples.append(seconds)

    def stage_latency(self) -> dict[str, dict[str, float]]:
        """n, p50, p99 and max seconds of each stage over its last ``STAGE_SAMPLES``."""
        return {stage: quantiles(list(s)) for stage, s in list(self._samples.items()) if s}

    def timer(self, stage: str) -> _Timer:
        return _Timer(self, stage)


class _Timer:
    """``with metrics.timer("lookup"):`` observes the block's wall time."""

    __slots__ = ("_metrics", "_stage", "_t0")

    def __init__(self, metrics: ServerMetrics, stage: str) -> None:
        self._metrics, self._stage, self._t0 = metrics, stage, 0.0

    def __enter__(self) -> _Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._metrics.observe(self._stage, time.perf_counter() - self._t0)


class _Collector:
    """Turns ``ServerCounters`` and a ``Snapshot`` into Prometheus families at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        c, snap = self._m.counters, self._m.snapshot()
        mode = self._m.tenant_labels
        refused, quotas = _relabel(snap.refused, mode), _relabel(snap.quotas, mode)
        yield _counter("lookups", "Lookup calls", [], {(): c.lookups})
        yield _counter("lookup_keys", "Keys looked up (the denominator of the hit rate)", [], {(): c.lookup_keys})
        yield _counter(
            "lookup_hits",
            "Contiguous hits among looked-up keys, by tier",
            ["tier"],
            {(k,): v for k, v in dict(c.lookup_hits).items()},
        )
        yield _counter(
            "gets", "Get (shm), GetStream (stream) and data-channel (tcp) hits", ["path", "tier"], dict(c.gets)
        )
        yield _counter(
            "get_misses",
            "Get, GetStream and data-channel misses",
            ["path"],
            {(k,): v for k, v in dict(c.get_misses).items()},
        )
        yield _counter("puts", "Puts by path and outcome", ["path", "outcome"], dict(c.puts))
        yield _counter("bytes", "Bytes by tier and direction", ["tier", "direction"], dict(c.bytes))
        yield _counter("failures", "Failures by reason", ["reason"], {(k,): v for k, v in dict(c.failures).items()})
        yield _counter("leases_granted", "Leases granted", [], {(): c.leases_granted})
        yield _counter("lease_release_calls", "ReleaseLease calls (clients batch lease ids)", [], {(): c.release_calls})
        yield _counter("leases_expired", "Leases that expired before release", [], {(): snap.leases_expired})
        yield _counter(
            "evictions",
            "Objects evicted, by tier",
            ["tier"],
            {(t,): s.get("evictions", 0) for t, s in snap.tiers.items()},
        )
        yield _counter(
            "tenant_refused",
            "Calls refused at a tenant's quota (or cut at a stream deadline), by tenant and what",
            ["tenant", "what"],
            refused,
        )
        yield _counter(
            "tenant_evictions",
            "Objects evicted within a tenant's own budget, by tenant and tier",
            ["tenant", "tier"],
            _relabel(snap.tenant_evictions, mode),
        )
        yield _counter(
            "kv_events",
            "KV events published (stored, removed, cleared) and dropped unpublished",
            ["kind"],
            {(k,): v for k, v in snap.events.items() if k != "undescribed"},
        )
        yield _gauge(
            "kv_events_undescribed",
            "Objects held whose tokens no client described (never announced)",
            [],
            {(): snap.events.get("undescribed", 0)},
        )
        yield _gauge("leases_held", "Leases held now", [], {(): snap.leases_held})
        yield _gauge(
            "tenant_held",
            "What each tenant holds now (reservations, leases, streams, connections, tickets)",
            ["tenant", "what"],
            {k: held for k, (held, _) in quotas.items()},
        )
        yield _gauge(
            "tenant_quota",
            "Each tenant's quota of what it may hold at once",
            ["tenant", "what"],
            {k: quota for k, (_, quota) in quotas.items()},
        )
        yield _gauge("puts_in_flight", "Reserved, uncommitted puts", [], {(): snap.puts_in_flight})
        for name, key, doc in (
            ("tier_objects", "objects", "Objects held, per tier"),
            ("tier_bytes_used", "bytes_used", "Bytes held, per tier"),
            ("tier_capacity_bytes", "capacity_bytes", "Capacity, per tier (0: unbounded or unknown)"),
            ("breaker_open", "breaker_open", "Circuit breakers open now (1), per network tier"),
        ):
            values = {(t,): s[key] for t, s in snap.tiers.items() if key in s}
            yield _gauge(name, doc, ["tier"], values)


def tenant_label(tenant: str, mode: str) -> str:
    """A tenant's ``tenant`` label under ``mode`` name or hash."""
    return tenant if mode == "name" else "t" + hashlib.sha256(tenant.encode()).hexdigest()[:12]


def _relabel(values: dict, mode: str) -> dict:
    """Per-(tenant, what) values with the tenant relabelled; none when ``mode`` is off."""
    if mode == "off":
        return {}
    return {(tenant_label(t, mode), what): v for (t, what), v in dict(values).items()}


def _counter(name: str, doc: str, labels: list[str], values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    for label_values, value in values.items():
        family.add_metric(list(label_values), float(value))
    return family


def _gauge(name: str, doc: str, labels: list[str], values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
    for label_values, value in values.items():
        family.add_metric(list(label_values), float(value))
    return family


class ServerObserver(StoreObserver):
    """The store core's observer hooks as the server's counters (the names above)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def tier_failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.metrics.counters.fail(f"{tier.name}_{op}_error")
        log.warning("%s %s failed: %s", tier.name, op, err)

    def promoted(self, tier: Tier, size: int, seconds: float) -> None:
        c = self.metrics.counters
        c.bump(c.promotions, tier.name)
        c.bump(c.bytes, (tier.name, "read"), size)
        self.metrics.observe("promote", seconds)

    def promote_no_room(self) -> None:
        self.metrics.counters.fail("promote_no_room")

    def forged(self, tier: Tier, err: BaseException) -> None:
        self.metrics.counters.fail(f"{tier.name}_forged")
        log.warning("%s: refused and removed a forged object: %s", tier.name, err)

    def written(self, tier: Tier, result: PutResult, size: int, err: BaseException | None) -> None:
        c = self.metrics.counters
        c.bump(c.write_through, (tier.name, result.value))
        if result is PutResult.STORED:
            c.bump(c.bytes, (tier.name, "write"), size)
        elif result in (PutResult.FAILED, PutResult.NO_ROOM):
            c.fail(f"write_through_{tier.name}_{result.value}")

    def write_down_done(self, seconds: float) -> None:
        self.metrics.observe("write_through", seconds)

    def write_down_dropped(self) -> None:
        self.metrics.counters.fail("write_down_dropped")


__all__ = ["PREFIX", "STAGES", "ServerCounters", "ServerMetrics", "ServerObserver", "Snapshot", "tenant_label"]
