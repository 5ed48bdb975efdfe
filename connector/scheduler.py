"""Scheduler half of the connector: keys, lookup, the load-or-recompute decision, slot
bookkeeping and the per-step plan.  Runs in the engine's scheduler process.

It owns the store core (``kvstore.store.TieredStore``, opened by ``connector.lower``): a host
pool in shared memory, then SSD, the store process, Redis.  Workers only copy bytes into and
out of the slots chosen here (``connector.plan``).

Loads.  A request's prompt is hashed into chunk keys (namespace: the model identity plus
``cache_salt`` and LoRA); the contiguous hit is looked up across tiers and the cost model
picks how much of it to load.  Chunks in a lower tier are first *prefetched* into
host slots on the I/O thread while ``get_num_new_matched_tokens`` answers "ask me later"
(the engine parks the request and runs others).  Only bytes already verified in host
memory are ever promised to the engine, so a slow, failing or dead tier costs a miss,
never a failed request.  Promised chunks are pinned (a reference) until the worker reports
the copy finished.

Hits are block-exact: after the last full chunk hit, a *tail* object (the whole blocks of
another prompt's last, partial chunk, under its own key) extends the hit block by block,
so an exact repeat hits every whole block but the one holding its last token.

Waits are bounded in time, never in engine steps: a lookup that meets a save in flight of
its next chunk waits at most what recomputing the rest would cost; a request waits for its
prefetch at most four times its predicted time (never more than half of recomputing), then takes the
part already in host memory (the prefetch goes on and is measured).  Only one lookup per
step blocks (briefly) on a prefetch, so many requests sharing one load wait for it once.

Saves (``connector.saves``).  When a step completes a full prompt chunk (or the whole
prompt: its tail) that no tier holds, a host slot is reserved (incomplete, invisible) and
the worker gathers the pages into it after the forward; the worker's report commits it
(visible), then the core's write-down copies it to the lower tiers.  A finished request
whose saves were planned keeps its blocks (``delay_free``) until the worker says the
gathers are done.  When the process exits, or the engine shuts down, saves already sealed
in their slots are committed and everything committed is written down before the tiers
close (``flush_at_exit``).
"""
from __future__ import annotations

import logging
import operator
import time
from collections import OrderedDict

import numpy as np

from connector.config import ConnectorConfig
from connector.epoch import PARAMS_KEY, ParamsError, WeightsEpoch, parse_params
from connector.ioloop import IOLoop
from connector import local
from connector.hits import HitFinder
from connector.ioloop import call_before_exit
from connector.counters import SchedulerCounters
from connector.plan import NULL_BLOCK, ChunkCopy, LoadJob, ReportCollector, SaveJob, StepPlan, WorkerReport, as_groups
from connector.observe import RequestObserver
from connector.prefetch import Prefetcher
from connector.requests import Piece, ReqState, RequestView, StepInput, identity_fields
from connector.saves import SavePlanner
from kvstore import codec
from kvstore.errors import ObjectFormatError
from kvstore.keys import Identity, Namespace, ObjectKey, chunk_hashes, object_keys
from kvstore.policy import CostModel, Decision, Span
from kvstore.store.tiered import TieredStore
from connector.lower import open_store
from tiers.base import Removal, listen
from tiers.host import HostTier

log = logging.getLogger("kvstore.connector")
EXIT_SAVE_WAIT_S = 5.0   # at shutdown, how long to wait for gathers in flight to seal
NAMESPACE_CACHE = 4096  # (cache_salt, LoRA) namespaces kept, least recently used dropped first:
                        # a salt per user must not grow the scheduler without bound


