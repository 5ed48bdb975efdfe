"""What the scheduler half (``connector.scheduler``) knows about each request: the engine's
view of it, one step's scheduling input, the connector's per-request state, and how a
request's lookup is counted (once per request, hits by the tier they were first found in).

Scheduler side only; no I/O.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from connector.plan import as_groups
from kvstore.keys import ChunkHash, Identity, Namespace, ObjectKey
from kvstore.metrics import HitStats
from kvstore.policy import CostModel, Decision
from kvstore.wire.kv import wire_hash


@dataclass(frozen=True, slots=True)
class RequestView:
    """The engine's request: its prompt and, live, every token so far (prompt then output:
    vLLM's ``request.all_token_ids`` grows as tokens are generated); None: the prompt only."""

    req_id: str
    prompt: Sequence[int]
    salt: str = ""
    lora: str = ""
    tokens: Sequence[int] | None = None
    mm: tuple[tuple[int, int, str], ...] = ()  # multimodal items: (offset, length, vLLM's identifier)
    params: object = None  # vLLM's kv_transfer_params of the request (ours: connector.epoch)

    @property
    def all_tokens(self) -> Sequence[int]:
        return self.prompt if self.tokens is None else self.tokens

    def extras(self, start: int, end: int) -> list[str] | None:
        """What besides its tokens changes the KV of tokens ``start..end``: every multimodal
        item whose placeholder overlaps them, by vLLM's identifier (a hash of the item's
        content, or the uuid the client gave it) and where it begins relative to ``start``.
        An image's placeholder tokens are one id repeated, the same for every image: without
        this, two images with the same text would share keys.  None: nothing (text only)."""
        out = [
            f"mm:{ident}:{offset - start}"
            for offset, length, ident in self.mm
            if offset < end and offset + length > start
        ]
        return out or None

    def chunk_extras(self, first: int, last: int, chunk: int) -> list[list[str] | None] | None:
        """``extras`` of chunks ``first..last - 1`` of ``chunk`` tokens (None: text only)."""
        if not self.mm:
            return None
        return [self.extras(i * chunk, (i + 1) * chunk) for i in range(first, last)]


Blocks = list[int] | list[list[int]]  # one group's block ids, or each KV cache group's (as_groups)


@dataclass(slots=True)
class StepInput:
    new: list[tuple[str, Blocks, int]] = field(default_factory=list)  # id, blocks, computed
    # id, new blocks, computed, resumed
    cached: list[tuple[str, Blocks | None, int, bool]] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    states: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # id -> (group, block,
    #   boundary): vLLM's recurrent-state snapshots this step computes (mamba_cache_mode "align")


@dataclass(frozen=True, slots=True)
class Piece:
    """One object of a hit: prompt tokens ``start..end`` (a full chunk, or a *tail* of whole
    blocks inside the chunk after the last full hit), ``nbytes`` big, found in ``tier``."""

    key: ObjectKey
    start: int
    end: int
    nbytes: int
    tier: str
    state: bool = False  # a recurrent-state snapshot at ``end`` (``start == end``), not KV


@dataclass
class ReqState:
    view: RequestView
    keys: list[ObjectKey]
    hashes: list[ChunkHash]
    namespace: Namespace
    groups: list[list[int]] = field(default_factory=list)  # block ids per KV cache group
    saved_upto: int = 0  # chunks already saved or skipped
    save_stopped: bool = False  # a reservation found no room: later saves would be orphans
    tail_done: bool = False  # the prompt's tail object was saved or skipped
    final_tail: int = 0  # tokens covered by the tail saved at the request's end
    pins: dict[ObjectKey, Piece] = field(default_factory=dict)  # pinned (promised) pieces, in order
    slots: dict[ObjectKey, int] = field(default_factory=dict)  # pinned key -> slot offset
    window: tuple[int, int] = (0, 0)  # token range promised to the engine
    prefetch: concurrent.futures.Future[int] | None = None  # while lower tier -> host runs
    prefetch_deadline: float = 0.0  # perf_counter past which the request stops waiting for it
    prefetch_plan: tuple[str, int, float] = ("", 0, 0.0)  # tier, first piece's bytes, start
    prefetch_done: list[int] = field(default_factory=lambda: [0])  # bytes promoted so far (I/O thread)
    fetched: bool = False
    counted: bool = False
    save_wait_until: float | None = None  # perf_counter deadline of a wait for a save in flight
    origin: dict[ObjectKey, str] = field(default_factory=dict)  # where each hit was first found
    tails: dict[int, list[ObjectKey]] = field(default_factory=dict)  # chunk index -> tail keys, longest first
    had_saves: bool = False
    decision: dict | None = None  # the load-or-recompute decision counted
    first_decision: Decision | None = None  # the decision of the first lookup
    pins_end_found: int = 0  # where the hit found by the counted lookup ended
    by_tier: dict[str, int] = field(default_factory=dict)  # hit tokens counted, by the tier found in
    epoch: int = 0  # the engine's resets when these keys were made


