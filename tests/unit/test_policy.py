"""The load-or-recompute cost model (``kvstore.policy``): depth-dependent recompute fitted
from steps, rates that react to one slow transfer, partial plans, probes of stale tiers."""

from __future__ import annotations

import pytest

from kvstore.policy import CostModel, Rate, Span, depth_of

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spans(*tiers: str, tokens: int = 256, nbytes: int = MiB) -> list[Span]:
    return [Span(t, nbytes, i * tokens, (i + 1) * tokens) for i, t in enumerate(tiers)]


def true_step_seconds(done: int, n: int) -> float:
    """A synthetic engine: 0.5 ms per token plus 0.2 ms per token per 1024 tokens of context,
    plus 3 ms of per-step overhead."""
    return 0.003 + 5e-4 * n + 2e-4 * depth_of(done, done + n)


def test_depth_of_sums_positions_in_kilotokens():
    assert depth_of(0, 4) == pytest.approx((0 + 1 + 2 + 3) / 1024)
    assert depth_of(1024, 1026) == pytest.approx((1024 + 1025) / 1024)
    assert depth_of(5, 5) == 0


def test_recompute_cost_is_fitted_from_steps_and_grows_with_depth():
    cost = CostModel(prefill_tokens_per_s=20000)  # a wrong start: 0.05 ms per token
    steps = [(0, 2000), (1792, 208), (0, 1000), (1280, 720), (0, 300), (512, 1536), (1920, 80)]
    for _ in range(6):
        for done, n in steps:
            cost.observe_step([(done, n)], true_step_seconds(done, n))
    shallow, deep = cost.recompute_seconds(256, 0), cost.recompute_seconds(256, 1792)
    assert deep > shallow * 1.2  # a deep chunk costs more
    for start in (0, 768, 1792):  # and the marginal cost is learned
        truth = true_step_seconds(start, 256) - 0.003
        assert cost.recompute_seconds(256, start) == pytest.approx(truth, rel=0.1)
    assert 0 <= cost.snapshot()["step_overhead_s"] <= 0.003  # shrunk towards 0 on purpose


def test_same_shape_steps_alone_still_predict_their_own_cost():
    """One full prompt per step: overhead, per-token and depth terms are not separable; the
    fit must still predict a whole prompt, and charge a deep chunk more than a shallow one."""
    cost = CostModel(prefill_tokens_per_s=20000)
    for _ in range(10):
        cost.observe_step([(0, 2000)], true_step_seconds(0, 2000))
    assert cost.recompute_seconds(2000) == pytest.approx(true_step_seconds(0, 2000), rel=0.05)
    assert cost.recompute_seconds(256, 1792) > cost.recompute_seconds(256, 0)


def test_the_prior_holds_until_steps_say_otherwise():
    cost = CostModel(prefill_tokens_per_s=4000)
    assert cost.recompute_seconds(1000) == pytest.approx(0.25)
    assert cost.prefill_rate == pytest.approx(4000)


def test_one_slow_transfer_moves_the_rate_by_its_seconds():
    r = Rate(1e9)
    r.observe(10 * MiB, 10 * MiB / 1e7)  # one transfer 100x slower
    assert r.value < 4e7  # an average of rates would still say ~7e8
    r.observe(10 * MiB, 10 * MiB / 1e9, replace=True)
    assert r.value == pytest.approx(1e9)


def test_plan_loads_the_fast_prefix_and_recomputes_a_slow_tail():
    cost = CostModel(prefill_tokens_per_s=10000)  # 25.6 ms per 256-token chunk
    cost.observe_transfer("ssd", 10 * MiB, 10 * MiB / 1e7)  # ssd measured at ~10 MB/s: 100 ms a chunk
    d = cost.plan(spans("host", "host", "host", "ssd", "ssd"))
    assert (d.load, d.hit, d.outcome) == (3, 5, "partial")
    assert d.recompute_s > d.load_s
    assert cost.plan(spans("ssd", "ssd")).outcome == "recompute"
    assert cost.plan(spans("host", "host")).outcome == "load"
    assert cost.plan([]).outcome == "miss"


def test_a_stale_slow_tier_is_probed_once_per_period_and_a_fresh_reading_replaces_it():
    clock = Clock()
    cost = CostModel(prefill_tokens_per_s=10000, explore_after_s=30, clock=clock)
    cost.observe_transfer("redis", 10 * MiB, 10 * MiB / 1e7)  # slow now
    d = cost.plan(spans("redis", "redis"))
    assert d.outcome == "recompute" and d.probe is None  # just measured: no probe
    clock.now += 31
    d = cost.plan(spans("redis", "redis"))
    assert d.outcome == "recompute" and d.probe == "redis"  # stale: read one in the background
    assert cost.plan(spans("redis", "redis")).probe is None  # once per period
    clock.now += 31
    assert cost.plan(spans("redis", "redis")).probe is None  # and never two at a time
    cost.observe_transfer("redis", MiB, MiB / 2e9)  # the probe finds it recovered
    cost.probe_done("redis")
    assert cost.plan(spans("redis", "redis")).outcome == "load"


def test_a_tier_in_use_is_averaged_not_replaced():
    clock = Clock()
    cost = CostModel(explore_after_s=30, clock=clock)
    cost.observe_transfer("ssd", MiB, MiB / 1e9)
    clock.now += 1
    cost.observe_transfer("ssd", MiB, MiB / 1e8)
    assert 1e8 < cost.bandwidth["ssd"].value < 1e9


def test_decision_carries_its_inputs():
    cost = CostModel(prefill_tokens_per_s=10000)
    d = cost.plan(spans("host", "ssd")).as_dict()
    assert set(d) >= {"outcome", "load", "hit", "load_ms", "recompute_ms", "hit_recompute_ms", "probe", "tiers"}
    assert d["tiers"] == ["host", "ssd"]
