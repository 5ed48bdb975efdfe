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
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from connector import local
from connector.device import CopyEvent, Device
from connector.plan import NULL_BLOCK, ChunkCopy, LoadJob, SaveJob, StepPlan, WorkerReport
from connector.transfer import PagedKV, dtype_name
from kvstore import codec
from kvstore.errors import ConfigError, ObjectFormatError
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from kvstore.lifecycle import LoadState, Ticket, load_ticket
from tiers.host import attach_shared

log = logging.getLogger("kvstore.connector")
DRAIN_LIMIT_S = 600.0  # past this a copy is wedged: crash rather than risk wrong KV


@dataclass
class _Load:
    job: LoadJob
    tickets: list[Ticket]
    events: list[CopyEvent] = field(default_factory=list)  # one per layer
    verify: CopyEvent | None = None  # the slot check, ordered before the layers' copies
    failed_from: int | None = None  # index of the first chunk that must be recomputed
    started: float = 0.0
    landed: float = 0.0  # when the last layer's copy was seen complete (0: not yet)

    def fail(self, chunk: int, reason: str) -> None:
        if self.failed_from is None or chunk < self.failed_from:
            self.failed_from = chunk
        for t in self.tickets[chunk:]:
            t.fail(reason)


class WorkerHalf:
    def __init__(self, device: Device, verify_loads: bool = True, load_timeout_s: float = 30.0) -> None:
        self.device = device
        self.verify_loads = verify_loads
        self.load_timeout_s = load_timeout_s
        self.kv: PagedKV | None = None
        self.states: PagedKV | None = None  # recurrent hybrids: the state layers, a page per block
        self._pool = None
        self._pool_t: torch.Tensor | None = None
        self._plan: StepPlan | None = None
        self._loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._saving: dict[str, int] = {}         # req id -> gathers in flight
        self._had_saves: set[str] = set()         # req ids that ever had a save job
        self._finished: set[str] = set()          # finished req ids awaiting their gathers
        self._report = WorkerReport()
        self._lock = threading.Lock()  # guards _report, _saving, _save_oks, _save_left, _save_issued, _had_saves, _finished
        self._save_oks: dict[int, list[bool]] = {}
        self._save_left: dict[int, int] = {}
        self._interval = _zero_interval()  # guarded by _lock
        self._save_events: list[CopyEvent] = []  # gathers not yet seen complete (worker thread only)
        self._save_issued: dict[int, tuple[float, list[float]]] = {}  # job -> (issued, done at); _lock
        self.tracing = False  # time each copy job for the trace (WorkerReport.copies)
        self._asleep: tuple[PagedKV, PagedKV | None] | None = None  # the KV put away by a sleep
        local.register(self)

    @property
    def pool_path(self) -> str | None:
        return None if self._pool is None else self._pool.path

    # --- setup -----------------------------------------------------------------------------

    def register(self, kv: PagedKV, states: PagedKV | None = None) -> None:
        self.kv, self.states = kv, states
        self.device.rank = kv.shard.rank  # fault injection may target one rank
        if self._asleep is not None:  # new tensors while asleep: they are the ones to wake on
            self._asleep = (kv, states)
            self.kv = self.states = None

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
            self._interval["sleep_drained"] += in_flight
        if self.kv is not None:
            self._asleep, self.kv, self.states = (self.kv, self.states), None, None
        return in_flight

    def restore(self) -> None:
        """After wake: copies go to the registered tensors again (the same objects, remapped
        by vLLM's sleep allocator; new ones if ``register`` was called meanwhile).  Idempotent."""
        if self._asleep is not None:
            (self.kv, self.states), self._asleep = self._asleep, None

    def _refuse_asleep(self, plan: StepPlan) -> None:
        """A plan's copies while the KV tensors are put away: loads fail, saves are dropped."""
        with self._lock:
            for job in plan.loads:
                self._load_errors.update(b for c in job.chunks if not c.state for g in c.groups() for b in g
                                         if b != NULL_BLOCK)
                self._report.loads[job.job_id] = False
                self._report.load_reports[job.job_id] = 1
            for job in plan.saves:
                self._had_saves.add(job.req_id)
                self._report.saves[job.job_id] = [False] * len(job.chunks)
                self._report.save_reports[job.job_id] = 1
            n = len(plan.loads) + len(plan.saves)
            self._interval["cancelled_asleep"] += n
            f = self._report.failures
            f["cancelled_asleep"] = f.get("cancelled_asleep", 0) + n

    def bind(self, plan: StepPlan) -> None:
        if self.kv is not None and plan.page_bytes != self.kv.layout.page_bytes:
            raise ConfigError(f"scheduler plans {plan.page_bytes}-byte pages, this worker's KV pages "
                              f"are {self.kv.layout.page_bytes} bytes ({self.kv.layout})")
        if self.states is not None and plan.state_page_bytes != self.states.layout.page_bytes:
            raise ConfigError(f"scheduler plans {plan.state_page_bytes}-byte state pages, this worker's "
                              f"are {self.states.layout.page_bytes} bytes ({self.states.layout})")
        self._plan = plan
        if plan.released:  # final saves a reset cancelled: their requests' blocks may go
            with self._lock:
                self._had_saves.update(plan.released)
        self.poll()
        if self._pool is None or self._pool.path != plan.pool_path:
            self._attach(plan.pool_path, plan.pool_size)

    def _attach(self, path: str, size: int) -> None:
        if self._pool is not None:
            self.device.synchronize()
            self._pool.close()
        self._pool = attach_shared(path, size)
        self._pool_t = torch.from_numpy(self._pool.array)

    # --- loads -----------------------------------------------------------------------------

    def start_loads(self) -> None:
        plan = self._plan
        if plan is None or not plan.loads:
            return
        if self._asleep is not None:
            self._refuse_asleep(dataclasses.replace(plan, saves=[]))
            return
        if self.kv is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        for job in plan.loads:
            self._loads.append(self._issue(job, plan.pages_per_chunk))

    def _issue(self, job: LoadJob, pages_per_chunk: int) -> _Load:
        tickets = [load_ticket(f"{job.req_id}#{i}") for i in range(len(job.chunks))]
        load = _Load(job, tickets, started=time.perf_counter())
        for t in tickets:
            t.advance(LoadState.READABLE)  # the scheduler pinned the slot before planning
            t.begin_copy()
        load.verify = self.device.submit(self._timed(f"load {job.job_id} verify",
                                                     lambda: self._verify(load, pages_per_chunk)))
        load.verify.on_complete(lambda ev: ev.error and load.fail(0, f"verify: {ev.error}"))
        self._load_states(load)
        for layer in range(self.kv.local.num_layers):  # this worker's layers (a PP stage's)
            scatter = lambda layer=layer: self._scatter(load, layer, pages_per_chunk)  # noqa: E731
            load.events.append(self.device.submit(self._timed(f"load {job.job_id} layer {layer}", scatter)))
        load.events[-1].on_complete(lambda ev: self._guarded_on_device(load, ev))
        return load

    def _load_states(self, load: _Load) -> None:
        """Recurrent hybrids: each state snapshot is checked and copied into its blocks before
        ``start_load_kv`` returns, on the compute stream's order: a recurrent layer reads its
        state at the start of the forward and, unlike attention, never waits for a layer load.
        A bad snapshot fails the whole load: the hit's KV without its state is unusable."""
        for chunk in load.job.chunks:
            if not chunk.state:
                continue
            try:
                self._check_object(chunk, 1)
                payload = self.states.payload_view(self._pool_t, chunk.slot, 1)
                for j in range(max(map(len, chunk.groups()))):  # the same page into each block
                    groups = [g[j:j + 1] for g in chunk.groups()]
                    for layer in range(self.states.local.num_layers):
                        self.states.scatter_layer(layer, groups, payload)
            except (ObjectFormatError, ConfigError, RuntimeError) as err:
                self._count("load_" + type(err).__name__)
                if isinstance(err, ObjectFormatError):
                    with self._lock:
                        self._report.damaged.append(chunk.key)
                load.fail(0, f"state: {err}")
                return

    def _verify(self, load: _Load, pages: int) -> None:
        for i, chunk in enumerate(load.job.chunks):
            try:
                self._check_object(chunk, pages)
            except (ObjectFormatError, ConfigError) as err:
                self._count("load_" + type(err).__name__)
                with self._lock:
                    self._report.damaged.append(chunk.key)
                load.fail(i, str(err))
                return
            load.tickets[i].advance(LoadState.IN_BUFFER)

    def _check_object(self, chunk: ChunkCopy, pages: int) -> None:
        view = self._pool.buffer[chunk.slot:]
        key = ObjectKey.from_bytes(chunk.key)
        if self.verify_loads:
            header = codec.verify(view, expected_key=key)
        else:
            header = codec.decode_header(view)
            if header.key != key:
                raise codec.KeyMismatchError(f"slot holds {header.key!r}, expected {key!r}")
        g = header.geometry
        layout = self.states.layout if chunk.state and self.states is not None else self.kv.layout
        if (g.num_layers, g.page_bytes) != (layout.num_layers, layout.page_bytes) \
                or g.pages_per_layer != (chunk.pages or pages) \
                or g.pages_per_layer < chunk.page_offset + len(chunk.block_ids):
            raise codec.CorruptHeaderError(f"object geometry {g} does not fit this engine's KV layout")

    def _scatter(self, load: _Load, layer: int, pages: int) -> None:
        for i, chunk in enumerate(load.job.chunks):
            if load.failed_from is not None and i >= load.failed_from:
                return
            if chunk.state:  # copied in _load_states
                continue
            payload = self.kv.payload_view(self._pool_t, chunk.slot, chunk.pages or pages)
            self.kv.scatter_layer(layer, chunk.groups(), payload[:, chunk.page_offset:])

    def _guarded_on_device(self, load: _Load, event: CopyEvent) -> None:
        try:
            self._on_device(load, event)
        except Exception as err:  # noqa: BLE001 - e.g. an illegal transition: fail, don't die
            self._count("load_callback_error")
            load.fail(0, f"completion: {err!r}")

    def _on_device(self, load: _Load, event: CopyEvent) -> None:
        load.landed = time.perf_counter()
        for t in load.tickets:
            t.end_copy()
        for t in load.tickets:
            if event.error is not None:
                t.fail(f"copy: {event.error}")
            elif t.state is LoadState.IN_BUFFER:
                t.advance(LoadState.ON_DEVICE)
        if event.error is not None:
            load.fail(0, f"copy: {event.error}")

    def wait_layer(self, layer_name: str) -> None:
        if not self._loads or self.kv is None:
            return
        layer = self.kv.index.get(layer_name)
        if layer is None:
            return
        for load in self._loads:
            ev = load.events[layer]
            if not self.device.make_compute_wait(ev, self.load_timeout_s):
                self._count("load_timeout")
                load.fail(0, f"layer {layer_name} not loaded within {self.load_timeout_s}s")
            elif ev.error is not None:
                load.fail(0, f"copy: {ev.error}")

    def finish_loads(self) -> None:
        """Drain this step's load copies, then record outcomes and failed blocks."""
        for load in self._loads:
            for ev in (load.verify, *load.events):
                if not ev.wait(DRAIN_LIMIT_S):
                    raise RuntimeError("a KV load copy is wedged; refusing to continue with unknown KV")
            failed = next((ev for ev in load.events if not ev.ok), None)
            if failed is not None:  # any layer, not only the last one the callback saw
                if failed.error is not None:
                    self._count("load_copy_error")  # once per load, however many layers failed
                load.fail(0, f"copy: {failed.error or failed.callback_error}")
            self._settle(load)
        self._loads = []

    def _settle(self, load: _Load) -> None:
        ok = load.failed_from is None
        if not ok:
            for chunk in load.job.chunks[load.failed_from:]:
                if chunk.state:  # its KV blocks fail with it: vLLM recomputes from the first
                    continue
                self._load_errors.update(b for g in chunk.groups() for b in g
                                         if not (chunk.group_ids and b == NULL_BLOCK))
            log.warning("kvstore: load %s of %s failed from chunk %d: %s", load.job.job_id,
                        load.job.req_id, load.failed_from, load.tickets[load.failed_from].error)
        for t in load.tickets:
            if t.state is LoadState.ON_DEVICE:
                t.advance(LoadState.CONSUMABLE)
            t.release()
        stages = list(load.tickets[0].durations().items()) if ok else []
        pages = sum(self._layer_pages(c) for c in load.job.chunks)  # pages of all layers copied
        with self._lock:
            r = self._report
            r.loads[load.job.job_id] = ok
            r.load_reports[load.job.job_id] = 1
            r.stages += stages
            r.timings[load.job.job_id] = [[(s.name, t) for s, t in tk.history] for tk in load.tickets]
            self._interval["loads"] += 1
            self._interval["load_failures"] += not ok
            if ok:
                nbytes = pages * self.kv.local.page_bytes  # this rank's part
                self._interval["bytes_loaded"] += nbytes
                r.bytes_loaded += nbytes
                # the copies' own time (issue to the last layer landing), not the forward's:
                # it is the host tier's bandwidth the cost model learns from it
                r.load_seconds += (load.landed or time.perf_counter()) - load.started

    def _layer_pages(self, chunk: ChunkCopy) -> int:
        """Pages a load of ``chunk`` copies over all layers (a hybrid model's sliding-window
        layers only copy the blocks inside their window)."""
        if chunk.state:
            return 0
        if not chunk.group_ids:
            return len(chunk.block_ids) * self.kv.local.num_layers
        held = [sum(b != NULL_BLOCK for b in g) for g in chunk.group_ids]
        return sum(held[g] for g in self.kv.layer_groups)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

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
                layout = self.states.layout if chunk.state else self.kv.layout
                geometry = layout.geometry(pages, plan.chunk_tokens * pages // plan.pages_per_chunk)
                gather = lambda c=chunk, p=pages: self._gather(c, p)  # noqa: E731
                ev = self.device.submit(self._timed(f"save {job.job_id} chunk {i}", gather))
                ev.on_complete(lambda e, j=job, i=i, g=geometry: self._saved(j, i, e, g))
                self._save_events.append(ev)
                if chunk.state:
                    states.append(ev)
            for ev in states:  # a state block is freed two steps on: never let a gather outlive it
                if not ev.wait(DRAIN_LIMIT_S):
                    raise RuntimeError("a state snapshot copy is wedged; refusing to go on past its block")

    def _gather(self, chunk: ChunkCopy, pages: int) -> None:
        """Only enqueues the copy on a stream device: the header is sealed in ``_saved``."""
        kv = self.states if chunk.state else self.kv
        payload = kv.payload_view(self._pool_t, chunk.slot, pages)
        kv.gather(chunk.groups(), payload)

    def _seal(self, chunk: ChunkCopy, geometry: codec.ObjectGeometry) -> None:
        parent = ChunkHash(chunk.parent) if chunk.parent else ROOT
        view = self._pool.buffer[chunk.slot:chunk.slot + codec.object_size(geometry)]
        codec.encode_into(view, ObjectKey.from_bytes(chunk.key), geometry, None, parent, chunk.generated)

    def _writes_whole(self, chunk: ChunkCopy) -> bool:
        """Whether this worker alone writes ``chunk``'s object (so it seals it here)."""
        shard = (self.states if chunk.state else self.kv).shard
        return shard.whole and shard.writes

    def _saved(self, job: SaveJob, i: int, event: CopyEvent, geometry: codec.ObjectGeometry) -> None:
        """Completion of the gather of chunk i (SNAPSHOT_DONE), on whichever thread observed
        it: seal the header over the landed bytes, then report."""
        ok = event.error is None
        if not ok:
            log.warning("kvstore: save of %s chunk %d failed: %s", job.req_id, i, event.error)
            self._count("save_copy_error")
        elif self._writes_whole(job.chunks[i]):  # else: the scheduler seals, all parts in
            try:
                self._seal(job.chunks[i], geometry)
            except Exception as err:  # noqa: BLE001 - fail the chunk, keep the thread
                ok = False
                log.warning("kvstore: sealing %s chunk %d failed: %r", job.req_id, i, err)
                self._count("save_seal_error")
        with self._lock:
            self._save_oks[job.job_id][i] = ok
            self._save_issued[job.job_id][1][i] = time.monotonic()  # SNAPSHOT_DONE (as observed)
            self._save_left[job.job_id] -= 1
            self._saving[job.req_id] -= 1
            chunk = job.chunks[i]
            kv = self.states if chunk.state else self.kv
            nbytes = (kv.local.page_bytes * kv.local.num_layers * max(len(chunk.block_ids), chunk.state)
                      if kv.shard.writes else 0)
            self._interval["saves"] += 1
            self._interval["save_failures"] += not ok
            if ok:
                self._report.bytes_saved += nbytes
                self._interval["bytes_saved"] += nbytes
            if self._save_left[job.job_id] == 0:
                del self._save_left[job.job_id]
                self._report.saves[job.job_id] = self._save_oks.pop(job.job_id)
                self._report.save_reports[job.job_id] = 1
                self._report.save_times[job.job_id] = self._save_issued.pop(job.job_id)

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

    def _timed(self, what: str, job):
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
                with self._lock:
                    self._report.copies.append((f"rank {self.kv.shard.rank}: {what}", t0, t1))
        return timed

    def _count(self, reason: str) -> None:
        with self._lock:
            f = self._report.failures
            f[reason] = f.get(reason, 0) + 1

    def take_interval(self) -> dict[str, int]:
        """Counters since the last call, for vLLM's periodic connector-stats log."""
        self.poll()
        with self._lock:
            data, self._interval = self._interval, _zero_interval()
        return {k: v for k, v in data.items() if v}

    def take_report(self) -> WorkerReport | None:
        self.poll()
        with self._lock:
            report, self._report = self._report, WorkerReport()
        if report.empty():
            return None
        if self.kv is not None:
            report.layout = (dtype_name(self.kv.layout.dtype), self.kv.layout.layout_id)
        if self.states is not None:
            report.state_layout = self.states.layout.layout_id
        return report

    def close(self) -> None:
        self.device.close()
        self.poll()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _zero_interval() -> dict[str, int]:
    return dict.fromkeys(("loads", "load_failures", "bytes_loaded", "saves", "save_failures", "bytes_saved",
                          "sleep_drained", "cancelled_asleep"), 0)
