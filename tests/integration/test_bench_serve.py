"""``kvstore bench serve`` end to end, small: vLLM's OpenAI server without a connector and
with ours (``ours-hints``: chat and agent requests carry session hints in
``kv_transfer_params``, which vLLM's server hands to the connector), on the same capped
engine KV, sent the same three workloads (streamed): interleaved chat sessions, agent
sessions (tool outputs, pauses, a fork) and rag questions over a shared document set.

Proves: the bench runs both setups through ``harness.bench_serve.main`` (the command's own
entry), each workload's rows and per-setup summaries exist with sane values (every request
answered, forks included; later-turn TTFTs measured, output tokens/s), ours was consulted on
every request (its /metrics load decisions) and served chat's later turns from its store (hit
tokens by tier), and the correctness column is real: every output of ours equals the
connector-less server's in every workload, and a doctored reference output is caught as a
mismatch.  Speed is never asserted.

Cost: ~70-170 s on 2 shared cores: two server starts (30-70 s each) shared by the three
workloads in one module-wide run; agent and rag add ~10-20 s to chat's.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness import bench_serve
from harness.bench_serve.report import check

SMALL = [
    "--setups",
    "none,ours-hints",
    "--workload",
    "chat,agent,rag",
    "--sessions",
    "4",
    "--turns",
    "2",
    "--system",
    "256",
    "--context",
    "256",
    "--message",
    "64",
    "--answer",
    "8",
    "--concurrency",
    "2",
    "--blocks",
    "10",
    "--host-capacity",
    "16MiB",
    "--tool",
    "64",
    "--forks",
    "1",
    "--pause",
    "0.1",  # agent
    "--documents",
    "6",
    "--document",
    "128",
    "--per-prompt",
    "2",
]  # rag
# requests, later-turn requests, output tokens: chat 4x2; agent 4x2 + a fork's turn 2; rag 4 users x 2 rounds
OURS = "ours-hints"  # ours, each chat and agent request carrying its session hint (kv_transfer_params)
COUNTS = {"chat": (8, 4, 64), "agent": (9, 5, 72), "rag": (8, 4, 64)}


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_f32_model):
    out = tmp_path_factory.mktemp("bench-serve")
    rc = bench_serve.main(
        [*SMALL, "--model-dir", str(tiny_f32_model), "--workdir", str(out / "work"), "--json", str(out / "serve.json")]
    )
    return rc, json.loads((out / "serve.json").read_text())


@pytest.mark.parametrize("workload", list(COUNTS))
def test_both_setups_answer_every_request_and_match(bench, workload):
    rc, doc = bench
    setups = doc["workloads"][workload]["setups"]
    assert rc == 0, json.dumps(setups, indent=1)[:4000]
    for key in ("none", OURS):
        d = setups[key]
        assert d["ran"], d["error"]
        assert (d["requests"], d["later_requests"], d["output_tokens"]) == COUNTS[workload]
        assert 0 < d["ttft_p50_ms"] <= d["ttft_p99_ms"]
        assert d["output_tok_s"] > 0
    ours = setups[OURS]
    assert ours["outputs_match"] and ours["compared"] == COUNTS[workload][0] and not ours["mismatches"]
    # ours was asked on every request: none was refused for its session hint
    assert sum(ours["decisions"].values()) >= ours["requests"], ours
    assert not setups["none"].get("decisions")


def test_ours_is_served_from_its_store_on_later_turns(bench):
    _, doc = bench
    ours = doc["workloads"]["chat"]["setups"][OURS]
    assert sum(ours.get("hit_tokens_by_tier", {}).values()) > 0, ours
    assert not doc["workloads"]["chat"]["setups"]["none"].get("hit_tokens_by_tier")


def test_each_workload_records_its_shape(bench):
    _, doc = bench
    agent, rag = doc["workloads"]["agent"]["settings"], doc["workloads"]["rag"]["settings"]
    assert agent["forks"] == 1 and agent["fork_at"] == {"4": 1}
    rounds = rag["documents_per_question"]
    assert len(rounds) == 2 and all(len(r) == 4 and all(len(set(q)) == 2 for q in r) for r in rounds)


@pytest.mark.parametrize("workload", list(COUNTS))
def test_rows_stand_beside_no_connector(bench, workload):
    _, doc = bench
    names = {r["name"]: r for r in doc["rows"]}
    for fig in ("later-turn TTFT p50", "later-turn TTFT p99", "output tokens/s"):
        row = names[f"{workload} {OURS} {fig}"]
        assert row["limit_name"] == f"{workload} none {fig}" and row["value"] > 0 and row["limit_value"] > 0


def test_a_changed_output_is_caught():
    """The correctness column can fail: one reference token changed is a mismatch."""
    from harness.bench_serve.setups import SetupRun
    from harness.bench_serve.workload import Turn, WorkloadRun
    from harness.openai_server import Completion

    def run(tokens: tuple[int, ...]) -> SetupRun:
        c = Completion(tokens, (-1.0,) * len(tokens), (), 10, 0, 0.0, 1.0, {}, 0.5)
        return SetupRun("ours", WorkloadRun([Turn(0, 1, c)], 1.0))

    assert check(run((5, 6)), run((5, 6)), 1e-4).ok
    bad = check(run((5, 6)), run((5, 7)), 1e-4)
    assert not bad.ok and "session 0 turn 1" in bad.mismatches[0]
    lp = dataclasses.replace(run((5, 6)).run.turns[0].completion, logprobs=(-1.0, -1.5))
    assert not check(SetupRun("ours", WorkloadRun([Turn(0, 1, lp)], 1.0)), run((5, 6)), 1e-4).ok
