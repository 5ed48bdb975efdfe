"""The workloads of ``kvstore bench serve`` as made, before any server sees them.

Proves: ``agent`` forks start from a real parent turn and are numbered as later turns, its
tool outputs and pauses stay in their seeded ranges, the longest sequence it reports is the
one its branches reach, and the same seed gives the same workload; ``rag`` prompts are the
system prompt, distinct documents of the shared set in varied order and a question, with the
popular documents drawn more often; the serving time is the union of in-flight intervals
(pauses and restarts excluded); the command's flags reach each workload and bad ones are a
``ConfigError`` naming the flag; ``--repeats`` merges each figure to its median and checks
every repeat's outputs.  Cost: under 1 s (no server).
"""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from harness import bench_serve
from harness.bench_serve import report
from harness.bench_serve.agent import Agent, AgentSpec
from harness.bench_serve.rag import Rag, RagSpec
from harness.bench_serve.workload import busy_s
from harness.openai_server import Completion
from kvstore.errors import ConfigError

VOCAB = 32000


def test_agent_forks_start_after_a_parent_turn_and_count_as_later_turns():
    spec = AgentSpec(sessions=3, turns=6, tool=40, forks=5, pause=0.2)
    a = Agent(spec, VOCAB)
    forks = [q for q in a.seqs if q.parent is not None]
    assert len(a.seqs) == 8 and len(forks) == 5
    for f in forks:
        at = a.fork_at[f.id]
        assert f.parent == (f.id - 3) % 3 and 1 <= at < spec.turns and f.first == at + 1 >= 2
        assert len(f.messages) == spec.turns - at
    for q in a.seqs:
        tools = q.messages[1:] if q.parent is None else q.messages
        assert all(20 <= len(m) <= 60 for m in tools) and (q.parent is not None or q.messages[0] == ())
        assert all(0 <= p <= 0.8 for p in q.pauses)
    assert len({len(m) for q in a.seqs for m in q.messages}) > 3, "tool outputs of varied length"
    assert len(set(p for q in a.seqs for p in q.pauses)) > 10, "pauses of varied length"


