"""The scheduler half's counting: one call updates both the ``HitStats`` record (the stats
file, vLLM's connector stats, the request log) and the Prometheus counters, under one lock
(the I/O thread counts bytes and failures too).  No decisions are made here."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path

from connector.requests import ReqState, count_request
from kvstore.metrics import HitStats, prometheus, set_tier_gauges
from kvstore.policy import Decision

log = logging.getLogger("kvstore.connector")


class SchedulerCounters:
    def __init__(self, remembered: int) -> None:
        """``remembered``: how many requests counted as not cached are kept, to count each once."""
        self.lock = threading.Lock()  # guards self.stats
        self.stats = HitStats()
        self.prom = prometheus()
        self._remembered = remembered
        self._not_cached: OrderedDict[str, None] = OrderedDict()  # requests counted in stats.not_cached
        self._interval_base: dict[str, int] = {}  # counters at the last interval()

    def decided(
        self, st: ReqState, n: int, outcome: str, decision: Decision, chunk_size: int, host: str, generated: int
    ) -> dict[str, object]:
        """A request's lookup, counted once with its decision's ``outcome``; returns its stats
        entry (``connector.requests.count_request``)."""
        with self.lock:
            self.stats.add("decisions", outcome)
            entry = count_request(st, n, self.stats, self.prom, chunk_size, host, generated)
        self.prom["decisions"].labels(outcome).inc()
        if decision.hit:
            self.prom["decision_seconds"].labels("load").inc(decision.load_s)
            self.prom["decision_seconds"].labels("recompute").inc(decision.hit_recompute_s)
        return entry

    def prefetched(self) -> None:
        with self.lock:
            self.stats.prefetches += 1

    def waited(self, what: str, how: str) -> None:
        self.prom["waits"].labels(what, how).inc()

    def unknown_params(self, keys: tuple[str, ...]) -> None:
        with self.lock:
            self.stats.add("params_unknown_keys", ",".join(keys))
        self.prom["params_unknown"].inc()

    def moved(self, tier: str, direction: str, n: int) -> None:
        with self.lock:
            self.stats.add("bytes_by_tier", f"{tier}:{direction}", n)
        self.prom["bytes"].labels(tier, direction).inc(n)

    def failed(self, tier: str, reason: str) -> None:
        with self.lock:
            self.stats.add("failures", f"{tier}:{reason}")
        self.prom["failures"].labels(tier, reason).inc()

    def not_cached(self, req_id: str, reason: str) -> None:
        """``req_id`` is neither looked up nor saved (``reason``: ``no_prompt_tokens``, an
        embeddings prompt; ``multimodal_unhashed``, an item vLLM gave no identifier).  Counted once
        per request (the engine may ask again after a preemption); the first of each reason
        is logged, so a service that sends images sees why they never hit."""
        with self.lock:
            if req_id in self._not_cached:
                return
            self._not_cached[req_id] = None
            if len(self._not_cached) > self._remembered:
                self._not_cached.popitem(last=False)
            first = reason not in self.stats.not_cached
            self.stats.add("not_cached", reason)
        self.prom["not_cached"].labels(reason).inc()
        if first:
            log.warning(
                "KVStoreConnector: %s requests are not cached (request %s): they are recomputed, "
                "never loaded or saved; counted in kvstore_requests_not_cached",
                reason,
                req_id,
            )

    def reported(self, committed: int, failures: dict[str, int], stages: list[tuple[str, float]]) -> None:
        """A worker report's counts: saves committed so far, failures, lifecycle stage times."""
        with self.lock:
            self.stats.saves_committed = committed
            for reason, n in failures.items():
                self.stats.add("failures", reason, n)
        for stage, seconds in stages:
            self.prom["stage"].labels(stage).observe(seconds)

    def reset(self, dropped: int, cancelled: int, seconds: float) -> None:
        with self.lock:
            self.stats.add("resets", "total")
            self.stats.add("resets", "host_objects_dropped", dropped)
            self.stats.add("resets", "saves_cancelled", cancelled)
        self.prom["resets"].inc()
        self.prom["reset_seconds"].inc(seconds)

    def interval(self) -> dict[str, int]:
        """Counters since the last call, as flat ``name`` or ``name:label`` keys."""
        with self.lock:
            now = self.stats.flat_counters()
        delta = {k: v - self._interval_base.get(k, 0) for k, v in now.items()}
        self._interval_base = now
        return {k: v for k, v in delta.items() if v}

    def write(self, tiers: dict[str, dict], path: Path | None, committed: int, cost_model: object) -> None:
        """Tier gauges, and the stats file when ``path`` is set."""
        set_tier_gauges(self.prom, tiers)
        if path is not None:
            with self.lock:
                self.stats.saves_committed = committed
                self.stats.write(path, tiers=tiers, cost_model=cost_model)


__all__ = ["SchedulerCounters"]
