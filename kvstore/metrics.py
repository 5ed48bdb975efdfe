"""Metrics with named denominators (docs/architecture.md#metrics) and their Prometheus counters.

``HitStats`` is the plain record the connector keeps and prints; every rate it reports
names its denominator.  Its stats file is rewritten as each request ends, so writing it
must stay cheap with ``RECENT_MAX`` entries logged: each entry is encoded once and its
JSON text reused (``amend`` is the one way to change a logged entry; it drops that text).
``prometheus()`` returns process-wide counters (created once, so two connector instances in
one process share them instead of colliding).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

_LOCK = threading.Lock()  # guards creation of the process-wide Prometheus collectors
# name -> a prometheus_client Counter, Gauge or Histogram (Any: mypy does not follow prometheus_client, and each
# caller knows which kind its name is)
_PROM: dict[str, Any] = {}


@dataclass
class HitStats:
    requests: int = 0
    requests_hit: int = 0
    tokens_looked_up: int = 0
    tokens_hit: int = 0
    tokens_hit_generated: int = 0  # of tokens_hit: tokens an engine had generated (earlier answers)
    chunks_looked_up: int = 0
    chunks_hit: int = 0
    tokens_hit_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # "<tier>:<read|write>"
    failures: dict[str, int] = field(default_factory=dict)
    not_cached: dict[str, int] = field(default_factory=dict)  # reason -> requests neither looked up nor saved
    prefetches: int = 0
    saves_committed: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # load-or-recompute outcome -> requests
    resets: dict[str, int] = field(default_factory=dict)  # total, host_objects_dropped, saves_cancelled
    params_unknown_keys: dict[str, int] = field(default_factory=dict)  # unknown kv_transfer_params keys -> requests
    recent: list[dict[str, object]] = field(default_factory=list)  # last requests, in order
    RECENT_MAX = 1000

    STAGE_SAMPLES = 4096  # the last latencies kept per stage, for p50/p99

    def __post_init__(self) -> None:
        self._stage_samples: dict[str, deque[float]] = {}
        self._encoded: dict[int, str] = {}  # id(entry) -> its JSON, for the entries in ``recent``

    def log_request(
        self,
        prompt_tokens: int,
        hit_tokens: int,
        tiers: dict[str, int],
        salted: bool,
        decision: dict | None = None,
        req_id: str | None = None,
        generated: int = 0,
        chunks: list[dict] | None = None,
    ) -> dict[str, object]:
        """Append one request's entry (``chunks``: where each hit object came from) and
        return it: its load's stage times are added once the worker reports them."""
        entry: dict[str, object] = {
            "prompt_tokens": prompt_tokens,
            "hit_tokens": hit_tokens,
            "tiers": tiers,
            "salted": salted,
            "generated_hit_tokens": generated,
        }
        if req_id is not None:
            entry["req_id"] = req_id
        if decision is not None:
            entry["decision"] = decision
        if chunks is not None:
            entry["chunks"] = chunks
        self.recent.append(entry)
        for gone in self.recent[: -self.RECENT_MAX]:
            self._encoded.pop(id(gone), None)
        del self.recent[: -self.RECENT_MAX]
        return entry

    def amend(self, entry: dict[str, object], **changes: object) -> None:
        """Change a logged entry (e.g. add its load's stage times once reported)."""
        entry.update(changes)
        self._encoded.pop(id(entry), None)

    def observe_stage(self, stage: str, seconds: float) -> None:
        samples = self._stage_samples.get(stage)
        if samples is None:
            samples = self._stage_samples[stage] = deque(maxlen=self.STAGE_SAMPLES)
        samples.append(seconds)

    def stage_latency(self) -> dict[str, dict[str, float]]:
        """Seconds per stage over the last ``STAGE_SAMPLES`` of each: n, p50, p99, max."""
        return {stage: quantiles(list(samples)) for stage, samples in self._stage_samples.items() if samples}

    def add(self, table: str, key: str, n: int = 1) -> None:
        d = getattr(self, table)
        d[key] = d.get(key, 0) + n

    COUNTERS = (
        "requests",
        "requests_hit",
        "tokens_looked_up",
        "tokens_hit",
        "tokens_hit_generated",
        "chunks_looked_up",
        "chunks_hit",
        "prefetches",
        "saves_committed",
    )
    TABLES = ("tokens_hit_by_tier", "bytes_by_tier", "failures", "not_cached", "decisions", "resets")

    def flat_counters(self) -> dict[str, int]:
        """Every counter as ``name`` or ``table:key`` (e.g. ``tokens_hit_by_tier:ssd``)."""
        out = {name: getattr(self, name) for name in self.COUNTERS}
        for table in self.TABLES:
            out.update({f"{table}:{k}": v for k, v in getattr(self, table).items()})
        return out

    def rates(self) -> dict[str, str]:
        def r(a: int, b: int, what: str) -> str:
            return f"{a}/{b} {what} ({100.0 * a / b:.1f}%)" if b else f"0/0 {what}"

        return {
            "token_hit_rate": r(self.tokens_hit, self.tokens_looked_up, "hit tokens / looked-up prompt tokens"),
            "chunk_hit_rate": r(self.chunks_hit, self.chunks_looked_up, "hit chunks / looked-up full chunks"),
            "request_hit_rate": r(self.requests_hit, self.requests, "requests with a hit / requests"),
            "generated_hit_share": r(
                self.tokens_hit_generated, self.tokens_hit, "hit tokens that were generated / hit tokens"
            ),
        }

    def to_json(self) -> dict[str, object]:
        return json.loads(self.dumps())

    def dumps(self, **extra: object) -> str:
        """The stats (plus ``extra`` sections) as one JSON object, ``recent`` last: the
        counters are encoded afresh, each recent entry only once (``_encoded``)."""
        head: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "recent"}
        head.update(rates=self.rates(), stage_latency=self.stage_latency(), **extra)
        head.pop("recent", None)
        recent = ",".join(self._encode(entry) for entry in self.recent)
        return f'{json.dumps(head, default=str)[:-1]}, "recent": [{recent}]}}'

    def _encode(self, entry: dict[str, object]) -> str:
        text = self._encoded.get(id(entry))
        if text is None:
            text = self._encoded[id(entry)] = json.dumps(entry, default=str)
        return text

    def write(self, path: Path, **extra: object) -> None:
        """Atomically replace ``path`` with the stats (plus ``extra`` sections)."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.dumps(**extra))
        tmp.replace(path)


def quantiles(values: list[float]) -> dict[str, float]:
    """n, p50, p99 and max of ``values`` (nearest rank)."""
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.50), "p99": pick(0.99), "max": ordered[-1]}


def prometheus() -> dict[str, Any]:
    with _LOCK:
        if not _PROM:
            _PROM.update(
                looked_up_tokens=Counter("kvstore_looked_up_tokens", "Prompt tokens looked up"),
                hit_tokens=Counter("kvstore_hit_tokens", "Tokens loaded instead of recomputed", ["tier"]),
                requests=Counter("kvstore_requests", "Requests looked up"),
                request_hits=Counter("kvstore_request_hits", "Requests with at least one loaded chunk"),
                chunks=Counter("kvstore_looked_up_chunks", "Full chunks looked up"),
                chunk_hits=Counter("kvstore_chunk_hits", "Chunks loaded"),
                hit_tokens_generated=Counter(
                    "kvstore_hit_tokens_generated", "Hit tokens that an engine had generated (earlier answers)"
                ),
                bytes=Counter("kvstore_bytes", "Bytes moved", ["tier", "direction"]),
                failures=Counter("kvstore_failures", "Failures by tier and reason", ["tier", "reason"]),
                not_cached=Counter(
                    "kvstore_requests_not_cached",
                    "Requests the connector neither looks "
                    "up nor saves, by reason (no_prompt_tokens: an embeddings prompt; "
                    "multimodal_unhashed: an item without an identifier)",
                    ["reason"],
                ),
                stage=Histogram("kvstore_stage_seconds", "Time to reach each lifecycle stage", ["stage"]),
                decisions=Counter(
                    "kvstore_load_decisions",
                    "Load-or-recompute decisions per request (miss, load, partial, recompute)",
                    ["outcome"],
                ),
                decision_seconds=Counter(
                    "kvstore_decision_seconds",
                    "Predicted seconds of the decided hits, to load (chosen prefix) and to recompute (whole hit)",
                    ["kind"],
                ),
                resets=Counter(
                    "kvstore_cache_resets", "Connector cache resets (reset_cache: weights may have changed in memory)"
                ),
                reset_seconds=Counter("kvstore_cache_reset_seconds", "Seconds spent in connector cache resets"),
                params_unknown=Counter(
                    "kvstore_params_unknown_keys",
                    "Requests whose kv_transfer_params.kvstore held keys this version does not know (ignored)",
                ),
                probes=Counter("kvstore_tier_probes", "Background reads that re-measure a stale tier", ["tier"]),
                waits=Counter("kvstore_lookup_waits", "Lookups that waited, and how they ended", ["on", "outcome"]),
                breaker_open=Gauge("kvstore_breaker_open", "Circuit breakers open now, per network tier", ["tier"]),
                tier_objects=Gauge("kvstore_tier_objects", "Objects held, per tier", ["tier"]),
                tier_bytes_used=Gauge("kvstore_tier_bytes_used", "Bytes held, per tier", ["tier"]),
                tier_capacity=Gauge(
                    "kvstore_tier_capacity_bytes", "Capacity, per tier (0: unbounded or unknown)", ["tier"]
                ),
                tier_evictions=Gauge("kvstore_tier_evictions", "Objects evicted since start, per tier", ["tier"]),
            )
        return _PROM


def set_tier_gauges(prom: dict[str, Any], tiers: dict[str, dict[str, Any]]) -> None:
    """The per-tier gauges from each tier's ``TierStats.as_dict()``."""
    for name, t in tiers.items():
        for gauge, key in (
            ("tier_objects", "objects"),
            ("tier_bytes_used", "bytes_used"),
            ("tier_capacity", "capacity_bytes"),
            ("tier_evictions", "evictions"),
            ("breaker_open", "breaker_open"),
        ):
            if key in t:
                prom[gauge].labels(name).set(float(t[key]))
