"""Scheduler half of the connector: keys, lookup, the load-or-recompute decision, slot
bookkeeping and the per-step plan.  Runs in the engine's scheduler process.  The keys and
the lookup (``matched_tokens``) are the ``Lookup`` mixin of ``connector.lookup``.

It owns the store core (``kvstore.store.TieredStore``, opened by ``connector.lower``): a host
pool in shared memory, then SSD, the store process, Redis.  Workers only copy bytes into and
out of the slots chosen here (``connector.plan``).

Loads.  A prompt is hashed into chunk keys (namespace: the model identity plus ``cache_salt``
and LoRA); the contiguous hit is looked up across tiers and the cost model picks how much to
load.  Chunks in a lower tier are first *prefetched* into host slots on the I/O thread while
``get_num_new_matched_tokens`` answers "ask me later".  Only bytes already verified in host
memory are promised to the engine, so a slow, failing or dead tier costs a miss, never a
failed request; promised chunks stay pinned until the worker reports the copy finished.  Hits
are block-exact: a *tail* object (another prompt's last, partial chunk's whole blocks, under
its own key) extends a hit block by block past the last full chunk.

Waits are bounded in time, never in engine steps: a lookup meeting a save in flight of its
next chunk waits at most what recomputing the rest would cost; a request waits for its
prefetch at most four times its predicted time (at most half of recomputing), then takes the
part already in host memory.  One lookup per step blocks (briefly) on a prefetch.  Saves:
``connector.saves`` plans them, ``connector.savejobs`` follows them to their reports.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import Any

from connector import local
from connector.admission import NAMESPACE_CACHE, Admission
from connector.config import ConnectorConfig
from connector.counters import SchedulerCounters
from connector.epoch import parse_params
from connector.hits import HitFinder
from connector.ioloop import IOLoop, call_before_exit
from connector.loads import LoadPlanner
from connector.lookup import Lookup
from connector.lower import open_store
from connector.observe import RequestObserver
from connector.plan import ReportCollector, StepPlan, WorkerReport
from connector.prefetch import Prefetcher
from connector.requests import ReqState, RequestView, StepClock, StepInput, hit_sources, track_blocks
from connector.savejobs import SaveJobs
from connector.saves import SavePlanner
from connector.sessions import Sessions
from kvstore import codec
from kvstore.keys import Identity, ObjectKey
from kvstore.layout import ChunkShape
from kvstore.policy import CostModel
from kvstore.store.pool import HostPool
from kvstore.store.tiered import TieredStore
from tiers.base import Removal, listen

log = logging.getLogger("kvstore.connector")
EXIT_SAVE_WAIT_S = 5.0  # at shutdown, how long to wait for gathers in flight to seal
EventsOf = Callable[[TieredStore], Any]  # the store -> its KV event source (told each object's tokens)


class SchedulerHalf(Lookup):
    def __init__(
        self,
        cfg: ConnectorConfig,
        identity: Identity,
        page_bytes: int,
        block_size: int,
        store: TieredStore | None = None,
        workers: int = 1,
        parts: bool = False,
        states: tuple[list[int], int, int] | None = None,
        kv_events: EventsOf | None = None,
    ) -> None:
        """``page_bytes``: the canonical (topology-free) page; ``workers``: how many worker
        halves report each job (the TP size); ``parts``: each writes a part of every saved
        object (KV heads split over TP ranks), so this half seals them.  ``states``: recurrent
        hybrids' (state group indices, state layers, one layer's state bytes): a hit then
        ends where a state snapshot is stored and loads it (``HitFinder.with_state``).
        ``kv_events``: builds the KV event source (``connector.kvcache_events``) on the store."""
        self.shape = ChunkShape(cfg.chunk_size, block_size)  # a chunk covers whole blocks, or ConfigError
        self.cfg, self.identity, self.block_size = cfg, identity, block_size
        self.workers, self.parts, self.reports = workers, parts, ReportCollector(workers)
        self.pages_per_chunk, self.page_bytes = self.shape.pages, page_bytes
        self.geometry = self._geometry(self.pages_per_chunk)
        self.object_size = codec.object_size(self.geometry)
        self.state_groups, self.state_layers, self.state_page_bytes = states or ([], 0, 0)
        self.state_bytes = (
            codec.object_size(
                codec.ObjectGeometry(self.state_layers, 1, self.state_page_bytes, "uint8", "planned", block_size)
            )
            if states
            else 0
        )
        self.io = IOLoop()
        self.counters = SchedulerCounters(NAMESPACE_CACHE)
        self.stats = self.counters.stats
        if store is None:
            try:
                store = self.io.run(open_store(cfg, self.counters.moved, self.counters.failed))
            except BaseException:
                self.io.close()
                raise
        self.store = store
        self.host: HostPool = self.store.pool
        self.cost = CostModel(cfg.prefill_tokens_per_s, cfg.explore_after_s)
        self.prefetch = Prefetcher(self.store, self.io, self.cost, self.counters.moved, self.counters.failed)
        self.hits = HitFinder(self.store, self.io, self.shape, self._size_of)
        self.saves = SavePlanner(self.store, self.io, self.shape, self._size_of, self.hits, self.counters.failed)
        self.saves.state_groups = set(self.state_groups)
        self.jobs = SaveJobs()  # save jobs the workers owe a report, final saves, blocks to free
        self._reqs: dict[str, ReqState] = {}
        self.admission = Admission(identity, self.counters)  # kv_transfer_params, namespaces, refusals
        self.epoch = self.admission.epoch  # which weights the namespaces name (resets, declared versions)
        self.sessions = Sessions(self.store, self.io)  # session hints of kv_transfer_params
        self._next_job = 1
        self._steps = 0  # build_plan calls so far
        self._idle = False  # whether the last step computed nothing
        self.clock = StepClock(self.cost)  # times prefill steps for the cost model
        self._computed: dict[str, int] = {}
        self._closed = False
        self.kv_events = kv_events(self.store) if kv_events is not None else None  # told each object's tokens
        self.observe = RequestObserver(self.stats, self.counters.lock, cfg.trace_path, self.host.name)
        if cfg.trace_path is not None:
            for tier in self.store.lower:
                listen(tier, self.observe)  # "persisted" moments in the trace
        self.loads = LoadPlanner(
            self.host, self.shape, self.state_groups, self.saves, self.counters, self.observe, self._job_id
        )
        call_before_exit(self.flush_at_exit)

    def _geometry(self, pages: int) -> codec.ObjectGeometry:
        return codec.ObjectGeometry(
            self.identity.num_layers, pages, self.page_bytes, "uint8", "planned", pages * self.block_size
        )

    def _size_of(self, pages: int) -> int:
        return self.object_size if pages == self.pages_per_chunk else codec.object_size(self._geometry(pages))

    # --- keys and lookup: connector.lookup (Lookup) ------------------------------------------

    def after_alloc(self, req_id: str, block_ids, num_external: int) -> None:
        """``block_ids``: the request's blocks, one list per KV cache group (or one flat list)."""
        st = self._reqs.get(req_id)
        if st is not None:
            self.loads.allocated(st, block_ids, num_external)

    def _pool_path(self) -> str:
        """The host pool's path in shared memory, where the workers map it."""
        path = self.host.shm_path
        if path is None:
            raise LookupError(f"host pool {self.host.name}: not in shared memory, so no worker can map it")
        return path

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    # --- the step plan -----------------------------------------------------------------------

    def build_plan(self, step: StepInput) -> StepPlan:
        self._steps += 1
        self._computed = track_blocks(self._reqs, step)
        released, undelayed = self.jobs.take_told()
        plan = StepPlan(
            self._pool_path(),
            self.host.size,
            self.pages_per_chunk,
            self.cfg.chunk_size,
            self.geometry.page_bytes,
            self.state_page_bytes,
            loads=self.loads.take(),
            preempted=sorted(step.preempted),
            released=released,
            undelayed=undelayed,
        )
        for load in plan.loads:
            self.loads.running_state_blocks(load, step.scheduled.get(load.req_id, 0), self._reqs.get(load.req_id))
        plan.saves = self.jobs.take_final()
        for req_id, n in step.scheduled.items():
            st = self._reqs.get(req_id)
            if st is not None and not self._stale(st):
                done = min(self._computed.get(req_id, 0) + n, len(st.view.all_tokens))
                job = self.saves.plan(st, done, self._next_job)
                if job is not None:
                    self._next_job += 1
                    plan.saves.append(self.jobs.sent(job))
                    if self.kv_events is not None:
                        self.kv_events.saving(st, job)
        for req_id, entries in step.states.items():
            st = self._reqs.get(req_id)
            if st is not None and self.state_groups and not self._stale(st):
                job = self.saves.plan_states(st, entries, self.state_groups, self.state_bytes, self._next_job)
                if job is not None:
                    self._next_job += 1
                    plan.saves.append(self.jobs.sent(job))
        work = [(self._computed.get(r, 0), n) for r, n in step.scheduled.items()]
        self._idle = not work
        self.clock.planned(work)
        self.observe.planned(plan)
        return plan

    # --- worker outcomes ---------------------------------------------------------------------

    def on_report(self, report: WorkerReport | None) -> None:
        self.clock.observe()
        if report is None:
            return
        if self.parts and report.layout is not None and self.saves.geometry_of is None:
            dtype, layout_id = report.layout
            self.saves.geometry_of = lambda pages: codec.ObjectGeometry(
                self.identity.num_layers, pages, self.page_bytes, dtype, layout_id, pages * self.block_size
            )
        if self.parts and report.state_layout is not None and self.saves.state_geometry is None:
            self.saves.state_geometry = codec.ObjectGeometry(
                self.state_layers, 1, self.state_page_bytes, "uint8", report.state_layout, self.block_size
            )
        for job_id, ok in report.loads.items():
            ok = self.reports.collect("load", job_id, report.load_reports.get(job_id, 1), ok, operator.and_)
            if ok is None:
                continue
            self.loads.reported(job_id)
            if not ok:
                self.counters.failed("host", "load")
        for job_id, oks in report.saves.items():
            oks = self.reports.collect(
                "save", job_id, report.save_reports.get(job_id, 1), oks, lambda a, b: [x and y for x, y in zip(a, b)]
            )
            if oks is not None:
                self.saves.report(job_id, oks)
                self.jobs.reported(job_id)
        self.counters.reported(self.saves.committed, report.failures, report.stages)
        self.observe.reported(report)
        for raw in report.damaged:  # a damaged object is a miss from now on: drop it
            self.host.delete(ObjectKey.from_bytes(raw), Removal.CORRUPT)
        if report.bytes_loaded:
            self.cost.observe_transfer(self.host.name, report.bytes_loaded, report.load_seconds)
            self.counters.moved(self.host.name, "read", report.bytes_loaded)
        if report.bytes_saved:
            self.counters.moved(self.host.name, "write", report.bytes_saved)

    def not_cached(self, req_id: str, reason: str) -> None:
        """``req_id`` is neither looked up nor saved (``SchedulerCounters.not_cached``)."""
        self.counters.not_cached(req_id, reason)

    # --- end of a request ----------------------------------------------------------------------

    def request_finished(self, req_id: str, computed: int | None = None) -> bool:
        """True when the engine must keep the blocks until the worker reports the saves.
        ``computed``: tokens with KV at the end (all but the last generated one); the whole
        blocks past the last saved chunk are saved with the next step."""
        st = self._reqs.pop(req_id, None)
        if st is None:
            if self.admission.refused(req_id):  # served without us: its refusal is counted in the stats
                self.write_stats()
            return False
        self.loads.unpin(st)
        self.observe.finished(req_id)
        if computed is not None and not self._stale(st):
            job = self.saves.plan(st, min(computed, len(st.view.all_tokens)), self._next_job, final=True)
            if job is not None:
                self._next_job += 1
                self.jobs.final.append(self.jobs.sent(job))
                if self.kv_events is not None:
                    self.kv_events.saving(st, job)
        self._session_hint(st)
        self.write_stats()
        if self.jobs.unreported(req_id):
            return True
        if st.had_saves:  # every gather reported: the blocks may go now, the worker is told
            self.jobs.undelayed.append(req_id)
        return False

    def _session_hint(self, st: ReqState) -> None:
        """The request's session hint (``connector.sessions``), applied to host DRAM."""
        hint = parse_params(st.view.params).session  # admitted: it parses
        if hint is not None and not self._stale(st):
            self.sessions.finished(hint, [*st.keys, *(k for tail in st.tails.values() for k in tail)])

    def output_params(self, req_id: str) -> dict[str, object] | None:
        """What the request's output carries in ``kv_transfer_params`` (``Admission``)."""
        return self.admission.output_params(req_id)

    # --- resets --------------------------------------------------------------------------------

    def reset(self) -> dict[str, float]:
        """``reset_cache``: the weights in memory may have changed.  Nothing stored before may
        be loaded into this engine again: the namespaces change (``connector.epoch``), the host
        pool's objects are dropped (KV events say so, reason ``reset``), lookups in flight
        are released, requests running on keep their blocks but save nothing more, and final
        saves not yet gathered are cancelled (sleep discards the pages they would read).
        Lower tiers keep everything: other engines may run the old weights.  Prefetches and
        write-downs in flight finish first.  Returns what it did, with its cost."""
        t0 = time.perf_counter()
        self.io.drain()
        self.io.run(self.store.drain(), timeout=None)
        self.io.run(self.store.flush(), timeout=None)  # write-back: what only host DRAM held
        for st in self._reqs.values():
            self.loads.unpin(st)
            st.prefetch = None
        cancelled = self.jobs.cancel_final(self.saves)
        self.admission.reset()
        dropped = self.host.clear(Removal.RESET)
        seconds = time.perf_counter() - t0
        self.counters.reset(dropped, cancelled, seconds)
        log.info(
            "KVStoreConnector: cache reset %d: %d host objects dropped, %d saves cancelled in %.1f ms; the "
            "weights are unlabelled until a request declares their version",
            self.epoch.resets,
            dropped,
            cancelled,
            seconds * 1e3,
        )
        self.write_stats()
        return {"dropped": dropped, "cancelled": cancelled, "seconds": seconds}

    # --- vLLM's own statistics -------------------------------------------------------------

    def hit_sources(self, req_id: str, n: int) -> dict[str, int]:
        """The request's ``n`` external hit tokens split by the tier each was found in."""
        return hit_sources(self._reqs.get(req_id), n)

    def interval_counters(self) -> dict[str, int]:
        """Counters since the last call (hits, decisions, bytes, failures, resets), as flat
        ``name`` or ``name:label`` keys for vLLM's connector stats."""
        return self.counters.interval()

    def write_stats(self) -> None:
        tiers = {t.name: t.stats().as_dict() for t in self.store.tiers}
        self.counters.write(
            tiers,
            self.cfg.stats_path,
            self.saves.committed,
            self.cost.snapshot() if self.cfg.stats_path is not None else None,
        )

    def drain(self) -> None:
        """Wait for prefetches and write-downs in flight (a write-back flush excepted)."""
        self.io.drain()
        self.io.run(self.store.drain())

    def flush_at_exit(self) -> None:
        """Commit the saves already sealed in their slots and write everything down (the
        write-back included); the tiers stay open.  Runs when the interpreter starts exiting,
        before ``concurrent.futures`` refuses new work (vLLM's own shutdown comes later, or
        never, at the end of an ``LLM.generate`` script), and from ``close``."""
        if self._closed:
            return
        if self.jobs.final and (worker := local.worker_on(self._pool_path())) is not None:
            saves = self.jobs.take_final()
            worker.save_now(
                StepPlan(
                    self._pool_path(),
                    self.host.size,
                    self.pages_per_chunk,
                    self.cfg.chunk_size,
                    self.geometry.page_bytes,
                    self.state_page_bytes,
                    saves=saves,
                )
            )
        self.saves.adopt(EXIT_SAVE_WAIT_S)
        self.io.drain()
        self.io.run(self.store.settle(), timeout=None)
        self.write_stats()
        self.observe.close()

    def close(self) -> None:
        """Finish prefetches, commit sealed saves, write everything down, then close the
        tiers (the pool's file is unlinked)."""
        if self._closed:
            return
        for st in self._reqs.values():
            self.loads.unpin(st)
        self.sessions.close()
        self.flush_at_exit()
        self._closed = True
        self.io.run(self.store.aclose())
        self.io.close()


__all__ = ["NAMESPACE_CACHE", "RequestView", "SchedulerHalf", "StepInput"]