def test_agent_longest_is_what_its_branches_reach_and_the_seed_fixes_it():
    spec = AgentSpec(sessions=2, turns=4, system=64, context=32, tool=50, answer=8, forks=2)
    a, b = Agent(spec, VOCAB), Agent(spec, VOCAB)
    assert a.seqs == b.seqs and a.openings == b.openings
    assert Agent(AgentSpec(sessions=2, turns=4, forks=2, seed=1), VOCAB).seqs != a.seqs
    session = a.seqs[0]
    assert a._length(session) == 96 + sum(len(m) for m in session.messages) + 4 * 8
    fork = a.seqs[2]
    at, parent = a.fork_at[fork.id], a.seqs[fork.parent]
    want = 96 + sum(len(m) for m in parent.messages[:at]) + at * 8 + sum(len(m) for m in fork.messages) + (4 - at) * 8
    assert a._length(fork) == want and a.longest() == max(a._length(q) for q in a.seqs)
    assert a.limit_blocks(64) == 4 * (-(-a.longest() // 64) + 1)


def test_rag_prompts_are_documents_of_the_set_in_varied_order():
    spec = RagSpec(sessions=6, turns=4, system=16, documents=5, document=10, per_prompt=3, message=4)
    r = Rag(spec, VOCAB)
    positions: dict[int, set[int]] = {}
    for t in range(1, 5):
        for i in range(6):
            docs, question = r.choice[t - 1][i]
            assert len(set(docs)) == 3 and r.prompt(t, i) == r.system + sum((r.docs[d] for d in docs), ()) + question
            assert len(r.prompt(t, i)) == r.longest() - spec.answer
            for pos, d in enumerate(docs):
                positions.setdefault(d, set()).add(pos)
    assert all(len(p) >= 2 for p in positions.values()), positions  # each document in more than one place
    orders = {docs for round_ in r.choice for docs, _ in round_}
    assert any(tuple(sorted(o)) != o for o in orders) and len(orders) > 6


def test_rag_draws_popular_documents_more_often():
    r = Rag(RagSpec(sessions=50, turns=4, documents=10, document=2, per_prompt=2, system=1, message=1), VOCAB)
    drawn = Counter(d for round_ in r.choice for docs, _ in round_ for d in docs)
    assert drawn[0] > drawn[9] and drawn[0] > 2 * drawn[8]


def test_serving_time_is_the_union_of_in_flight_intervals():
    def c(sent: float, received: float) -> Completion:
        return Completion((), (), (), 0, None, sent, received, {})

    # [0,2] and [1,3] overlap (3 s), a pause, then [10,11] and [11.5,12]
    assert busy_s([c(10, 11), c(0, 2), c(1, 3), c(11.5, 12)]) == pytest.approx(4.5)
    assert busy_s([]) == 0


def _workloads(*argv: str):
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return bench_serve.make_workloads(p.parse_args(list(argv)), VOCAB)


def test_flags_reach_each_workload():
    chat, agent, rag, restart = _workloads(
        "--workload", "chat,agent,rag,restart", "--sessions", "3", "--turns", "4", "--forks", "2", "--document", "64"
    )
    assert (chat.name, agent.name, rag.name, restart.name) == ("chat", "agent", "rag", "restart")
    assert chat.spec.sessions == agent.spec.sessions == rag.spec.sessions == 3
    assert agent.spec.forks == 2 and rag.spec.document == 64 and agent.spec.system == 512  # its own default
    assert chat.restart_after is None and restart.restart_after == 2
    assert [w.name for w in _workloads("--restart-after", "3")] == ["restart"]
    assert [w.name for w in _workloads()] == ["chat"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (("--workload", "chat,search"), "--workload"),
        (("--workload", "chat,chat"), "--workload"),
        (("--workload", "chat", "--restart-after", "2"), "--restart-after"),
        (("--workload", "restart", "--turns", "3", "--restart-after", "3"), "--restart-after 3"),
        (("--workload", "restart", "--turns", "1"), "--turns 1"),
        (("--workload", "rag", "--per-prompt", "13"), "--per-prompt 13"),
        (("--workload", "agent", "--forks", "-1"), "--forks -1"),
        (("--workload", "agent", "--turns", "1"), "--forks 4 needs --turns >= 2"),
    ],
)
def test_bad_settings_are_named(argv, names):
    with pytest.raises(ConfigError, match=names):
        _workloads(*argv)


def test_setups_must_name_the_reference_and_known_setups():
    with pytest.raises(ConfigError, match="--setups"):
        bench_serve._setups("ours,limit")
    with pytest.raises(ConfigError, match="--setups"):
        bench_serve._setups("none,vanilla")
    assert bench_serve._setups("limit,lmcache,none") == ["none", "lmcache", "limit"]


def _summary(p50: float, tok_s: float, match: bool = True, host: int = 0) -> dict:
    return {
        "title": "ours",
        "ran": True,
        "error": None,
        "requests": 8,
        "later_requests": 6,
        "ttft_p50_ms": p50,
        "ttft_p99_ms": 2 * p50,
        "output_tok_s": tok_s,
        "host_hit_tokens": host,
        "restarts": 0,
        "outputs_match": match,
        "compared": 8,
        "max_logprob_diff": p50 / 1e6,
        "mismatches": [] if match else [f"session 0 turn 2: {p50}"],
    }


def test_repeats_merge_to_the_median_of_each_figure_and_check_every_output():
    """``--repeats``: each figure is the median over the repeats, each repeat's value is kept,
    and one repeat with a wrong output fails the merged setup."""
    merged = report.merge([_summary(90.0, 200.0, host=10), _summary(60.0, 300.0, host=30), _summary(70.0, 250.0)])
    assert (merged["ttft_p50_ms"], merged["ttft_p99_ms"], merged["output_tok_s"]) == (70.0, 140.0, 250.0)
    assert merged["host_hit_tokens"] == 10 and merged["repeats"]["ttft_p50_ms"] == [90.0, 60.0, 70.0]
    assert merged["outputs_match"] and merged["compared"] == 24 and merged["max_logprob_diff"] == 90.0 / 1e6
    bad = report.merge([_summary(90.0, 200.0), _summary(60.0, 300.0, match=False)])
    assert not bad["outputs_match"] and bad["mismatches"] == ["session 0 turn 2: 60.0"]
    assert not bench_serve._ok({"none": _summary(1.0, 1.0), "ours": bad})
    single = _summary(50.0, 100.0)
    assert report.merge([single]) is single  # one run: as measured, no "repeats"
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    assert p.parse_args(["--repeats", "3"]).repeats == 3 and p.parse_args([]).repeats == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--repeats", "0"])
