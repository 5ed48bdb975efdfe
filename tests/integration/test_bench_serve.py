"""``kvstore bench serve`` end to end, small: vLLM's OpenAI server without a connector and
with ours, on the same capped engine KV, sent the same interleaved chat sessions (streamed).

Proves: the bench runs both setups through ``harness.bench_serve.main`` (the command's own
entry), its rows and per-setup summaries exist with sane values (every request answered,
later-turn TTFTs measured, output tokens/s), ours was served from its store on later turns
(its /metrics hit tokens by tier and load decisions), and its correctness column is real:
every output of ours equals the connector-less server's, and a doctored reference output is
caught as a mismatch.  Speed is never asserted.

Cost: ~60-150 s on 2 shared cores (two server starts, 30-70 s each; one module-wide run).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from harness import bench_serve
from harness.bench_serve.report import check

SMALL = ["--setups", "none,ours", "--sessions", "4", "--turns", "2", "--system", "256", "--context", "256",
         "--message", "64", "--answer", "8", "--concurrency", "2", "--blocks", "10", "--host-capacity", "16MiB"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_f32_model):
    out = tmp_path_factory.mktemp("bench-serve")
    rc = bench_serve.main([*SMALL, "--model-dir", str(tiny_f32_model), "--workdir", str(out / "work"),
                           "--json", str(out / "serve.json")])
    return rc, json.loads((out / "serve.json").read_text())


def test_both_setups_answer_every_request_and_match(bench):
    rc, doc = bench
    assert rc == 0, json.dumps(doc["setups"], indent=1)[:4000]
    for key in ("none", "ours"):
        d = doc["setups"][key]
        assert d["ran"], d["error"]
        assert (d["requests"], d["later_requests"], d["output_tokens"]) == (8, 4, 64)
        assert 0 < d["ttft_p50_ms"] <= d["ttft_p99_ms"]
        assert d["output_tok_s"] > 0
    ours = doc["setups"]["ours"]
    assert ours["outputs_match"] and ours["compared"] == 8 and not ours["mismatches"]


def test_ours_is_served_from_its_store_on_later_turns(bench):
    _, doc = bench
    ours = doc["setups"]["ours"]
    assert sum(ours.get("hit_tokens_by_tier", {}).values()) > 0, ours
    assert ours.get("decisions"), ours
    assert not doc["setups"]["none"].get("hit_tokens_by_tier")


def test_rows_stand_beside_no_connector(bench):
    _, doc = bench
    names = {r["name"]: r for r in doc["rows"]}
    for fig in ("later-turn TTFT p50", "later-turn TTFT p99", "output tokens/s"):
        row = names[f"ours {fig}"]
        assert row["limit_name"] == f"none {fig}" and row["value"] > 0 and row["limit_value"] > 0


def test_a_changed_output_is_caught():
    """The correctness column can fail: one reference token changed is a mismatch."""
    from harness.bench_serve.setups import SetupRun
    from harness.bench_serve.workload import ChatRun, Turn
    from harness.openai_server import Completion

    def run(tokens: tuple[int, ...]) -> SetupRun:
        c = Completion(tokens, (-1.0,) * len(tokens), (), 10, 0, 0.0, 1.0, {}, 0.5)
        return SetupRun("ours", ChatRun([Turn(0, 1, c)], 1.0))

    assert check(run((5, 6)), run((5, 6)), 1e-4).ok
    bad = check(run((5, 6)), run((5, 7)), 1e-4)
    assert not bad.ok and "session 0 turn 1" in bad.mismatches[0]
    lp = dataclasses.replace(run((5, 6)).run.turns[0].completion, logprobs=(-1.0, -1.5))
    assert not check(SetupRun("ours", ChatRun([Turn(0, 1, lp)], 1.0)), run((5, 6)), 1e-4).ok
