"""Prefetches for the scheduler half: lower tier -> host DRAM before a hit is promised.

Scheduler side.  A prefetch runs on the I/O thread (``connector.ioloop``) while the
request's lookups answer "ask me later"; only bytes already verified in host memory are
ever promised to the engine.

* **Bounded in time.**  A request waits for its prefetch at most ``PREFETCH_SPREAD`` times
  the predicted load time (or ``PREFETCH_SLACK_S`` more), and never longer than half the
  time recomputing what it brings would take, so a tier far slower than predicted costs
  the first request at most 1.5x its recompute time before the estimate is fixed.  Past
  that deadline it takes the part already promoted and recomputes the rest; the rest of
  the prefetch is cancelled (a read nobody waits for only slows the lookups and reads that
  share its link), and the wait replaces the tier's estimate ("at most this fast": the
  bytes landed plus the piece under way, over the time waited), so the very next decision
  knows better.  A tier never measured in this process (the first load after a restart, from
  a disk whose page cache is cold) has only a prior for an estimate, so its first prefetch
  gets the whole half-recompute bound instead: the prior cannot cut a load that would pay.
  Nor can the recompute side's prior: until a prefill step has been timed (a process's
  first is never fitted), recomputing is only guessed (``prefill_tokens_per_s``, which on a
  slow CPU is 15x too fast), so the bound is then at least ``BLIND_BOUND_S``.
* **No convoys.**  Only the first lookup of an engine step blocks (``PREFETCH_POLL_S``, to
  release the GIL to the I/O thread; ``IDLE_POLL_S`` after a step that computed nothing,
  when the engine has nothing to do but wait) on a running prefetch; the others only look.  Many
  requests sharing one prefix share its promotions (the core's single flight), so they
  wait for one load once, not one after another.
* **Probes.**  A tier the cost model has not measured for a while is re-measured by one
  background read (``probe``) that no request waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable

from connector.ioloop import IOLoop
from connector.requests import Piece, ReqState
from kvstore.keys import ObjectKey
from kvstore.metrics import prometheus
from kvstore.policy import CostModel, Decision
from kvstore.store.tiered import TieredStore

log = logging.getLogger("kvstore.connector")
PREFETCH_POLL_S = 0.005  # how long the first lookup of a busy step may block on a running prefetch
IDLE_POLL_S = 0.05  # ... of a step after one that computed nothing (the engine only waits)
PREFETCH_WINDOW = 4  # promotions of one prefetch in flight at once
PREFETCH_SPREAD = 4  # a prefetch may take this many times its predicted time ...
PREFETCH_SLACK_S = 0.05  # ... or this much more, whichever is longer (but see ``start``)
BLIND_BOUND_S = 2.0  # the least a prefetch may take before any prefill step was timed


class Prefetcher:
    def __init__(
        self,
        store: TieredStore,
        io: IOLoop,
        cost: CostModel,
        on_bytes: Callable[[str, str, int], None],
        on_fail: Callable[[str, str], None],
    ) -> None:
        self.store, self.io, self.cost = store, io, cost
        self.host_name = store.host.name
        self._bytes, self._fail = on_bytes, on_fail
        self._prom = prometheus()
        self._polled_step = -1  # the step in which a lookup last blocked
        self._probes: set[ObjectKey] = set()  # keys being read to re-measure a tier (I/O thread removes)

    def start(self, st: ReqState, lower: list[Piece], decision: Decision) -> None:
        """Promote ``lower`` (the chosen pieces not in host memory) for request ``st``."""
        predicted = sum(self.cost.load_seconds(p.tier, p.nbytes) for p in lower)
        now = time.perf_counter()
        known = all(self.cost.knows(p.tier) for p in lower)
        spread = max(PREFETCH_SPREAD * predicted, predicted + PREFETCH_SLACK_S) if known else math.inf
        bound = decision.recompute_s / 2 if self.cost.knows_prefill() else max(decision.recompute_s / 2, BLIND_BOUND_S)
        st.prefetch_deadline = now + min(bound, spread)
        st.prefetch_plan = (lower[0].tier, lower[0].nbytes, now)
        st.prefetch_done = [0]
        st.prefetch = self.io.spawn(self._run([p.key for p in lower], [p.nbytes for p in lower], st.prefetch_done))

    def settled(self, st: ReqState, step: int, idle: bool = False) -> bool:
        """Whether request ``st`` may go on: its prefetch ended, or ran past its deadline.
        ``idle``: the engine's last step computed nothing, so it only waits for prefetches."""
        fut = st.prefetch
        if fut is None:
            raise LookupError(f"request {st.view.req_id}: no prefetch under way to poll")
        if self._polled_step != step:
            # One blocking wait per step: it releases the GIL, which the engine's busy step
            # loop would otherwise hold while the I/O thread needs it between reads.  When
            # the engine is idle, waiting longer costs nothing and ends the moment it lands.
            self._polled_step = step
            limit = IDLE_POLL_S if idle else PREFETCH_POLL_S
            wait = max(0.0, min(limit, st.prefetch_deadline - time.perf_counter()))
            concurrent.futures.wait([fut], timeout=wait)
        if fut.done():
            self._finish(st)
            return True
        if time.perf_counter() < st.prefetch_deadline:
            return False
        # The tier is at most this fast: what landed, plus the piece under way, took this long.
        tier, piece, t0 = st.prefetch_plan
        self.cost.observe_transfer(tier, st.prefetch_done[0] + piece, time.perf_counter() - t0, replace=True)
        self._prom["waits"].labels("prefetch", "gave_up").inc()
        fut.cancel()  # nobody waits for the rest: leave the link to the reads someone waits for
        st.prefetch, st.fetched = None, True
        return True

    def _finish(self, st: ReqState) -> None:
        fut = st.prefetch
        if fut is None:
            raise LookupError(f"request {st.view.req_id}: no prefetch under way to finish")
        st.prefetch, st.fetched = None, True
        try:
            fut.result()
        except Exception as err:  # noqa: BLE001 - a failing tier is a miss
            self._fail("lower", f"prefetch:{type(err).__name__}")
            log.warning("kvstore: prefetch for %s failed: %s", st.view.req_id, err)

    def probe(self, pieces: list[Piece], tier: str) -> None:
        """Read the first piece held by ``tier`` in the background to re-measure it; no
        request waits for it (it lands in host memory, where later lookups find it)."""
        piece = next((p for p in pieces if p.tier == tier), None)
        if piece is None or piece.key in self._probes:
            self.cost.probe_done(tier)
            return
        self._probes.add(piece.key)
        self._prom["probes"].labels(tier).inc()
        fut = self.io.spawn(self._run([piece.key], [piece.nbytes]))
        key = piece.key

        def probed(_f: concurrent.futures.Future[int]) -> None:
            self._probes.discard(key)
            self.cost.probe_done(tier)

        fut.add_done_callback(probed)

    async def _run(self, keys: list[ObjectKey], sizes: list[int], progress: list[int] | None = None) -> int:
        """Promote ``keys``, up to ``PREFETCH_WINDOW`` at once (a deeper disk queue, and one
        object's checksum overlaps the next one's read), keeping the first contiguous run
        that landed: a miss makes every later key useless.  Observes each tier's rate.
        ``progress[0]`` counts the bytes of that run so far (read by the scheduler thread)."""
        t0, by_tier = time.perf_counter(), dict[str, int]()
        tasks = [asyncio.ensure_future(self.store.promote(k)) for k in keys[:PREFETCH_WINDOW]]
        done = 0
        try:
            while done < len(tasks):
                tier = await tasks[done]
                if tier is None:
                    break
                if len(tasks) < len(keys):
                    tasks.append(asyncio.ensure_future(self.store.promote(keys[len(tasks)])))
                by_tier[tier] = by_tier.get(tier, 0) + sizes[done]
                if progress is not None:
                    progress[0] += sizes[done]
                done += 1
        except asyncio.CancelledError:  # given up: the promotions nobody else waits for stop
            for task in tasks[done:]:
                task.cancel()
            await asyncio.gather(*tasks[done:], return_exceptions=True)
            raise
        for task in tasks[done:]:  # past a miss: let them land or fail, unwaited
            task.add_done_callback(_quiet)
        seconds = time.perf_counter() - t0
        self._prom["stage"].labels("PREFETCHED").observe(seconds)
        total = sum(by_tier.values())
        for tier, nbytes in by_tier.items():
            if tier != self.host_name:
                self.cost.observe_transfer(tier, nbytes, seconds * nbytes / total)
                self._bytes(tier, "read", nbytes)
        return done


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a promotion's error is already counted by the core
