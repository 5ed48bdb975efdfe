"""Hybrid models (``SupportsHMA``): several KV cache groups, each with its own block table,
driven in vLLM's hook order without vLLM.  Layer 0 is a sliding-window layer (group 0),
layer 1 a full-attention layer (group 1); vLLM's null block (id 0) stands for a sliding
group's blocks outside its window.

* A save gathers every layer's pages from its own group's blocks.
* A load copies only the blocks the engine holds: a sliding layer's blocks inside its
  window at the hit boundary; the null block is never written.
* A chunk whose sliding blocks were already let go (a long decode) is not saved: an object
  never has holes.
"""

from __future__ import annotations

import torch

from connector.scheduler import RequestView
from connector.transfer import PagedKV
from tests.kits.halves import Engine, fill, prompt

NULL = 0


def hybrid(tmp_path, dev) -> Engine:
    e = Engine(tmp_path, dev())
    e.worker.register(PagedKV(e.kv, list(e.kv), e.shape.blocks, layer_groups=[0, 1]))
    return e


def compute(e: Engine, req_id: str, tokens, groups, seed: int) -> int:
    view = RequestView(req_id, tokens)
    n = e.sched.matched_tokens(view, 0)
    e.sched.after_alloc(req_id, groups, n)
    bs = e.shape.block_size
    todo = [b for g in groups for b in g[n // bs :] if b != NULL]
    e.step(
        new=[(req_id, groups, n)],
        scheduled={req_id: len(tokens) - n},
        compute=lambda: fill(e, todo, seed) if todo else None,
    )
    return n


def test_each_layer_saves_and_loads_through_its_own_groups_blocks(tmp_path, dev):
    e = hybrid(tmp_path, dev)
    tokens = prompt(600, seed=1)
    a = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # sliding group, full group
    assert compute(e, "a", tokens, a, seed=1) == 0
    e.settle()
    assert e.sched.stats.saves_committed == 2
    before = e.buf[:, NULL].clone()
    b = [[NULL, NULL, 11, 12, 13], [14, 15, 16, 17, 18]]  # the sliding window holds the last 2 of 4
    assert compute(e, "b", tokens, b, seed=9) == 512
    assert not e.errors
    assert torch.equal(e.buf[0, 11:13], e.buf[0, 3:5])  # layer 0 (sliding): its window only
    assert torch.equal(e.buf[1, 14:18], e.buf[1, 6:10])  # layer 1 (full): every block
    assert torch.equal(e.buf[:, NULL], before)  # the null block is never written
    e.close()


def test_a_chunk_whose_sliding_blocks_are_gone_is_not_saved(tmp_path, dev):
    e = hybrid(tmp_path, dev)
    tokens = prompt(600, seed=2)
    e.sched.matched_tokens(RequestView("a", tokens), 0)
    groups = [[NULL, NULL, 3, 4, 5], [6, 7, 8, 9, 10]]  # chunk 0's sliding blocks already freed
    e.sched.after_alloc("a", groups, 0)
    plan = e.step(new=[("a", groups, 0)], scheduled={"a": 600})
    assert not plan.saves  # no object with holes, no orphans after it
    assert e.sched.stats.failures.get("host:save:window") == 1
    e.close()
