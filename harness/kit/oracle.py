"""The correctness oracle and the TTFT summary of the engine kit: ``compare_outputs``
(identical greedy tokens, chosen-token logprobs within a tolerance) and ``summarize``
(TTFT percentiles of hits and misses)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass

from harness.kit.runner import EngineResult, RequestResult

# Chosen-token logprob tolerance per model dtype, from measurements on the standard workload
# with one OMP thread. Two processes without a connector: 0.0 in every dtype and in both
# process modes. A prefix hit (vLLM's own prefix cache, or ExampleConnector) against a full
# recompute: bf16 "tiny" 0.0297 (the suffix-only prefill rounds differently after a 2048-token
# context), bf16 "tiny2" 0.0, float32 "tiny-f32" 3.6e-6; no token ever flipped. A tolerance
# ~3x above that: 0.1 for bf16 (one wrong token in a 2048-token prefix moves logprobs by
# 0.03-0.28, so only float32 gives a sharp oracle), 1e-4 for float32.
LOGPROB_TOL = {"bfloat16": 0.1, "float16": 0.1, "float32": 1e-4}
DEFAULT_LOGPROB_TOL = LOGPROB_TOL["bfloat16"]


@dataclass(frozen=True, slots=True)
class Comparison:
    equal: bool
    max_logprob_diff: float
    mismatches: tuple[str, ...]
    tolerance: float

    def __bool__(self) -> bool:
        return self.equal


def compare_outputs(a: EngineResult, b: EngineResult, logprob_tol: float | None = None) -> Comparison:
    """Equal iff every request has the same prompt length, the same greedy tokens, and
    chosen-token logprobs within `logprob_tol` (compared up to the first token mismatch).
    The tolerance defaults to `LOGPROB_TOL` for the engine's dtype."""
    if logprob_tol is None:
        logprob_tol = LOGPROB_TOL.get(a.dtype, DEFAULT_LOGPROB_TOL)
    rb, problems, worst = b.by_label(), [], 0.0
    if a.dtype != b.dtype:
        problems.append(f"dtype {a.dtype} != {b.dtype}")
    missing = set(rb) ^ {r.label for r in a.requests}
    problems += [f"{lab}: present in only one run" for lab in sorted(missing)]
    for ra in a.requests:
        if ra.label in rb:
            diff, msgs = _compare_request(ra, rb[ra.label], logprob_tol)
            worst, problems = max(worst, diff), problems + msgs
    return Comparison(not problems, worst, tuple(problems), logprob_tol)


def _compare_request(a: RequestResult, b: RequestResult, tol: float) -> tuple[float, list]:
    if a.prompt_len != b.prompt_len:
        return 0.0, [f"{a.label}: prompt length {a.prompt_len} != {b.prompt_len}"]
    msgs, worst = [], 0.0
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            msgs.append(f"{a.label}: token {i} differs ({ta} != {tb})")
            break
        diff = abs(a.logprobs[i] - b.logprobs[i])
        worst = max(worst, diff)
        if diff > tol:
            msgs.append(f"{a.label}: logprob {i} differs by {diff:.3g} > {tol:g}")
    if len(a.token_ids) != len(b.token_ids):
        msgs.append(f"{a.label}: {len(a.token_ids)} != {len(b.token_ids)} output tokens")
    return worst, msgs


# ---------------------------------------------------------------------------- summary


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class TTFTSummary:
    hits: Percentiles
    misses: Percentiles

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for an empty list."""
    if not values:
        return None
    xs, pos = sorted(values), (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> Percentiles:
    return Percentiles(len(values), *(percentile(values, q) for q in (50, 95, 99)))


def summarize(results: Iterable[RequestResult], hit_labels: Collection[str]) -> TTFTSummary:
    """TTFT percentiles split by whether the caller expects each label to be a hit."""
    hits, misses = [], []
    for r in results:
        (hits if r.label in hit_labels else misses).append(r.ttft_s)
    return TTFTSummary(percentiles(hits), percentiles(misses))