def count_request(
    st: ReqState, n: int, s: HitStats, p: dict, c: int, default_tier: str, generated: int = 0
) -> dict[str, object]:
    """Count a request's lookup: ``n`` tokens promised (``st.window``) from the pinned pieces,
    each hit under the tier it was first found in (``default_tier`` if unknown).  Chunks hit
    count the full chunks among them; a tail counts in tokens only.  ``generated``: how many
    of the hit tokens an engine had generated (an earlier answer, reused by a later turn).
    Returns the request's stats entry: its ``chunks`` say where each hit object came from
    (its tokens, tier and 64-bit wire hash, as the KV events name it)."""
    full = len(st.view.prompt) // c
    s.requests += 1
    s.tokens_looked_up += len(st.view.prompt)
    s.chunks_looked_up += full
    p["requests"].inc()
    p["looked_up_tokens"].inc(len(st.view.prompt))
    p["chunks"].inc(full)
    by_tier: dict[str, int] = {}
    provenance: list[dict] = []
    if n > 0:
        start, end = st.window
        s.requests_hit += 1
        s.tokens_hit += n
        p["request_hits"].inc()
        for piece in st.pins.values():
            tier = st.origin.get(piece.key, default_tier)
            lo, hi = max(start, piece.start), min(end, piece.end)
            by_tier[tier] = by_tier.get(tier, 0) + max(0, hi - lo)
            if hi > lo:
                provenance.append(
                    {"start": lo, "end": hi, "tier": tier, "hash": f"{wire_hash(piece.key.chunk_hash):016x}"}
                )
        chunks = sum(1 for piece in st.pins.values() if piece.end - piece.start == c)
        for tier, tokens in by_tier.items():
            s.add("tokens_hit_by_tier", tier, tokens)
            p["hit_tokens"].labels(tier).inc(tokens)
        s.chunks_hit += chunks
        p["chunk_hits"].inc(chunks)
        s.tokens_hit_generated += generated
        p["hit_tokens_generated"].inc(generated)
    st.by_tier = by_tier
    return s.log_request(
        len(st.view.prompt), max(n, 0), by_tier, bool(st.view.salt), st.decision, st.view.req_id, generated, provenance
    )


def identity_fields(identity: Identity) -> dict[str, Any]:
    """The fields of ``identity`` (to rebuild it with another scope or adapter)."""
    return {f: getattr(identity, f) for f in identity.__dataclass_fields__}


__all__ = [
    "Piece",
    "ReqState",
    "RequestView",
    "StepClock",
    "StepInput",
    "count_request",
    "hit_sources",
    "identity_fields",
    "track_blocks",
]


def track_blocks(reqs: dict[str, ReqState], step: StepInput) -> dict[str, int]:
    """Follow each request's blocks through ``step`` (new, grown, resumed, preempted); returns
    the tokens each scheduled request had computed before the step."""
    for req_id, blocks, _ in step.new:
        if req_id in reqs:
            reqs[req_id].groups = as_groups(blocks)
    for req_id, new_blocks, _, resumed in step.cached:
        st = reqs.get(req_id)
        if st is None or new_blocks is None:
            continue
        new = as_groups(new_blocks)
        st.groups = new if resumed or not st.groups else [a + b for a, b in zip(st.groups, new)]
    for req_id in step.preempted:
        if req_id in reqs:
            reqs[req_id].groups = []
    return {r: n for r, _, n in step.new} | {r: n for r, _, n, _ in step.cached}


def hit_sources(st: ReqState | None, n: int) -> dict[str, int]:
    """The request's ``n`` external hit tokens split by the tier each was found in (their
    shares of the counted hit; the rounding goes to the first tier)."""
    by_tier = {t: k for t, k in (st.by_tier if st is not None else {}).items() if k > 0}
    total = sum(by_tier.values())
    if n <= 0 or not total:
        return {}
    out = {t: k * n // total for t, k in by_tier.items()}
    first = next(iter(out))
    out[first] += n - sum(out.values())
    return {t: k for t, k in out.items() if k > 0}


class StepClock:
    """Times each planned step until the worker's report of it arrives, and feeds prefill-
    dominated steps to the cost model (the recompute side of every decision)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._prefill_steps = 0  # prefill-dominated steps seen (the first is not fitted)
        self._step: tuple[float, list[tuple[int, int]]] | None = None

    def planned(self, work: list[tuple[int, int]]) -> None:
        """A step was planned: (tokens computed before, tokens scheduled) per request."""
        self._step = (time.perf_counter(), work)

    def observe(self) -> None:
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
