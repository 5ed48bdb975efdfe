"""The worker half's loads: copy pinned host-pool slots into the engine's KV blocks, by the
``LoadJob``s of the step plan, verifying each object first.  See ``connector.worker``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from connector.device import CopyEvent, Device
from connector.plan import NULL_BLOCK, ChunkCopy, LoadJob, StepPlan
from connector.worker_report import Ledger, Mapped
from kvstore import codec
from kvstore.errors import ConfigError, ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.lifecycle import LoadState, Ticket, load_ticket

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

    def issued(self) -> tuple[CopyEvent, ...]:
        """The slot check and the layers' copies; ``LookupError`` before the check was issued."""
        if self.verify is None:
            raise LookupError(f"load {self.job.job_id}: its copies were never issued")
        return (self.verify, *self.events)


class LoadCopier:
    def __init__(
        self, device: Device, mapped: Mapped, ledger: Ledger, verify_loads: bool = True, load_timeout_s: float = 30.0
    ) -> None:
        self.device, self.mapped, self.ledger = device, mapped, ledger
        self.verify_loads = verify_loads
        self.load_timeout_s = load_timeout_s
        self._loads: list[_Load] = []
        self.errors: set[int] = set()  # blocks of failed loads, until take_errors

    def start(self, plan: StepPlan) -> None:
        """Issue the copies of ``plan``'s loads (the KV tensors are registered, not asleep)."""
        for job in plan.loads:
            self._loads.append(self._issue(job, plan.pages_per_chunk))

    def refuse(self, jobs: list[LoadJob]) -> None:
        """Loads not copied (the KV tensors are put away): their blocks are recomputed."""
        self.errors.update(
            b for job in jobs for c in job.chunks if not c.state for g in c.groups() for b in g if b != NULL_BLOCK
        )

    def _issue(self, job: LoadJob, pages_per_chunk: int) -> _Load:
        tickets = [load_ticket(f"{job.req_id}#{i}") for i in range(len(job.chunks))]
        load = _Load(job, tickets, started=time.perf_counter())
        for t in tickets:
            t.advance(LoadState.READABLE)  # the scheduler pinned the slot before planning
            t.begin_copy()
        load.verify = self.device.submit(
            self.ledger.timed(f"load {job.job_id} verify", lambda: self._verify(load, pages_per_chunk))
        )

        def verified(ev: CopyEvent) -> None:
            if ev.error:
                load.fail(0, f"verify: {ev.error}")

        load.verify.on_complete(verified)
        self._load_states(load)
        for layer in range(self.mapped.paged().local.num_layers):  # this worker's layers (a PP stage's)
            scatter = lambda layer=layer: self._scatter(load, layer, pages_per_chunk)  # noqa: E731
            load.events.append(self.device.submit(self.ledger.timed(f"load {job.job_id} layer {layer}", scatter)))
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
                states = self.mapped.paged(state=True)
                payload = states.payload_view(self.mapped.pool_t, chunk.slot, 1)
                for j in range(max(map(len, chunk.groups()))):  # the same page into each block
                    groups = [g[j : j + 1] for g in chunk.groups()]
                    for layer in range(states.local.num_layers):
                        states.scatter_layer(layer, groups, payload)
            except (ObjectFormatError, ConfigError, RuntimeError) as err:
                self.ledger.count("load_" + type(err).__name__)
                if isinstance(err, ObjectFormatError):
                    with self.ledger.lock:
                        self.ledger.report.damaged.append(chunk.key)
                load.fail(0, f"state: {err}")
                return

    def _verify(self, load: _Load, pages: int) -> None:
        for i, chunk in enumerate(load.job.chunks):
            try:
                self._check_object(chunk, pages)
            except (ObjectFormatError, ConfigError) as err:
                self.ledger.count("load_" + type(err).__name__)
                with self.ledger.lock:
                    self.ledger.report.damaged.append(chunk.key)
                load.fail(i, str(err))
                return
            load.tickets[i].advance(LoadState.IN_BUFFER)

    def _check_object(self, chunk: ChunkCopy, pages: int) -> None:
        view = self.mapped.pool_buffer()[chunk.slot :]
        key = ObjectKey.from_bytes(chunk.key)
        if self.verify_loads:
            header = codec.verify(view, expected_key=key)
        else:
            header = codec.decode_header(view)
            if header.key != key:
                raise codec.KeyMismatchError(f"slot holds {header.key!r}, expected {key!r}")
        g = header.geometry
        layout = self.mapped.paged(state=chunk.state and self.mapped.states is not None).layout
        if (
            (g.num_layers, g.page_bytes) != (layout.num_layers, layout.page_bytes)
            or g.pages_per_layer != (chunk.pages or pages)
            or g.pages_per_layer < chunk.page_offset + len(chunk.block_ids)
        ):
            raise codec.CorruptHeaderError(f"object geometry {g} does not fit this engine's KV layout")

    def _scatter(self, load: _Load, layer: int, pages: int) -> None:
        for i, chunk in enumerate(load.job.chunks):
            if load.failed_from is not None and i >= load.failed_from:
                return
            if chunk.state:  # copied in _load_states
                continue
            kv = self.mapped.paged()
            payload = kv.payload_view(self.mapped.pool_t, chunk.slot, chunk.pages or pages)
            kv.scatter_layer(layer, chunk.groups(), payload[:, chunk.page_offset :])

    def _guarded_on_device(self, load: _Load, event: CopyEvent) -> None:
        try:
            self._on_device(load, event)
        except Exception as err:  # noqa: BLE001 - e.g. an illegal transition: fail, don't die
            self.ledger.count("load_callback_error")
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
        if not self._loads or self.mapped.kv is None:
            return
        layer = self.mapped.kv.index.get(layer_name)
        if layer is None:
            return
        for load in self._loads:
            ev = load.events[layer]
            if not self.device.make_compute_wait(ev, self.load_timeout_s):
                self.ledger.count("load_timeout")
                load.fail(0, f"layer {layer_name} not loaded within {self.load_timeout_s}s")
            elif ev.error is not None:
                load.fail(0, f"copy: {ev.error}")

    def finish(self) -> None:
        """Drain this step's load copies, then record outcomes and failed blocks."""
        for load in self._loads:
            for ev in load.issued():
                if not ev.wait(DRAIN_LIMIT_S):
                    raise RuntimeError("a KV load copy is wedged; refusing to continue with unknown KV")
            failed = next((ev for ev in load.events if not ev.ok), None)
            if failed is not None:  # any layer, not only the last one the callback saw
                if failed.error is not None:
                    self.ledger.count("load_copy_error")  # once per load, however many layers failed
                load.fail(0, f"copy: {failed.error or failed.callback_error}")
            self._settle(load)
        self._loads = []

    def _settle(self, load: _Load) -> None:
        failed_from = load.failed_from
        ok = failed_from is None
        if failed_from is not None:
            for chunk in load.job.chunks[failed_from:]:
                if chunk.state:  # its KV blocks fail with it: vLLM recomputes from the first
                    continue
                self.errors.update(b for g in chunk.groups() for b in g if not (chunk.group_ids and b == NULL_BLOCK))
            log.warning(
                "kvstore: load %s of %s failed from chunk %d: %s",
                load.job.job_id,
                load.job.req_id,
                failed_from,
                load.tickets[failed_from].error,
            )
        for t in load.tickets:
            if t.state is LoadState.ON_DEVICE:
                t.advance(LoadState.CONSUMABLE)
            t.release()
        stages = list(load.tickets[0].durations().items()) if ok else []
        pages = sum(self._layer_pages(c) for c in load.job.chunks)  # pages of all layers copied
        with self.ledger.lock:
            r = self.ledger.report
            r.loads[load.job.job_id] = ok
            r.load_reports[load.job.job_id] = 1
            r.stages += stages
            r.timings[load.job.job_id] = [[(s.name, t) for s, t in tk.history] for tk in load.tickets]
            self.ledger.interval["loads"] += 1
            self.ledger.interval["load_failures"] += not ok
            if ok:
                nbytes = pages * self.mapped.paged().local.page_bytes  # this rank's part
                self.ledger.interval["bytes_loaded"] += nbytes
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
            return len(chunk.block_ids) * self.mapped.paged().local.num_layers
        held = [sum(b != NULL_BLOCK for b in g) for g in chunk.group_ids]
        return sum(held[g] for g in self.mapped.paged().layer_groups)

    def take_errors(self) -> set[int]:
        """The blocks whose loads failed since the last call: vLLM recomputes them."""
        errors, self.errors = self.errors, set()
        return errors


__all__ = ["DRAIN_LIMIT_S", "LoadCopier"]