class SchedulerHalf:
    def __init__(self, cfg: ConnectorConfig, identity: Identity, page_bytes: int, block_size: int,
                 store: TieredStore | None = None, workers: int = 1, parts: bool = False,
                 states: tuple[list[int], int, int] | None = None) -> None:
        """``page_bytes``: the canonical (topology-free) page; ``workers``: how many worker
        halves report each job (the TP size); ``parts``: each writes a part of every saved
        object (KV heads split over TP ranks), so this half seals them.  ``states``: recurrent
        hybrids' (state group indices, state layers, one layer's state bytes): a hit then
        ends where a state snapshot is stored and loads it (``HitFinder.with_state``)."""
        cfg.check_block_size(block_size)
        self.cfg, self.identity, self.block_size = cfg, identity, block_size
        self.workers, self.parts = workers, parts
        self.reports = ReportCollector(workers)
        self.pages_per_chunk = cfg.chunk_size // block_size
        self.page_bytes = page_bytes
        self.geometry = self._geometry(self.pages_per_chunk)
        self.object_size = codec.object_size(self.geometry)
        self.state_groups, self.state_layers, self.state_page_bytes = states or ([], 0, 0)
        self.state_bytes = codec.object_size(codec.ObjectGeometry(
            self.state_layers, 1, self.state_page_bytes, "uint8", "planned", block_size)) if states else 0
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
        self.host: HostTier = self.store.host
        self.cost = CostModel(cfg.prefill_tokens_per_s, cfg.explore_after_s)
        self.prefetch = Prefetcher(self.store, self.io, self.cost, self.counters.moved, self.counters.failed)
        self.hits = HitFinder(self.store, self.io, cfg.chunk_size, block_size, self._size_of)
        self.saves = SavePlanner(self.store, self.io, cfg.chunk_size, block_size, self._size_of,
                                 self.hits, self.counters.failed)
        self.saves.state_groups = set(self.state_groups)
        self._final_saves: list[SaveJob] = []  # planned at request_finished, sent with the next step
        self._reqs: dict[str, ReqState] = {}
        self._namespaces: OrderedDict[tuple[str, str, str], Namespace] = OrderedDict()  # LRU, NAMESPACE_CACHE
        self.epoch = WeightsEpoch()    # which weights the namespaces name (resets, declared versions)
        self._refused: OrderedDict[str, str] = OrderedDict()  # req id -> why the connector refused it
        self._warned: set[str] = set()  # refusal and unknown-key warnings already logged once
        self._released: list[str] = []  # requests whose final saves a reset cancelled (next plan)
        self._undelayed: list[str] = []  # finished requests whose gathers all reported (next plan)
        self._unreported: dict[str, set[int]] = {}  # req id -> its save jobs the workers have not reported
        self._job_owner: dict[int, str] = {}         # save job -> req id, while unreported
        self._queued_loads: list[LoadJob] = []
        self._load_pins: dict[int, list[ObjectKey]] = {}
        self._next_job = 1
        self._steps = 0                # build_plan calls so far
        self._idle = False             # whether the last step computed nothing
        self._prefill_steps = 0        # prefill-dominated steps seen (the first is not fitted)
        self._step: tuple[float, list[tuple[int, int]]] | None = None
        self._computed: dict[str, int] = {}
        self._closed = False
        self.kv_events = None  # connector.kvcache_events.ConnectorEvents: told each object's tokens
        self.observe = RequestObserver(self.stats, self.counters.lock, cfg.trace_path, self.host.name)
        if cfg.trace_path is not None:
            for tier in self.store.lower:
                listen(tier, self.observe)  # "persisted" moments in the trace
        call_before_exit(self.flush_at_exit)

    def _geometry(self, pages: int) -> codec.ObjectGeometry:
        return codec.ObjectGeometry(self.identity.num_layers, pages, self.page_bytes, "uint8", "planned",
                                    pages * self.block_size)

    def _size_of(self, pages: int) -> int:
        return self.object_size if pages == self.pages_per_chunk else codec.object_size(self._geometry(pages))

    # --- keys ------------------------------------------------------------------------------

    def _namespace(self, salt: str, lora: str) -> Namespace:
        """The namespace of one (cache_salt, LoRA) scope under the weights in memory now
        (``self.epoch``); a dropped entry is only recomputed."""
        key = (salt, lora, self.epoch.current)
        ns = self._namespaces.get(key)
        if ns is not None:
            self._namespaces.move_to_end(key)
            return ns
        ns = self._namespaces[key] = Identity(**{**identity_fields(self.identity), "scope": salt, "adapter": lora,
                                                 "weights_version": self.epoch.current}).namespace()
        if len(self._namespaces) > NAMESPACE_CACHE:
            self._namespaces.popitem(last=False)
        return ns

    def _state(self, view: RequestView) -> ReqState:
        st = self._reqs.get(view.req_id)
        if st is None or st.epoch != self.epoch.resets:  # none yet, or keyed under weights now gone
            ns = self._namespace(view.salt, view.lora)
            c = self.cfg.chunk_size
            hashes = chunk_hashes(ns, np.asarray(view.prompt, dtype=np.int64), c,
                                  extra_keys=view.chunk_extras(0, len(view.prompt) // c, c))
            old, st = st, ReqState(view, object_keys(ns, hashes), hashes, ns, epoch=self.epoch.resets)
            st.had_saves = old is not None and old.had_saves  # its blocks still wait for those gathers
            self._reqs[view.req_id] = st
        return st

    def _stale(self, st: ReqState) -> bool:
        """Whether ``st``'s keys were made before the last reset: none of its KV computed since
        may be saved under them (the weights may have changed in between)."""
        return st.epoch != self.epoch.resets

    # --- kv_transfer_params and the weights version ------------------------------------------

    def admit(self, view: RequestView) -> bool:
        """Whether the connector serves this request, after reading its ``kv_transfer_params``
        (``connector.epoch``): a malformed value, or a weights version other than the one
        this engine's weights were declared as since the last reset, is served by recompute,
        counted and told in the request's output."""
        try:
            params = parse_params(view.params)
        except ParamsError as err:
            self._refuse(view.req_id, "bad_kv_transfer_params", str(err))
            return False
        if params.unknown:
            self.counters.unknown_params(params.unknown)
            self._warn_once(f"unknown:{params.unknown}", "kv_transfer_params.%s: unknown keys %s ignored (known: "
                            "weights_version); counted in kvstore_params_unknown_keys", PARAMS_KEY, list(params.unknown))
        before = self.epoch.label
        if not self.epoch.admit(params.weights_version):
            self._refuse(view.req_id, "weights_version_mismatch",
                         f"this engine's weights are version {self.epoch.label!r} since its last reset; the request "
                         f"declares {params.weights_version!r}: served without the connector")
            return False
        if self.epoch.label != before:
            log.info("KVStoreConnector: the weights in memory are version %r (%s)", self.epoch.label, self.epoch.current)
        return True

    def _refuse(self, req_id: str, reason: str, message: str) -> None:
        self._refused[req_id] = message
        if len(self._refused) > NAMESPACE_CACHE:
            self._refused.popitem(last=False)
        self.counters.not_cached(req_id, reason)
        self._warn_once(reason, "KVStoreConnector: request %s: %s", req_id, message)

    def _warn_once(self, what: str, *args: object) -> None:
        if what not in self._warned and len(self._warned) < NAMESPACE_CACHE:
            self._warned.add(what)
            log.warning(*args)

    # --- lookup and load decision ------------------------------------------------------------

    def matched_tokens(self, view: RequestView, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` to load now (all from host memory), or None while a
        prefetch from a lower tier, or a save of the next chunk, is still running."""
        if not self.admit(view):
            return 0
        st = self._state(view)
        self._unpin(st)
        if st.prefetch is not None and not self.prefetch.settled(st, self._steps, self._idle):
            return None
        pieces = self.hits.find(st)
        if self.state_groups:
            pieces = self.hits.with_state(st, pieces, self.state_bytes, num_computed)
        kv = [p for p in pieces if not p.state]
        self.observe.found(st)
        if self.kv_events is not None:
            self.kv_events.found(st, kv)
        if self._save_pending(st, kv):
            return None  # the next chunk is being saved by an earlier request: ask again soon
        spans = [Span(p.tier, p.nbytes, p.start, p.end) for p in kv]
        if len(kv) < len(pieces):  # the state snapshot travels with the last KV piece
            spans[-1] = Span(kv[-1].tier, kv[-1].nbytes + self.state_bytes, kv[-1].start, kv[-1].end)
        decision = self.cost.plan(spans, self.host.name)
        st.first_decision = st.first_decision or decision  # before any prefetch moved the hit
        if decision.probe is not None:
            self.prefetch.probe(pieces[decision.load:], decision.probe)
        chosen = pieces[:decision.load]
        if self.state_groups:  # only the whole hit ends on its snapshot
            chosen = pieces if decision.load >= len(kv) else []
        lower = [p for p in chosen if p.tier != self.host.name]
        if lower and not st.fetched:
            self.prefetch.start(st, lower, decision)
            self.counters.prefetched()
            return None
        n = self._pin_prefix(st, chosen, num_computed)
        st.pins_end_found = pieces[-1].end if pieces else 0
        self._count_lookup(st, n, decision)
        return n

    def _save_pending(self, st: ReqState, pieces: list[Piece]) -> bool:
        """True while an object that would extend the hit is being saved by an earlier
        request: wait for it, at most the predicted time to recompute the rest."""
        end = pieces[-1].end if pieces else 0
        if not any(k in self.saves.in_flight for k in self.hits.extensions(st, end)):
            st.save_wait_until = None
            return False
        now = time.perf_counter()
        if st.save_wait_until is None:
            st.save_wait_until = now + self.cost.recompute_seconds(len(st.view.prompt) - end, end)
            self.counters.waited("save", "started")
        if now < st.save_wait_until:
            return True
        self.counters.waited("save", "gave_up")
        return False

    # --- pins ------------------------------------------------------------------------------------

    def _pin_prefix(self, st: ReqState, pieces: list[Piece], num_computed: int) -> int:
        """Pin the host-resident prefix of ``pieces`` and return the tokens to promise."""
        for p in pieces:
            slot = self.host.pin(p.key)
            if slot is None:
                break
            st.pins[p.key], st.slots[p.key] = p, slot[0]
        last = next(reversed(st.pins.values()), None)
        end = min(last.end if last else 0, len(st.view.prompt) - 1) // self.block_size * self.block_size
        if end <= num_computed or (self.state_groups and not (last and last.state and last.end == end)):
            self._unpin(st)  # a recurrent hybrid's hit needs its snapshot, at its end
            return 0
        for p in list(st.pins.values()):
            if not p.state and (p.end <= num_computed or p.start >= end):  # not needed: release now
                self.host.release(p.key)
                del st.pins[p.key], st.slots[p.key]
        st.window = (num_computed, end)
        return end - num_computed

    def _unpin(self, st: ReqState) -> None:
        for key in st.pins:
            self.host.release(key)
        st.pins.clear()
        st.slots.clear()
        st.window = (0, 0)

    def _count_lookup(self, st: ReqState, n: int, decision: Decision) -> None:
        """Count the request once, with its decision: ``miss`` (nothing found), ``load`` (the
        whole usable hit promised), ``partial`` (a prefix of it) or ``recompute`` (none).  The
        logged inputs (tiers, predicted seconds) are the first plan's, made before a prefetch
        moved the hit into host memory."""
        if st.counted:
            return
        st.counted = True
        usable = (min(st.pins_end_found, len(st.view.prompt) - 1) // self.block_size * self.block_size
                  if decision.hit else 0)
        outcome = ("miss" if not decision.hit else "recompute" if n <= 0
                   else "load" if st.window[1] >= usable else "partial")
        decision = st.first_decision or decision  # its tiers and predictions: the ones decided on
        st.decision = {**decision.as_dict(), "outcome": outcome}
        generated = self._generated_hit(st) if n > 0 else 0
        entry = self.counters.decided(st, n, outcome, decision, self.cfg.chunk_size, self.host.name, generated)
        self.observe.decided(st, entry)

    def _generated_hit(self, st: ReqState) -> int:
        """Hit tokens that an engine generated: each pinned object's header says how many of
        its last tokens were (it is in host memory, pinned; an unreadable header counts 0 and
        the load's own verification decides the rest)."""
        start, end = st.window
        total = 0
        for key, piece in st.pins.items():
            try:
                generated = codec.decode_header(self.host.buffer[st.slots[key]:]).generated
            except ObjectFormatError:
                continue
            total += max(0, min(end, piece.end) - max(start, piece.end - generated))
        return total

    # --- after allocation: the load job --------------------------------------------------------

    def after_alloc(self, req_id: str, block_ids, num_external: int) -> None:
        """``block_ids``: the request's blocks, one list per KV cache group (or one flat list)."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.groups = as_groups(block_ids)
        if num_external <= 0 or not st.pins:
            self._unpin(st)
            return
        start, end = st.window
        if end - start != num_external:  # the engine took another amount: recompute instead
            log.warning("kvstore: engine accepted %d external tokens, %d were planned", num_external, end - start)
        job = LoadJob(self._job_id(), req_id, self._load_chunks(st, start, start + num_external))
        self._load_pins[job.job_id] = list(st.pins)
        st.pins.clear()
        st.slots.clear()
        self._queued_loads.append(job)

    def _load_chunks(self, st: ReqState, start: int, end: int) -> list[ChunkCopy]:
        bs, out = self.block_size, []
        for key, p in st.pins.items():
            if p.state:  # into each state group's block at the boundary
                at = p.end // bs - 1
                groups = [[g[at]] if i in self.state_groups else [] for i, g in enumerate(st.groups)]
                out.append(ChunkCopy(st.slots[key], bytes(key), [], pages=1, group_ids=groups, state=True,
                                     boundary=p.end))
                continue
            lo, hi = max(start, p.start), min(end, p.end)
            if lo >= hi:
                continue
            groups = [g[lo // bs:(hi + bs - 1) // bs] for g in self.saves.kv_groups(st)]
            out.append(ChunkCopy(st.slots[key], bytes(key), groups[0], (lo - p.start) // bs,
                                 pages=(p.end - p.start) // bs, group_ids=groups if len(groups) > 1 else []))
        return out

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    # --- the step plan -----------------------------------------------------------------------

    def build_plan(self, step: StepInput) -> StepPlan:
        self._steps += 1
        self._track_blocks(step)
        plan = StepPlan(self.host.shm_path, self.host.array.size, self.pages_per_chunk,
                        self.cfg.chunk_size, self.geometry.page_bytes, self.state_page_bytes,
                        loads=self._queued_loads, preempted=sorted(step.preempted), released=self._released,
                        undelayed=self._undelayed)
        self._queued_loads, self._released, self._undelayed = [], [], []
        for job in plan.loads:
            self._running_state_blocks(job, step.scheduled.get(job.req_id, 0))
        plan.saves, self._final_saves = self._final_saves, []
        for req_id, n in step.scheduled.items():
            st = self._reqs.get(req_id)
            if st is not None and not self._stale(st):
                done = min(self._computed.get(req_id, 0) + n, len(st.view.all_tokens))
                job = self.saves.plan(st, done, self._next_job)
                if job is not None:
                    self._next_job += 1
                    plan.saves.append(self._unreported_job(job))
                    if self.kv_events is not None:
                        self.kv_events.saving(st, job)
        for req_id, entries in step.states.items():
            st = self._reqs.get(req_id)
            if st is not None and self.state_groups and not self._stale(st):
                job = self.saves.plan_states(st, entries, self.state_groups, self.state_bytes, self._next_job)
                if job is not None:
                    self._next_job += 1
                    plan.saves.append(self._unreported_job(job))
        work = [(self._computed.get(r, 0), n) for r, n in step.scheduled.items()]
        self._idle = not work
        self._step = (time.perf_counter(), work)
        self.observe.planned(plan)
        return plan

    def _running_state_blocks(self, job: LoadJob, n: int) -> None:
        """A state snapshot is loaded into the boundary's block (vLLM caches it there) and into
        the block the step computes in: vLLM's "align" mode copies the boundary block's state
        into that one before ``start_load_kv`` runs, so a snapshot landing only at the
        boundary would come after the copy.  The running block is the one holding the step's
        last token (``n`` tokens scheduled from the boundary)."""
        st = self._reqs.get(job.req_id)
        for chunk in job.chunks:
            if not chunk.state or st is None or n <= 0:
                continue
            at = -(-(chunk.boundary + n) // self.block_size) - 1
            for i in self.state_groups:
                table = st.groups[i] if i < len(st.groups) else []
                if at < len(table) and table[at] != NULL_BLOCK and table[at] not in chunk.group_ids[i]:
                    chunk.group_ids[i].append(table[at])

    def _track_blocks(self, step: StepInput) -> None:
        for req_id, blocks, _ in step.new:
            if req_id in self._reqs:
                self._reqs[req_id].groups = as_groups(blocks)
        for req_id, new_blocks, _, resumed in step.cached:
            st = self._reqs.get(req_id)
            if st is None or new_blocks is None:
                continue
            new = as_groups(new_blocks)
            st.groups = new if resumed or not st.groups else [a + b for a, b in zip(st.groups, new)]
        for req_id in step.preempted:
            if req_id in self._reqs:
                self._reqs[req_id].groups = []
        self._computed = {r: n for r, _, n in step.new} | {r: n for r, _, n, _ in step.cached}

    # --- worker outcomes ---------------------------------------------------------------------

    def on_report(self, report: WorkerReport | None) -> None:
        self._observe_step()
        if report is None:
            return
        if self.parts and report.layout is not None and self.saves.geometry_of is None:
            dtype, layout_id = report.layout
            self.saves.geometry_of = lambda pages: codec.ObjectGeometry(
                self.identity.num_layers, pages, self.page_bytes, dtype, layout_id, pages * self.block_size)
        if self.parts and report.state_layout is not None and self.saves.state_geometry is None:
            self.saves.state_geometry = codec.ObjectGeometry(
                self.state_layers, 1, self.state_page_bytes, "uint8", report.state_layout, self.block_size)
        for job_id, ok in report.loads.items():
            ok = self.reports.collect("load", job_id, report.load_reports.get(job_id, 1), ok, operator.and_)
            if ok is None:
                continue
            for key in self._load_pins.pop(job_id, []):
                self.host.release(key)
            if not ok:
                self.counters.failed("host", "load")
        for job_id, oks in report.saves.items():
            oks = self.reports.collect("save", job_id, report.save_reports.get(job_id, 1), oks,
                                     lambda a, b: [x and y for x, y in zip(a, b)])
            if oks is not None:
                self.saves.report(job_id, oks)
                self._reported_job(job_id)
        self.counters.reported(self.saves.committed, report.failures, report.stages)
        self.observe.reported(report)
        for raw in report.damaged:  # a damaged object is a miss from now on: drop it
            self.host.delete_sync(ObjectKey.from_bytes(raw), Removal.CORRUPT)
        if report.bytes_loaded:
            self.cost.observe_transfer(self.host.name, report.bytes_loaded, report.load_seconds)
            self.counters.moved(self.host.name, "read", report.bytes_loaded)
        if report.bytes_saved:
            self.counters.moved(self.host.name, "write", report.bytes_saved)

    def _observe_step(self) -> None:
        if self._step is not None:
            t0, work = self._step
            if sum(n for _, n in work) >= 64:  # prefill-dominated steps only
                # ... but not the process's first: it pays one-time costs (kernels built for
                # new shapes, pages faulted in), often 10x a warm step, and one such step
                # would tell the fit that recompute is slow until it is forgotten.
                if self._prefill_steps:
                    self.cost.observe_step(work, time.perf_counter() - t0)
                self._prefill_steps += 1
            self._step = None

    def not_cached(self, req_id: str, reason: str) -> None:
        """``req_id`` is neither looked up nor saved (``reason``: ``no_prompt_tokens``, an
        embeddings prompt; ``multimodal_unhashed``, an item vLLM gave no identifier).  Counted once
        per request (the engine may ask again after a preemption); the first of each reason
        is logged, so a service that sends images sees why they never hit."""
        self.counters.not_cached(req_id, reason)

    # --- end of a request ----------------------------------------------------------------------

    def request_finished(self, req_id: str, computed: int | None = None) -> bool:
        """True when the engine must keep the blocks until the worker reports the saves.
        ``computed``: tokens with KV at the end (all but the last generated one); the whole
        blocks past the last saved chunk are saved with the next step."""
        st = self._reqs.pop(req_id, None)
        if st is None:
            if req_id in self._refused:  # served without us: its refusal is counted in the stats
                self.write_stats()
            return False
        self._unpin(st)
        self.observe.finished(req_id)
        if computed is not None and not self._stale(st):
            job = self.saves.plan(st, min(computed, len(st.view.all_tokens)), self._next_job, final=True)
            if job is not None:
                self._next_job += 1
                self._final_saves.append(self._unreported_job(job))
                if self.kv_events is not None:
                    self.kv_events.saving(st, job)
        self.write_stats()
        if self._unreported.get(req_id):
            return True
        if st.had_saves:  # every gather reported: the blocks may go now, the worker is told
            self._undelayed.append(req_id)
        return False

    def _unreported_job(self, job: SaveJob) -> SaveJob:
        """A save job sent to the workers: its request's blocks are needed until they report it."""
        self._unreported.setdefault(job.req_id, set()).add(job.job_id)
        self._job_owner[job.job_id] = job.req_id
        return job

    def _reported_job(self, job_id: int) -> None:
        req_id = self._job_owner.pop(job_id, None)
        jobs = self._unreported.get(req_id)
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._unreported[req_id]

    def output_params(self, req_id: str) -> dict[str, object] | None:
        """What the request's output carries in ``kv_transfer_params`` (why the connector
        refused it), once."""
        error = self._refused.pop(req_id, None)
        return None if error is None else {PARAMS_KEY: {"error": error}}

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
            self._unpin(st)
            st.prefetch = None
        cancelled = 0
        for job in self._final_saves:
            cancelled += self.saves.cancel(job.job_id)
            self._reported_job(job.job_id)
            self._released.append(job.req_id)
        self._final_saves = []
        self.epoch.reset()
        self._namespaces.clear()
        dropped = self.host.clear_sync(Removal.RESET)
        seconds = time.perf_counter() - t0
        self.counters.reset(dropped, cancelled, seconds)
        log.info("KVStoreConnector: cache reset %d: %d host objects dropped, %d saves cancelled in %.1f ms; the "
                 "weights are unlabelled until a request declares their version", self.epoch.resets, dropped,
                 cancelled, seconds * 1e3)
        self.write_stats()
        return {"dropped": dropped, "cancelled": cancelled, "seconds": seconds}

    # --- vLLM's own statistics -------------------------------------------------------------

    def hit_sources(self, req_id: str, n: int) -> dict[str, int]:
        """The request's ``n`` external hit tokens split by the tier each was found in (their
        shares of the counted hit; the rounding goes to the first tier)."""
        st = self._reqs.get(req_id)
        by_tier = {t: k for t, k in (st.by_tier if st is not None else {}).items() if k > 0}
        total = sum(by_tier.values())
        if n <= 0 or not total:
            return {}
        out = {t: k * n // total for t, k in by_tier.items()}
        first = next(iter(out))
        out[first] += n - sum(out.values())
        return {t: k for t, k in out.items() if k > 0}

    def interval_counters(self) -> dict[str, int]:
        """Counters since the last call (hits, decisions, bytes, failures, resets), as flat
        ``name`` or ``name:label`` keys for vLLM's connector stats."""
        return self.counters.interval()

    def write_stats(self) -> None:
        tiers = {t.name: t.stats().as_dict() for t in self.store.tiers}
        self.counters.write(tiers, self.cfg.stats_path, self.saves.committed,
                            self.cost.snapshot() if self.cfg.stats_path is not None else None)

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
        if self._final_saves and (worker := local.worker_on(self.host.shm_path)) is not None:
            saves, self._final_saves = self._final_saves, []
            worker.save_now(StepPlan(self.host.shm_path, self.host.array.size, self.pages_per_chunk,
                                     self.cfg.chunk_size, self.geometry.page_bytes, self.state_page_bytes,
                                     saves=saves))
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
            self._unpin(st)
        self.flush_at_exit()
        self._closed = True
        self.io.run(self.store.aclose())
        self.io.close()



__all__ = ["NAMESPACE_CACHE", "RequestView", "SchedulerHalf", "StepInput"]
