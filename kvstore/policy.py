"""Load-or-recompute cost model (docs/architecture.md#load-or-recompute).  Runs on the scheduler side.

A hit is a list of contiguous ``Span``s (tokens ``start..end`` of the prompt, held by one
object in one tier).  For span ``i``::

    load_time(i)      = latency(tier_i) + bytes_i / bandwidth(tier_i)
    recompute_time(i) = a * tokens_i + b * sum(position) / 1024 over the span's tokens

Recompute cost grows with depth: every new token attends to all tokens before it, so a
span deep in a prompt costs more than the same number of tokens at its start.  ``a`` (per
token) and ``b`` (per token per 1024 tokens of context) are fitted online by ridge
regression with forgetting from the engine's own steps (``observe_step``: the tokens each
request computed in the step, after how many, and the step's wall time; the intercept
soaks up the per-step overhead), starting from the configured prefill rate.

The plan loads the prefix ``0..k`` that saves the most time (the sum of ``recompute - load``
over the prefix: a prefix, because span i+1 is useless without span i) and recomputes the
rest.  So a hit whose tail sits on a slow tier loads its fast prefix only (a *partial*
plan), and a throttled tier stops being chosen as soon as its EWMA bandwidth says so.

Exploration: a tier that has not been measured for ``explore_after_s`` is *probed*: the
decision names it (``Decision.probe``) and the caller reads the first span on it in the
background, without making any request wait for it, then says ``probe_done``; so a tier
that was slow and has recovered is chosen again.  One probe per tier is in flight at a
time (a slow one must not pile more reads on a congested link), and a reading taken after
a long silence replaces the estimate instead of being averaged into it.  Every ``Decision`` carries its inputs for
the stats and metrics.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


class Rate:
    """A throughput (units per second) as an exponentially weighted moving average of the
    *time per unit*: one slow transfer moves it as much as its seconds say (an average of
    rates would let a 50x slower transfer move it by 30% only).  ``replace`` starts over
    from one fresh measurement (a probe after a long silence: the old value is stale)."""

    __slots__ = ("_per_unit", "alpha")

    def __init__(self, value: float, alpha: float = 0.3) -> None:
        self._per_unit, self.alpha = 1.0 / value, alpha

    @property
    def value(self) -> float:
        return 1.0 / self._per_unit

    def observe(self, units: float, seconds: float, replace: bool = False) -> None:
        if units > 0 and seconds > 0:
            sample = seconds / units
            self._per_unit = sample if replace else self._per_unit + self.alpha * (sample - self._per_unit)


DEFAULT_BANDWIDTH = {"host": 8e9, "ssd": 1.0e9, "redis": 0.8e9, "remote": 1.5e9}
DEFAULT_LATENCY = {"host": 20e-6, "ssd": 300e-6, "redis": 500e-6, "remote": 500e-6}
KILO = 1024.0  # depth unit of the attention term: positions are counted in units of 1024 tokens


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens ``start..end`` of a prompt held by one object of ``nbytes`` in ``tier``."""

    tier: str
    nbytes: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Decision:
    """How many spans of a hit to load, and why (inputs included, for stats and metrics)."""

    load: int  # spans to load (a prefix of the hit)
    hit: int  # spans found
    load_s: float  # predicted time to load the chosen prefix
    recompute_s: float  # predicted time to recompute the chosen prefix
    hit_recompute_s: float  # predicted time to recompute the whole hit
    probe: str | None = None  # a stale tier to re-measure in the background
    tiers: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        if self.hit == 0:
            return "miss"
        if self.load == 0:
            return "recompute"
        return "load" if self.load == self.hit else "partial"

    def as_dict(self) -> dict[str, object]:
        return {
            "outcome": self.outcome,
            "load": self.load,
            "hit": self.hit,
            "load_ms": round(self.load_s * 1e3, 3),
            "recompute_ms": round(self.recompute_s * 1e3, 3),
            "hit_recompute_ms": round(self.hit_recompute_s * 1e3, 3),
            "probe": self.probe,
            "tiers": list(self.tiers),
        }


