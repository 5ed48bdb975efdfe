"""Worker half of the connector: moves bytes between the shared host pool and the engine's
KV blocks, by the jobs of the scheduler's ``StepPlan``, and reports outcomes.

Per load chunk the lifecycle ticket runs LOOKED_UP → READABLE (the scheduler holds a
reference on the slot) → IN_BUFFER (header, key and checksum verified in the slot) →
ON_DEVICE (every layer's scatter event completed) → CONSUMABLE (the compute waited on
it) → RELEASED (reported; the scheduler drops its reference).  A chunk that fails makes it
and every later chunk of its job "failed blocks": vLLM recomputes them.

Saves gather finished chunks into their reserved slots after the forward; the header
(and its checksum of the payload) is sealed only once the gather's event has completed,
never over bytes a ``non_blocking`` copy may still be writing.  Blocks of a finished
request stay allocated (``delay_free``) until its gathers completed, and preemption drains
in-flight gathers before blocks are reused.  Every step drains its own load copies before
it returns, so a failed or timed-out load never writes into blocks the engine is already
recomputing.

Completion is never assumed from ``submit`` returning: on CUDA (and ``emulated-cuda``)
events complete only when observed, so the worker polls its save events in every hook
vLLM calls each step (``bind``, ``get_finished``, the report and stats), drains every load
event in ``finish_loads``, and checks each layer's event for errors, not only the last.
A completion callback that raises (a lifecycle error, a failed seal) fails its chunk and is
counted; it never kills the thread that observed it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import torch

from connector import local
from connector.device import CopyEvent, Device
from connector.plan import ChunkCopy, SaveJob, StepPlan, WorkerReport
from connector.transfer import PagedKV, dtype_name
from connector.worker_loads import DRAIN_LIMIT_S, LoadCopier
from connector.worker_report import Ledger, Mapped
from kvstore import codec, integrity
from kvstore.errors import ConfigError
from kvstore.integrity import Keyring
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from tiers.host import attach_shared

log = logging.getLogger("kvstore.connector")


class WorkerHalf:
    def __init__(
        self,
        device: Device,
        verify_loads: bool = True,
        load_timeout_s: float = 30.0,
        tracing: bool = False,
        keys: Callable[[ObjectKey], Keyring | None] | None = None,
    ) -> None:
        """``tracing``: time each copy job for the trace (``WorkerReport.copies``).  ``keys``:
        the MAC keys of the engine's lower tiers (``connector.lower.keys_of``): an object this
        worker writes whole is sealed here, on the thread that saw its gather land, so the
        scheduler's commit does not spend its own time on the MAC."""
        self.keys = keys
        self.mapped = Mapped()  # the KV tensors registered, the host pool's mapping
        self.ledger = Ledger(self.mapped, tracing)  # the report and the interval counters, under its lock
        self.loads = LoadCopier(device, self.mapped, self.ledger, verify_loads, load_timeout_s)
        self._plan: StepPlan | None = None
        self._saving: dict[str, int] = {}  # req id -> gathers in flight
        self._had_saves: set[str] = set()  # req ids that ever had a save job
        self._finished: set[str] = set()  # finished req ids awaiting their gathers
        self._lock = self.ledger.lock  # also guards _saving, _save_oks, _save_left, _save_issued, _had_saves, _finished
        self._save_oks: dict[int, list[bool]] = {}
        self._save_left: dict[int, int] = {}
        self._save_events: list[CopyEvent] = []  # gathers not yet seen complete (worker thread only)
        self._save_issued: dict[int, tuple[float, list[float]]] = {}  # job -> (issued, done at); _lock
        self._asleep: tuple[PagedKV, PagedKV | None] | None = None  # the KV put away by a sleep
        local.register(self)

    @property
    def device(self) -> Device:  # the copy engine, the loads' and the saves'
        return self.loads.device

    @device.setter
    def device(self, device: Device) -> None:
        self.loads.device = device

    @property
    def kv(self) -> PagedKV | None:
        return self.mapped.kv

    @property
    def states(self) -> PagedKV | None:  # recurrent hybrids: the state layers, a page per block
        return self.mapped.states

    @property
    def pool_path(self) -> str | None:
        return None if self.mapped.pool is None else self.mapped.pool.path

    # --- setup -----------------------------------------------------------------------------

    def register(self, kv: PagedKV, states: PagedKV | None = None) -> None:
        self.mapped.kv, self.mapped.states = kv, states
        # fault injection may target one rank; devices have no declared rank (faulty specs read it with getattr)
        self.device.rank = kv.shard.rank  # type: ignore[attr-defined]
        if self._asleep is not None:  # new tensors while asleep: they are the ones to wake on
            self._asleep = (kv, states)
            self.mapped.kv = self.mapped.states = None

    # --- sleep and wake (vLLM 0.33's unregister_kv_caches / restore_kv_caches) ------------

    @property
    def asleep(self) -> bool:
        return self._asleep is not None

    def unregister(self) -> int:
        """Before a sleep frees or remaps the KV tensors: every copy in flight finishes (the
        tensors are still valid now), then nothing may touch them until ``restore``: a plan
        arriving meanwhile has its loads failed (vLLM recomputes) and its saves dropped,
        counted as ``cancelled_asleep``.  Returns the gathers that were drained.  Idempotent."""
        if self._asleep is not None:
            return 0
        self.poll()
        in_flight = len(self._save_events)
        if not self.device.synchronize(DRAIN_LIMIT_S):
            raise RuntimeError("a KV copy is wedged; refusing to let the engine sleep under it")
        self.poll()
        with self._lock:
            self.ledger.interval["sleep_drained"] += in_flight
        if self.mapped.kv is not None:
            self._asleep, self.mapped.kv, self.mapped.states = (self.mapped.kv, self.mapped.states), None, None
        return in_flight

    def restore(self) -> None:
        """After wake: copies go to the registered tensors again (the same objects, remapped
        by vLLM's sleep allocator; new ones if ``register`` was called meanwhile).  Idempotent."""
        if self._asleep is not None:
            (self.mapped.kv, self.mapped.states), self._asleep = self._asleep, None

    def _refuse_asleep(self, plan: StepPlan) -> None:
        """A plan's copies while the KV tensors are put away: loads fail, saves are dropped."""
        with self._lock:
            self.loads.refuse(plan.loads)
            for job in plan.loads:
                self.ledger.report.loads[job.job_id] = False
                self.ledger.report.load_reports[job.job_id] = 1
            for save in plan.saves:
                self._had_saves.add(save.req_id)
                self.ledger.report.saves[save.job_id] = [False] * len(save.chunks)
                self.ledger.report.save_reports[save.job_id] = 1
            n = len(plan.loads) + len(plan.saves)
            self.ledger.interval["cancelled_asleep"] += n
            f = self.ledger.report.failures
            f["cancelled_asleep"] = f.get("cancelled_asleep", 0) + n

    def bind(self, plan: StepPlan) -> None:
        if self.mapped.kv is not None and plan.page_bytes != self.mapped.kv.layout.page_bytes:
            raise ConfigError(
                f"scheduler plans {plan.page_bytes}-byte pages, this worker's KV pages "
                f"are {self.mapped.kv.layout.page_bytes} bytes ({self.mapped.kv.layout})"
            )
        if self.mapped.states is not None and plan.state_page_bytes != self.mapped.states.layout.page_bytes:
            raise ConfigError(
                f"scheduler plans {plan.state_page_bytes}-byte state pages, this worker's "
                f"are {self.mapped.states.layout.page_bytes} bytes ({self.mapped.states.layout})"
            )
        self._plan = plan
        if plan.released or plan.undelayed:
            with self._lock:
                self._had_saves.update(plan.released)  # final saves a reset cancelled: blocks may go
                self._had_saves.difference_update(plan.undelayed)  # vLLM freed these already
                self._finished.difference_update(plan.undelayed)
                for r in plan.undelayed:
                    self._saving.pop(r, None)
        self.poll()
        if self.mapped.pool is None or self.mapped.pool.path != plan.pool_path:
            self._attach(plan.pool_path, plan.pool_size)

    def _attach(self, path: str, size: int) -> None:
        if self.mapped.pool is not None:
            self.device.synchronize()
            self.mapped.pool.close()
        self.mapped.pool = attach_shared(path, size)
        self.mapped.pool_t = torch.from_numpy(self.mapped.pool.array)

    # --- loads -----------------------------------------------------------------------------

    def start_loads(self) -> None:
        plan = self._plan
        if plan is None or not plan.loads:
            return
        if self._asleep is not None:
            self._refuse_asleep(dataclasses.replace(plan, saves=[]))
            return
        if self.mapped.kv is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        self.loads.start(plan)

    def wait_layer(self, layer_name: str) -> None:
        self.loads.wait_layer(layer_name)

    def finish_loads(self) -> None:
        """Drain this step's load copies, then record outcomes and failed blocks."""
        self.loads.finish()

    def load_errors(self) -> set[int]:
        return self.loads.take_errors()

    # --- saves -----------------------------------------------------------------------------

    def submit_saves(self) -> None:
        plan = self._plan
        if plan is None or not plan.saves:
            return
        if self._asleep is not None:
            self._refuse_asleep(dataclasses.replace(plan, loads=[]))
            return
        for job in plan.saves:
            with self._lock:
                self._had_saves.add(job.req_id)
                self._saving[job.req_id] = self._saving.get(job.req_id, 0) + len(job.chunks)
                self._save_oks[job.job_id] = [False] * len(job.chunks)
                self._save_left[job.job_id] = len(job.chunks)
                self._save_issued[job.job_id] = (time.monotonic(), [0.0] * len(job.chunks))
            states = []
            for i, chunk in enumerate(job.chunks):
                pages = chunk.pages or plan.pages_per_chunk
                layout = self.mapped.paged(chunk.state).layout
                geometry = layout.geometry(pages, plan.chunk_tokens * pages // plan.pages_per_chunk)
                gather = lambda c=chunk, p=pages: self._gather(c, p)  # noqa: E731
                ev = self.device.submit(self.ledger.timed(f"save {job.job_id} chunk {i}", gather))
                ev.on_complete(functools.partial(self._saved, job, i, geometry=geometry))
                self._save_events.append(ev)
                if chunk.state:
                    states.append(ev)
            for ev in states:  # a state block is freed two steps on: never let a gather outlive it
                if not ev.wait(DRAIN_LIMIT_S):
                    raise RuntimeError("a state snapshot copy is wedged; refusing to go on past its block")

    def _gather(self, chunk: ChunkCopy, pages: int) -> None:
        """Only enqueues the copy on a stream device: the header is sealed in ``_saved``."""
        kv = self.mapped.paged(chunk.state)
        payload = kv.payload_view(self.mapped.pool_t, chunk.slot, pages)
        kv.gather(chunk.groups(), payload)

    def _seal(self, chunk: ChunkCopy, geometry: codec.ObjectGeometry) -> None:
        parent = ChunkHash(chunk.parent) if chunk.parent else ROOT
        view = self.mapped.pool_buffer()[chunk.slot : chunk.slot + codec.object_size(geometry)]
        key = ObjectKey.from_bytes(chunk.key)
        codec.encode_into(view, key, geometry, None, parent, chunk.generated)
        ring = None if self.keys is None else self.keys(key)
        if ring is not None:
            integrity.seal(view, ring)

    def _writes_whole(self, chunk: ChunkCopy) -> bool:
        """Whether this worker alone writes ``chunk``'s object (so it seals it here)."""
        shard = self.mapped.paged(chunk.state).shard
        return shard.whole and shard.writes

    def _saved(self, job: SaveJob, i: int, event: CopyEvent, geometry: codec.ObjectGeometry) -> None:
        """Completion of the gather of chunk i (SNAPSHOT_DONE), on whichever thread observed
        it: seal the header over the landed bytes, then report."""
        ok = event.error is None
        if not ok:
            log.warning("kvstore: save of %s chunk %d failed: %s", job.req_id, i, event.error)
            self.ledger.count("save_copy_error")
        elif self._writes_whole(job.chunks[i]):  # else: the scheduler seals, all parts in
            try:
                self._seal(job.chunks[i], geometry)
            except Exception as err:  # noqa: BLE001 - fail the chunk, keep the thread
                ok = False
                log.warning("kvstore: sealing %s chunk %d failed: %r", job.req_id, i, err)
                self.ledger.count("save_seal_error")
        with self._lock:
            self._save_oks[job.job_id][i] = ok
            self._save_issued[job.job_id][1][i] = time.monotonic()  # SNAPSHOT_DONE (as observed)
            self._save_left[job.job_id] -= 1
            self._saving[job.req_id] -= 1
            chunk = job.chunks[i]
            kv = self.mapped.paged(chunk.state)
            nbytes = (
                kv.local.page_bytes * kv.local.num_layers * max(len(chunk.block_ids), chunk.state)
                if kv.shard.writes
                else 0
            )
            self.ledger.interval["saves"] += 1
            self.ledger.interval["save_failures"] += not ok
            if ok:
                self.ledger.report.bytes_saved += nbytes
                self.ledger.interval["bytes_saved"] += nbytes
            if self._save_left[job.job_id] == 0:
                del self._save_left[job.job_id]
                self.ledger.report.saves[job.job_id] = self._save_oks.pop(job.job_id)
                self.ledger.report.save_reports[job.job_id] = 1
                self.ledger.report.save_times[job.job_id] = self._save_issued.pop(job.job_id)

    def poll(self) -> None:
        """Observe the save gathers that completed (a stream device calls nothing back)."""
        if self._save_events:
            self._save_events = [ev for ev in self._save_events if not ev.query()]

    def save_now(self, plan: StepPlan) -> None:
        """At exit, in this process: gather and seal ``plan``'s saves and wait for them (the
        engine is idle; no step will carry them).  See ``connector.local``."""
        self.bind(plan)
        self.submit_saves()
        self.drain_saves()

    def drain_saves(self) -> None:
        """Preemption: blocks may be reused next; every gather must have finished."""
        if not self.device.synchronize(DRAIN_LIMIT_S):
            raise RuntimeError("a KV save copy is wedged; refusing to reuse its blocks")
        self.poll()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are done: their blocks may now be freed."""
        self.poll()
        with self._lock:
            self._finished |= finished_req_ids & self._had_saves
            done = {r for r in self._finished if self._saving.get(r, 0) == 0}
            self._finished -= done
            self._had_saves -= done
            for r in done:
                self._saving.pop(r, None)
        return done

    # --- reporting -------------------------------------------------------------------------

    def take_interval(self) -> dict[str, int]:
        """Counters since the last call, for vLLM's periodic connector-stats log."""
        self.poll()
        return self.ledger.take_interval()

    def take_report(self) -> WorkerReport | None:
        self.poll()
        report = self.ledger.take_report()
        if report.empty():
            return None
        if self.mapped.kv is not None:
            report.layout = (dtype_name(self.mapped.kv.layout.dtype), self.mapped.kv.layout.layout_id)
        if self.mapped.states is not None:
            report.state_layout = self.mapped.states.layout.layout_id
        return report

    def close(self) -> None:
        self.device.close()
        self.poll()
        if self.mapped.pool is not None:
            self.mapped.pool.close()
            self.mapped.pool = None
