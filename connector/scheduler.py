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

Saves.  When a step completes a full prompt chunk that no tier holds, a host slot is
reserved (incomplete, invisible) and the worker gathers the pages into it after the
forward; the worker's report commits it (visible), then the core's write-down copies it to
the lower tiers (write-through, or write-back under pressure and at shutdown).
A finished request whose saves were planned keeps its blocks
(``delay_free``) until the worker says the gathers are done.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from connector.config import ConnectorConfig
from connector.ioloop import IOLoop
from connector.plan import ChunkCopy, LoadJob, SaveJob, StepPlan, WorkerReport
from connector.requests import ReqState, RequestView, StepInput, count_request, identity_fields
from kvstore import codec
from kvstore.keys import Identity, Namespace, ObjectKey, chunk_hashes, object_keys
from kvstore.metrics import HitStats, prometheus
from kvstore.policy import CostModel
from kvstore.store.tiered import TieredStore
from connector.lower import open_store
from tiers.base import PutHandle
from tiers.host import HostTier

log = logging.getLogger("kvstore.connector")
PREFETCH_POLL_S = 0.005  # how long one lookup may block on a running prefetch
MAX_SAVE_WAITS = 50  # engine steps a request may wait for a chunk another request is saving
NAMESPACE_CACHE = 4096  # (cache_salt, LoRA) namespaces kept, least recently used dropped first:
                        # a salt per user must not grow the scheduler without bound


