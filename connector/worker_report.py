"""What the worker half's copies touch and what they report.

``Mapped``: the engine's KV tensors (and recurrent state tensors) registered with the worker,
and its mapping of the shared host pool; loads and saves read them when they run.
``Ledger``: the ``WorkerReport`` being filled for the scheduler and the counters for vLLM's
connector-stats log, under one lock (completion callbacks run on whichever thread observed
a copy's event)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from connector.plan import WorkerReport
from connector.transfer import PagedKV
from tiers.host import SharedPoolView


@dataclass
class Mapped:
    kv: PagedKV | None = None
    states: PagedKV | None = None  # recurrent hybrids: the state layers, a page per block
    pool: SharedPoolView | None = None  # tiers.host.attach_shared's mapping of the host pool
    pool_t: torch.Tensor | None = None

    def paged(self, state: bool = False) -> PagedKV:
        """The registered KV cache (``state``: the recurrent state layers); ``LookupError`` when
        there is none (not registered yet, or asleep): a copy planned then is a bug."""
        kv = self.states if state else self.kv
        if kv is None:
            raise LookupError(f"KVStoreConnector worker: no {'state' if state else 'KV cache'} layers are registered")
        return kv

    def pool_buffer(self) -> memoryview:
        """The attached host pool's bytes; ``LookupError`` before a plan named it (or once it
        is closed): a copy then is a bug."""
        if self.pool is None or self.pool.buffer is None:
            raise LookupError("KVStoreConnector worker: the host pool is not attached")
        return self.pool.buffer


def zero_interval() -> dict[str, int]:
    return dict.fromkeys(
        (
            "loads",
            "load_failures",
            "bytes_loaded",
            "saves",
            "save_failures",
            "bytes_saved",
            "sleep_drained",
            "cancelled_asleep",
        ),
        0,
    )


class Ledger:
    def __init__(self, mapped: Mapped, tracing: bool = False) -> None:
        self.mapped = mapped
        self.lock = threading.Lock()  # guards report and interval (and the save bookkeeping of WorkerHalf)
        self.report = WorkerReport()
        self.interval = zero_interval()
        self.tracing = tracing  # time each copy job for the trace (WorkerReport.copies)

    def timed(self, what: str, job):
        """``job``, timed on the copy engine when tracing (its run: the copy itself on the
        host device, the enqueueing on a stream device)."""
        if not self.tracing:
            return job

        def timed() -> None:
            t0 = time.monotonic()
            try:
                job()
            finally:
                t1 = time.monotonic()
                with self.lock:
                    self.report.copies.append((f"rank {self.mapped.paged().shard.rank}: {what}", t0, t1))

        return timed

    def count(self, reason: str) -> None:
        with self.lock:
            f = self.report.failures
            f[reason] = f.get(reason, 0) + 1

    def take_interval(self) -> dict[str, int]:
        with self.lock:
            data, self.interval = self.interval, zero_interval()
        return {k: v for k, v in data.items() if v}

    def take_report(self) -> WorkerReport:
        with self.lock:
            report, self.report = self.report, WorkerReport()
        return report


__all__ = ["Ledger", "Mapped", "zero_interval"]
