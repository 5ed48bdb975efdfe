"""The scheduler half's loads, once decided: the host-resident prefix of a hit is pinned
(a reference on each slot, so only bytes verified in host memory are ever promised), the
lookup is counted once with its decision, and after the engine allocates blocks the load job
copying pinned slots into them is queued for the next step plan.  Pins are released when
the workers report the job (``reported``), or as soon as the promise is dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable

from connector.counters import SchedulerCounters
from connector.observe import RequestObserver
from connector.plan import NULL_BLOCK, ChunkCopy, LoadJob, as_groups
from connector.requests import Piece, ReqState
from connector.saves import SavePlanner
from kvstore import codec
from kvstore.errors import ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.layout import ChunkShape
from kvstore.policy import Decision
from kvstore.store.pool import HostPool

log = logging.getLogger("kvstore.connector")


class LoadPlanner:
    def __init__(
        self,
        host: HostPool,
        shape: ChunkShape,
        state_groups: list[int],
        saves: SavePlanner,
        counters: SchedulerCounters,
        observe: RequestObserver,
        job_id: Callable[[], int],
    ) -> None:
        """``state_groups``: recurrent hybrids' state groups (a hit ends on a state snapshot);
        ``job_id``: the next job id (shared with the save jobs)."""
        self.host, self.shape, self.state_groups = host, shape, state_groups
        self.chunk_size, self.block_size = shape.chunk_size, shape.block_size
        self.saves, self.counters, self.observe, self._job_id = saves, counters, observe, job_id
        self._queued: list[LoadJob] = []
        self._pins: dict[int, list[ObjectKey]] = {}  # load job -> the slots it reads, until reported

    def pin_prefix(self, st: ReqState, pieces: list[Piece], num_computed: int) -> int:
        """Pin the host-resident prefix of ``pieces`` and return the tokens to promise."""
        for p in pieces:
            slot = self.host.pin(p.key)
            if slot is None:
                break
            st.pins[p.key], st.slots[p.key] = p, slot[0]
        last = next(reversed(st.pins.values()), None)
        end = self.shape.whole_blocks(min(last.end if last else 0, len(st.view.prompt) - 1))
        if end <= num_computed or (self.state_groups and not (last and last.state and last.end == end)):
            self.unpin(st)  # a recurrent hybrid's hit needs its snapshot, at its end
            return 0
        for p in list(st.pins.values()):
            if not p.state and (p.end <= num_computed or p.start >= end):  # not needed: release now
                self.host.release(p.key)
                del st.pins[p.key], st.slots[p.key]
        st.window = (num_computed, end)
        return end - num_computed

    def unpin(self, st: ReqState) -> None:
        for key in st.pins:
            self.host.release(key)
        st.pins.clear()
        st.slots.clear()
        st.window = (0, 0)

    def count(self, st: ReqState, n: int, decision: Decision, num_computed: int = 0) -> None:
        """Count the request once, with its decision: ``miss`` (nothing found), ``engine`` (the
        engine's own prefix cache, ``num_computed`` tokens, already holds all of the usable
        hit), ``load`` (the whole usable hit promised), ``partial`` (a prefix of it) or
        ``recompute`` (none).  The logged inputs (tiers, predicted seconds) are the first
        plan's, made before a prefetch moved the hit into host memory."""
        if st.counted:
            return
        st.counted = True
        usable = self.shape.whole_blocks(min(st.pins_end_found, len(st.view.prompt) - 1)) if decision.hit else 0
        outcome = (
            "miss"
            if not decision.hit
            else "engine"
            if usable <= num_computed
            else "recompute"
            if n <= 0
            else "load"
            if st.window[1] >= usable
            else "partial"
        )
        decision = st.first_decision or decision  # its tiers and predictions: the ones decided on
        st.decision = {**decision.as_dict(), "outcome": outcome}
        generated = self._generated_hit(st) if n > 0 else 0
        entry = self.counters.decided(st, n, outcome, decision, self.chunk_size, self.host.name, generated)
        self.observe.decided(st, entry)

    def _generated_hit(self, st: ReqState) -> int:
        """Hit tokens that an engine generated: each pinned object's header says how many of
        its last tokens were (it is in host memory, pinned; an unreadable header counts 0 and
        the load's own verification decides the rest)."""
        start, end = st.window
        total = 0
        for key, piece in st.pins.items():
            try:
                generated = codec.decode_header(_pool_buffer(self.host)[st.slots[key] :]).generated
            except ObjectFormatError:
                continue
            total += max(0, min(end, piece.end) - max(start, piece.end - generated))
        return total

    def allocated(self, st: ReqState, block_ids, num_external: int) -> None:
        """The engine allocated ``st``'s blocks (``block_ids``: one list per KV cache group, or
        one flat list) and took ``num_external`` tokens: queue the load job."""
        st.groups = as_groups(block_ids)
        if num_external <= 0 or not st.pins:
            self.unpin(st)
            return
        start, end = st.window
        if end - start != num_external:  # the engine took another amount: recompute instead
            log.warning("kvstore: engine accepted %d external tokens, %d were planned", num_external, end - start)
        job = LoadJob(self._job_id(), st.view.req_id, self._load_chunks(st, start, start + num_external))
        self._pins[job.job_id] = list(st.pins)
        st.pins.clear()
        st.slots.clear()
        self._queued.append(job)

    def _load_chunks(self, st: ReqState, start: int, end: int) -> list[ChunkCopy]:
        bs, out = self.block_size, []
        for key, p in st.pins.items():
            if p.state:  # into each state group's block at the boundary
                at = p.end // bs - 1
                groups = [[g[at]] if i in self.state_groups else [] for i, g in enumerate(st.groups)]
                out.append(
                    ChunkCopy(st.slots[key], bytes(key), [], pages=1, group_ids=groups, state=True, boundary=p.end)
                )
                continue
            lo, hi = max(start, p.start), min(end, p.end)
            if lo >= hi:
                continue
            groups = [g[lo // bs : (hi + bs - 1) // bs] for g in self.saves.kv_groups(st)]
            out.append(
                ChunkCopy(
                    st.slots[key],
                    bytes(key),
                    groups[0],
                    (lo - p.start) // bs,
                    pages=(p.end - p.start) // bs,
                    group_ids=groups if len(groups) > 1 else [],
                )
            )
        return out

    def running_state_blocks(self, job: LoadJob, n: int, st: ReqState | None) -> None:
        """A state snapshot is loaded into the boundary's block (vLLM caches it there) and into
        the block the step computes in: vLLM's "align" mode copies the boundary block's state
        into that one before ``start_load_kv`` runs, so a snapshot landing only at the
        boundary would come after the copy.  The running block is the one holding the step's
        last token (``n`` tokens scheduled from the boundary)."""
        for chunk in job.chunks:
            if not chunk.state or st is None or n <= 0:
                continue
            at = -(-(chunk.boundary + n) // self.block_size) - 1
            for i in self.state_groups:
                table = st.groups[i] if i < len(st.groups) else []
                if at < len(table) and table[at] != NULL_BLOCK and table[at] not in chunk.group_ids[i]:
                    chunk.group_ids[i].append(table[at])

    def take(self) -> list[LoadJob]:
        """The load jobs queued since the last step plan."""
        jobs, self._queued = self._queued, []
        return jobs

    def reported(self, job_id: int) -> None:
        """Every worker reported load ``job_id``: its slots may be evicted again."""
        for key in self._pins.pop(job_id, []):
            self.host.release(key)


__all__ = ["LoadPlanner"]


def _pool_buffer(host: HostPool) -> memoryview:
    """The host pool's bytes (mapped while the pool is open)."""
    if host.buffer is None:
        raise LookupError(f"host pool {host.name}: not mapped")
    return host.buffer