class SchedulerHalf:
    def __init__(self, cfg: ConnectorConfig, identity: Identity, page_bytes: int, block_size: int,
                 store: TieredStore | None = None) -> None:
        cfg.check_block_size(block_size)
        self.cfg, self.identity, self.block_size = cfg, identity, block_size
        self.pages_per_chunk = cfg.chunk_size // block_size
        self.geometry = codec.ObjectGeometry(identity.num_layers, self.pages_per_chunk, page_bytes,
                                             "uint8", "planned", cfg.chunk_size)
        self.object_size = codec.object_size(self.geometry)
        self.io = IOLoop()
        self._stats_lock = threading.Lock()  # guards self.stats: the I/O thread counts bytes too
        self.stats = HitStats()
        self._prom = prometheus()
        if store is None:
            try:
                store = self.io.run(open_store(cfg, self._bytes, self._fail))
            except BaseException:
                self.io.close()
                raise
        self.store = store
        self.host: HostTier = self.store.host
        self.cost = CostModel(cfg.prefill_tokens_per_s)
        self._reqs: dict[str, ReqState] = {}
        self._namespaces: OrderedDict[tuple[str, str], Namespace] = OrderedDict()  # LRU, NAMESPACE_CACHE
        self._queued_loads: list[LoadJob] = []
        self._load_pins: dict[int, list[ObjectKey]] = {}
        self._saves: dict[int, list[tuple[PutHandle, ObjectKey]]] = {}
        self._saving: dict[ObjectKey, int] = {}  # key -> save job reserving its slot
        self._next_job = 1
        self._step: tuple[float, int] | None = None
        self._computed: dict[str, int] = {}

    # --- keys ------------------------------------------------------------------------------

    def _namespace(self, salt: str, lora: str) -> Namespace:
        """The namespace of one (cache_salt, LoRA) scope; a dropped entry is only recomputed."""
        key = (salt, lora)
        ns = self._namespaces.get(key)
        if ns is not None:
            self._namespaces.move_to_end(key)
            return ns
        ns = self._namespaces[key] = Identity(**{**identity_fields(self.identity), "scope": salt, "adapter": lora}).namespace()
        if len(self._namespaces) > NAMESPACE_CACHE:
            self._namespaces.popitem(last=False)
        return ns

    def _state(self, view: RequestView) -> ReqState:
        st = self._reqs.get(view.req_id)
        if st is None:
            ns = self._namespace(view.salt, view.lora)
            hashes = chunk_hashes(ns, np.asarray(view.prompt, dtype=np.int64), self.cfg.chunk_size)
            st = self._reqs[view.req_id] = ReqState(view, object_keys(ns, hashes), hashes)
        return st

    # --- lookup and load decision ------------------------------------------------------------

    def matched_tokens(self, view: RequestView, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` to load now (all from host memory), or None when a
        prefetch from a lower tier is still running."""
        st = self._state(view)
        self._unpin(st)
        if st.prefetch is not None:
            # A short blocking wait: it releases the GIL, which the engine's busy step loop
            # would otherwise hold while the I/O thread needs it between reads.
            concurrent.futures.wait([st.prefetch], timeout=PREFETCH_POLL_S)
            if not st.prefetch.done():
                return None
            self._finish_prefetch(st)
        found = self.io.run(self.store.lookup(st.keys, sized=False))
        if self._save_pending(st, found.hits):
            return None  # the next chunk is being saved by an earlier request: ask again soon
        if not st.tiers:  # where the hit was first found (before any prefetch moved it)
            st.tiers = found.tiers
        worth = self.cost.plan(found.tiers, self.object_size, self.cfg.chunk_size)
        lower = [st.keys[i] for i in range(worth) if found.tiers[i] != self.host.name]
        if lower and not st.fetched:
            st.prefetch = self.io.spawn(self._prefetch(lower))
            self.stats.prefetches += 1
            return None
        n = self._pin_prefix(st, worth, num_computed)
        self._count_lookup(st, n)
        return n

    def _save_pending(self, st: ReqState, hits: int) -> bool:
        """True when chunk ``hits`` (the first miss) is reserved by an in-flight save; a
        request waits for it a bounded number of steps instead of recomputing it."""
        if hits >= len(st.keys) or st.keys[hits] not in self._saving or st.save_waits >= MAX_SAVE_WAITS:
            return False
        st.save_waits += 1
        return True

    async def _prefetch(self, keys: list[ObjectKey]) -> int:
        done, t0, by_tier = 0, time.perf_counter(), {}
        for key in keys:
            tier = await self.store.promote(key)
            if tier is None:
                break
            done += 1
            by_tier[tier] = by_tier.get(tier, 0) + 1
        seconds = time.perf_counter() - t0
        self._prom["stage"].labels("PREFETCHED").observe(seconds)
        for tier, n in by_tier.items():
            if tier != self.host.name:
                self.cost.observe_transfer(tier, n * self.object_size, seconds * n / done)
                self._bytes(tier, "read", n * self.object_size)
        return done

    def _finish_prefetch(self, st: ReqState) -> None:
        fut, st.prefetch, st.fetched = st.prefetch, None, True
        try:
            fut.result()
        except Exception as err:  # noqa: BLE001 - a failing tier is a miss
            self._fail("lower", f"prefetch:{type(err).__name__}")
            log.warning("kvstore: prefetch for %s failed: %s", st.view.req_id, err)

    def _pin_prefix(self, st: ReqState, chunks: int, num_computed: int) -> int:
        """Pin the host-resident prefix (≤ chunks) and return the tokens to promise."""
        prompt_len, c = len(st.view.prompt), self.cfg.chunk_size
        for key in st.keys[:chunks]:
            slot = self.host.pin(key)
            if slot is None:
                break
            st.pins[key] = slot[0]
        end = min(len(st.pins) * c, prompt_len - 1) // self.block_size * self.block_size
        if end <= num_computed:
            self._unpin(st)
            return 0
        for i, key in enumerate(st.keys[:len(st.pins)]):
            if (i + 1) * c <= num_computed or i * c >= end:  # not needed: release now
                self.host.release(key)
                del st.pins[key]
        st.window = (num_computed, end)
        return end - num_computed

    def _unpin(self, st: ReqState) -> None:
        for key in st.pins:
            self.host.release(key)
        st.pins.clear()
        st.window = (0, 0)

    def _count_lookup(self, st: ReqState, n: int) -> None:
        if not st.counted:
            st.counted = True
            count_request(st, n, self.stats, self._prom, self.cfg.chunk_size, self.host.name)

    # --- after allocation: the load job --------------------------------------------------------

    def after_alloc(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.blocks = list(block_ids)
        if num_external <= 0 or not st.pins:
            self._unpin(st)
            return
        start, end = st.window
        if end - start != num_external:  # the engine took another amount: recompute instead
            log.warning("kvstore: engine accepted %d external tokens, %d were planned", num_external, end - start)
        job = LoadJob(self._job_id(), req_id, self._load_chunks(st, start, start + num_external))
        self._load_pins[job.job_id] = list(st.pins)
        st.pins.clear()
        self._queued_loads.append(job)

    def _load_chunks(self, st: ReqState, start: int, end: int) -> list[ChunkCopy]:
        c, bs = self.cfg.chunk_size, self.block_size
        out = []
        for i, key in enumerate(st.keys):
            lo, hi = max(start, i * c), min(end, (i + 1) * c)
            if lo >= hi:
                continue
            blocks = st.blocks[lo // bs:(hi + bs - 1) // bs]
            out.append(ChunkCopy(st.pins[key], bytes(key), blocks, (lo - i * c) // bs))
        return out

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job - 1

    # --- the step plan -----------------------------------------------------------------------

    def build_plan(self, step: StepInput) -> StepPlan:
        self._track_blocks(step)
        plan = StepPlan(self.host.shm_path, self.host.array.size, self.pages_per_chunk,
                        self.cfg.chunk_size, self.geometry.page_bytes,
                        loads=self._queued_loads, preempted=sorted(step.preempted))
        self._queued_loads = []
        for req_id, n in step.scheduled.items():
            job = self._plan_saves(req_id, n)
            if job is not None:
                plan.saves.append(job)
        self._step = (time.perf_counter(), sum(step.scheduled.values()))
        return plan

    def _track_blocks(self, step: StepInput) -> None:
        for req_id, blocks, _ in step.new:
            if req_id in self._reqs:
                self._reqs[req_id].blocks = list(blocks)
        for req_id, new_blocks, _, resumed in step.cached:
            st = self._reqs.get(req_id)
            if st is None or new_blocks is None:
                continue
            st.blocks = list(new_blocks) if resumed else st.blocks + list(new_blocks)
        for req_id in step.preempted:
            if req_id in self._reqs:
                self._reqs[req_id].blocks = []
        self._computed = {r: n for r, _, n in step.new} | {r: n for r, _, n, _ in step.cached}

    def _plan_saves(self, req_id: str, scheduled: int) -> SaveJob | None:
        st = self._reqs.get(req_id)
        if st is None:
            return None
        c = self.cfg.chunk_size
        done = min(self._computed.get(req_id, 0) + scheduled, len(st.view.prompt))
        todo = list(range(st.saved_upto, min(done // c, len(st.keys))))
        if not todo:
            return None
        present = self.io.run(self.store.present([st.keys[i] for i in todo]))
        chunks, handles = [], []
        for i, there in zip(todo, present):
            if not there:
                handle = self._reserve(st, i)
                if handle is None:  # no room: later chunks would be orphans, stop here
                    st.saved_upto = len(st.keys)
                    break
                chunks.append(ChunkCopy(handle.offset, bytes(st.keys[i]), self._chunk_blocks(st, i),
                                        parent=bytes(st.hashes[i - 1]) if i else b""))
                handles.append((handle, st.keys[i]))
            st.saved_upto = i + 1
        if not chunks:
            return None
        job = SaveJob(self._job_id(), req_id, chunks, c)
        self._saves[job.job_id] = handles
        self._saving.update(dict.fromkeys((k for _, k in handles), job.job_id))
        st.had_saves = True
        return job

    def _chunk_blocks(self, st: ReqState, i: int) -> list[int]:
        return st.blocks[i * self.pages_per_chunk:(i + 1) * self.pages_per_chunk]

    def _reserve(self, st: ReqState, i: int) -> PutHandle | None:
        parent = st.keys[i - 1] if i else None
        try:
            return self.host.put_start_sync(st.keys[i], self.object_size, parent)
        except Exception as err:  # noqa: BLE001 - a full or closed pool skips the save
            self._fail("host", f"reserve:{type(err).__name__}")
            return None

    # --- worker outcomes ---------------------------------------------------------------------

    def on_report(self, report: WorkerReport | None) -> None:
        self._observe_step()
        if report is None:
            return
        for job_id, ok in report.loads.items():
            for key in self._load_pins.pop(job_id, []):
                self.host.release(key)
            if not ok:
                self._fail("host", "load")
        for job_id, oks in report.saves.items():
            for (handle, key), ok in zip(self._saves.pop(job_id, []), oks):
                self._saving.pop(key, None)
                self._commit(handle, key, ok)
        with self._stats_lock:
            for reason, n in report.failures.items():
                self.stats.add("failures", reason, n)
        for stage, seconds in report.stages:
            self._prom["stage"].labels(stage).observe(seconds)
        for raw in report.damaged:  # a damaged object is a miss from now on: drop it
            self.host.delete_sync(ObjectKey.from_bytes(raw))
        if report.bytes_loaded:
            self.cost.observe_transfer(self.host.name, report.bytes_loaded, report.load_seconds)
            self._bytes(self.host.name, "read", report.bytes_loaded)
        if report.bytes_saved:
            self._bytes(self.host.name, "write", report.bytes_saved)

    def _observe_step(self) -> None:
        if self._step is not None:
            t0, tokens = self._step
            if tokens >= 64:  # prefill-dominated steps only
                self.cost.observe_prefill(tokens, time.perf_counter() - t0)
            self._step = None

    def _commit(self, handle: PutHandle, key: ObjectKey, ok: bool) -> None:
        if not self.host.put_commit_sync(handle, ok):
            self._fail("host", "save")
            return
        self.stats.saves_committed += 1
        self.store.written(key, handle.parent)

    def _bytes(self, tier: str, direction: str, n: int) -> None:
        with self._stats_lock:
            self.stats.add("bytes_by_tier", f"{tier}:{direction}", n)
        self._prom["bytes"].labels(tier, direction).inc(n)

    def _fail(self, tier: str, reason: str) -> None:
        with self._stats_lock:
            self.stats.add("failures", f"{tier}:{reason}")
        self._prom["failures"].labels(tier, reason).inc()

    # --- end of a request ----------------------------------------------------------------------

    def request_finished(self, req_id: str) -> bool:
        """True when the engine must keep the blocks until the worker reports the saves."""
        st = self._reqs.pop(req_id, None)
        if st is None:
            return False
        self._unpin(st)
        self.write_stats()
        return st.had_saves

    def write_stats(self) -> None:
        if self.cfg.stats_path is not None:
            tiers = {t.name: t.stats().as_dict() for t in self.store.tiers}
            with self._stats_lock:
                self.stats.write(self.cfg.stats_path, tiers=tiers, cost_model=self.cost.snapshot())

    def drain(self) -> None:
        """Wait for prefetches and write-downs in flight (a write-back flush excepted)."""
        self.io.drain()
        self.io.run(self.store.drain())

    def close(self) -> None:
        """Finish prefetches, write everything down (write-back included), then close the
        tiers (the pool's file is unlinked)."""
        for st in self._reqs.values():
            self._unpin(st)
        self.io.drain()
        self.io.run(self.store.settle(), timeout=None)
        self.write_stats()
        self.io.run(self.store.aclose())
        self.io.close()



__all__ = ["NAMESPACE_CACHE", "RequestView", "SchedulerHalf", "StepInput"]