class PrefillFit:
    """``seconds = c + a * tokens + b * token_depth`` by ridge regression with forgetting.

    ``token_depth`` is the sum over the step's new tokens of their position / 1024.  The
    prior is ``a = 1 / rate``, ``b = 0``, ``c = 0``.  The slopes' prior is weak (a fraction of
    one observation), the intercept's strong: when every step has the same shape (one full
    prompt each) the three are not separable, and the marginal cost must then take the
    whole step time rather than hide it in a per-step overhead that loading would not save.
    Steps of other shapes (decodes, remainders after a hit) identify the overhead.
    ``forget`` discounts old steps."""

    def __init__(
        self, tokens_per_s: float, slope_weight: float = 0.02, overhead_weight: float = 50.0, forget: float = 0.9
    ) -> None:
        self.forget = forget
        self._prior = np.array([0.0, 1.0 / tokens_per_s, 0.0])
        scale = np.array([1.0, 2048.0, 2048.0])  # typical feature sizes: the ridge is per unit
        self._ridge = np.diag(np.array([overhead_weight, slope_weight, slope_weight]) * scale**2)
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self.coef = self._prior.copy()
        self.observations = 0

    def observe(self, tokens: float, depth: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        x = np.array([1.0, tokens, depth])
        self._xx = self.forget * self._xx + np.outer(x, x)
        self._xy = self.forget * self._xy + x * seconds
        lhs = self._xx + self._ridge
        rhs = self._xy + self._ridge @ self._prior
        coef = np.linalg.solve(lhs, rhs)
        coef[1] = max(coef[1], 1e-9)  # a token never costs nothing
        coef[2] = max(coef[2], 0.0)  # nor less for being deeper
        self.coef = coef
        self.observations += 1

    def seconds(self, start: int, end: int) -> float:
        """Marginal time to compute tokens ``start..end`` (no per-step overhead)."""
        n = max(end - start, 0)
        return float(self.coef[1] * n + self.coef[2] * depth_of(start, end))

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / float(self.coef[1])


def depth_of(start: int, end: int) -> float:
    """Sum of positions ``start..end-1``, in units of 1024 tokens."""
    n = max(end - start, 0)
    return n * (start + end - 1) / 2.0 / KILO


@dataclass
class CostModel:
    prefill_tokens_per_s: float = 5000.0
    explore_after_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    bandwidth: dict[str, Rate] = field(default_factory=lambda: {k: Rate(v) for k, v in DEFAULT_BANDWIDTH.items()})
    latency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY))
    _fit: PrefillFit = field(init=False)
    _measured: dict[str, float] = field(default_factory=dict)  # tier -> when last measured
    _probed: dict[str, float] = field(default_factory=dict)  # tier -> when last probed
    _probing: set[str] = field(default_factory=set)  # tiers with a probe in flight
    _observed: set[str] = field(default_factory=set)  # tiers a transfer was measured from (not just the prior)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # guards the rates, the fit, _measured, _probed

    def __post_init__(self) -> None:
        self._fit = PrefillFit(self.prefill_tokens_per_s)

    # --- observations ------------------------------------------------------------------------

    def observe_step(self, work: Sequence[tuple[int, int]], seconds: float) -> None:
        """One engine step that computed ``n`` new tokens after ``done`` for each ``(done, n)``."""
        tokens = sum(n for _, n in work)
        depth = sum(depth_of(done, done + n) for done, n in work)
        with self._lock:
            self._fit.observe(tokens, depth, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` new tokens at the start of a prompt (no depth known)."""
        self.observe_step([(0, tokens)], seconds)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float, replace: bool = False) -> None:
        """A read of ``nbytes`` from ``tier`` took ``seconds``.  The estimate is replaced
        rather than averaged after ``explore_after_s`` without a measurement, or when asked
        (``replace``: a reading that proves the estimate wrong, such as a missed deadline)."""
        now = self.clock()
        with self._lock:
            stale = now - self._measured.get(tier, now) >= self.explore_after_s
            rate = self.bandwidth.setdefault(tier, Rate(DEFAULT_BANDWIDTH.get(tier, 1e9)))
            rate.observe(nbytes, seconds, replace=stale or replace)
            self._measured[tier] = now
            self._observed.add(tier)

    def knows(self, tier: str) -> bool:
        """Whether a transfer from ``tier`` was measured (else its estimate is the prior)."""
        with self._lock:
            return tier in self._observed

    def knows_prefill(self) -> bool:
        """Whether a prefill step was fitted (else ``recompute_seconds`` is the prior's)."""
        with self._lock:
            return self._fit.observations > 0

    # --- predictions -------------------------------------------------------------------------

    def load_seconds(self, tier: str, nbytes: int) -> float:
        bw = self.bandwidth.get(tier, Rate(1e9)).value
        return self.latency.get(tier, 1e-3) + nbytes / bw

    def recompute_seconds(self, tokens: int, start: int = 0) -> float:
        """Time to compute ``tokens`` new tokens after ``start`` (depth-dependent)."""
        return self._fit.seconds(start, start + tokens)

    @property
    def prefill_rate(self) -> float:
        return self._fit.tokens_per_s

    # --- the decision --------------------------------------------------------------------------

    def plan(self, spans: Sequence[Span], host: str = "host") -> Decision:
        """How many spans of the contiguous hit ``spans`` to load (see the module docstring)."""
        best_k, best, total, load_s, rec_s = 0, 0.0, 0.0, 0.0, 0.0
        chosen = (0.0, 0.0)
        for i, s in enumerate(spans):
            ls = self.load_seconds(s.tier, s.nbytes)
            rs = self._fit.seconds(s.start, s.end)
            load_s, rec_s = load_s + ls, rec_s + rs
            total += rs - ls
            if total > best:
                best_k, best, chosen = i + 1, total, (load_s, rec_s)
        probe = self._probe(spans, best_k, host)
        return Decision(best_k, len(spans), chosen[0], chosen[1], rec_s, probe, tuple(s.tier for s in spans))

    def _probe(self, spans: Sequence[Span], k: int, host: str) -> str | None:
        """A tier of the spans not loaded that has not been measured for a while."""
        now = self.clock()
        with self._lock:
            for s in spans[k:]:
                if s.tier == host:
                    continue
                last = max(self._measured.setdefault(s.tier, now), self._probed.get(s.tier, -math.inf))
                if now - last >= self.explore_after_s and s.tier not in self._probing:
                    self._probed[s.tier] = now  # one probe per period, and one at a time
                    self._probing.add(s.tier)
                    return s.tier
        return None

    def probe_done(self, tier: str) -> None:
        """The probe ``plan`` asked for has ended (its reading, if any, was observed)."""
        with self._lock:
            self._probing.discard(tier)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            a, b, c = (float(v) for v in (self._fit.coef[1], self._fit.coef[2], self._fit.coef[0]))
            d = {
                "prefill_tokens_per_s": 1.0 / a,
                "seconds_per_token": a,
                "seconds_per_token_per_1k_depth": b,
                "step_overhead_s": c,
                "prefill_steps_observed": self._fit.observations,
            }
            d.update({f"bandwidth_{k}": v.value for k, v in self.bandwidth.items()})
        return d
