"""Load-or-recompute cost model (DESIGN §9).  Runs on the scheduler side.

For a contiguous hit whose chunk ``i`` lives in tier ``t_i``::

    load_time(i)      = latency(t_i) + chunk_bytes / bandwidth(t_i)
    recompute_time(i) = chunk_tokens / prefill_rate

The plan loads the prefix ``0..k`` that saves the most time (the sum of
``recompute - load`` over the prefix, a prefix because chunk i+1 is useless without
chunk i) and recomputes the rest.  Rates are EWMAs of real transfers and steps, seeded by
configuration, so a throttled tier stops being chosen within a few observations.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Rate:
    """An exponentially weighted moving average of a throughput (units per second)."""

    value: float
    alpha: float = 0.3

    def observe(self, units: float, seconds: float) -> None:
        if units > 0 and seconds > 0:
            self.value += self.alpha * (units / seconds - self.value)


DEFAULT_BANDWIDTH = {"host": 8e9, "ssd": 1.0e9, "redis": 0.8e9, "remote": 1.5e9}
DEFAULT_LATENCY = {"host": 20e-6, "ssd": 300e-6, "redis": 500e-6, "remote": 500e-6}


@dataclass
class CostModel:
    prefill_tokens_per_s: float = 5000.0
    bandwidth: dict[str, Rate] = field(default_factory=lambda: {k: Rate(v) for k, v in DEFAULT_BANDWIDTH.items()})
    latency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY))
    _prefill: Rate = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # guards the rates

    def __post_init__(self) -> None:
        self._prefill = Rate(self.prefill_tokens_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._prefill.observe(tokens, seconds)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bandwidth.setdefault(tier, Rate(DEFAULT_BANDWIDTH.get(tier, 1e9))).observe(nbytes, seconds)

    def load_seconds(self, tier: str, nbytes: int) -> float:
        bw = self.bandwidth.get(tier, Rate(1e9)).value
        return self.latency.get(tier, 1e-3) + nbytes / bw

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self._prefill.value

    @property
    def prefill_rate(self) -> float:
        return self._prefill.value

    def plan(self, tiers: Sequence[str], chunk_bytes: int, chunk_tokens: int) -> int:
        """How many chunks of the contiguous hit (tiers[i] = tier of chunk i) to load."""
        gain = self.recompute_seconds(chunk_tokens)
        best_k, best, total = 0, 0.0, 0.0
        for i, tier in enumerate(tiers):
            total += gain - self.load_seconds(tier, chunk_bytes)
            if total > best:
                best_k, best = i + 1, total
        return best_k

    def snapshot(self) -> dict[str, float]:
        d = {"prefill_tokens_per_s": self._prefill.value}
        d.update({f"bandwidth_{k}": v.value for k, v in self.bandwidth.items()})
        return d
