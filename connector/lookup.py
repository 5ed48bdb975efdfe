"""Keys and lookup of the connector's scheduler half: ``Lookup``, mixed into
``connector.scheduler.SchedulerHalf``, keys each request (``_state``: namespace, chunk hashes,
object keys; ``_stale``: keyed before the last reset) and answers vLLM's
``get_num_new_matched_tokens`` (``matched_tokens``): the hit across tiers, the cost model's
load-or-recompute decision, a prefetch from a lower tier started (answer: "ask me later"),
a wait for a save in flight of the next chunk (``_save_pending``, bounded in time), then
the host slots pinned for the load.  Runs in the engine's scheduler process.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from connector.admission import Admission
from connector.config import ConnectorConfig
from connector.counters import SchedulerCounters
from connector.epoch import WeightsEpoch
from connector.hits import HitFinder
from connector.loads import LoadPlanner
from connector.observe import RequestObserver
from connector.prefetch import Prefetcher
from connector.requests import Piece, ReqState, RequestView
from connector.saves import SavePlanner
from kvstore.keys import chunk_hashes, object_keys
from kvstore.policy import CostModel, Span
from kvstore.store.pool import HostPool


class Lookup:
    """The keys and the lookup of ``SchedulerHalf`` (mixed into it; its ``__init__`` sets
    every attribute declared here)."""

    # What the scheduler half provides (declared for the type checker; set by ``SchedulerHalf``).
    cfg: ConnectorConfig
    admission: Admission
    epoch: WeightsEpoch
    counters: SchedulerCounters
    cost: CostModel
    host: HostPool
    hits: HitFinder
    loads: LoadPlanner
    prefetch: Prefetcher
    saves: SavePlanner
    observe: RequestObserver
    kv_events: Any
    state_groups: list[int]
    state_bytes: int
    _reqs: dict[str, ReqState]
    _steps: int
    _idle: bool

    # --- keys ------------------------------------------------------------------------------

    def _state(self, view: RequestView) -> ReqState:
        st = self._reqs.get(view.req_id)
        if st is None or st.epoch != self.epoch.resets:  # none yet, or keyed under weights now gone
            ns = self.admission.namespace(view.salt, view.lora)
            c = self.cfg.chunk_size
            hashes = chunk_hashes(
                ns,
                np.asarray(view.prompt, dtype=np.int64),
                c,
                extra_keys=view.chunk_extras(0, len(view.prompt) // c, c),
            )
            old, st = st, ReqState(view, object_keys(ns, hashes), hashes, ns, epoch=self.epoch.resets)
            st.had_saves = old is not None and old.had_saves  # its blocks still wait for those gathers
            self._reqs[view.req_id] = st
        return st

    def _stale(self, st: ReqState) -> bool:
        """Whether ``st``'s keys were made before the last reset: none of its KV computed since
        may be saved under them (the weights may have changed in between)."""
        return st.epoch != self.epoch.resets

    # --- lookup and load decision ------------------------------------------------------------

    def matched_tokens(self, view: RequestView, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` to load now (all from host memory), or None while a
        prefetch from a lower tier, or a save of the next chunk, is still running."""
        if not self.admission.admit(view):
            return 0
        st = self._state(view)
        self.loads.unpin(st)
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
            self.prefetch.probe(pieces[decision.load :], decision.probe)
        chosen = pieces[: decision.load]
        if self.state_groups:  # only the whole hit ends on its snapshot
            chosen = pieces if decision.load >= len(kv) else []
        lower = [p for p in chosen if p.tier != self.host.name]
        if lower and not st.fetched:
            self.prefetch.start(st, lower, decision)
            self.counters.prefetched()
            return None
        n = self.loads.pin_prefix(st, chosen, num_computed)
        st.pins_end_found = pieces[-1].end if pieces else 0
        self.loads.count(st, n, decision, num_computed)
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


__all__ = ["Lookup"]
