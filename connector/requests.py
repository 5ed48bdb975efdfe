"""What the scheduler half (``connector.scheduler``) knows about each request: the engine's
view of it, one step's scheduling input, the connector's per-request state, and how a
request's lookup is counted (once per request, hits by the tier they were first found in).

Scheduler side only; no I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChunkHash, Identity, ObjectKey
from kvstore.metrics import HitStats


@dataclass(frozen=True, slots=True)
class RequestView:
    req_id: str
    prompt: Sequence[int]
    salt: str = ""
    lora: str = ""


@dataclass(slots=True)
class StepInput:
    new: list[tuple[str, list[int], int]] = field(default_factory=list)              # id, blocks, computed
    cached: list[tuple[str, list[int] | None, int, bool]] = field(default_factory=list)  # id, new blocks, computed, resumed
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)


@dataclass
class ReqState:
    view: RequestView
    keys: list[ObjectKey]
    hashes: list[ChunkHash]
    blocks: list[int] = field(default_factory=list)
    saved_upto: int = 0                      # chunks already saved or skipped
    pins: dict[ObjectKey, int] = field(default_factory=dict)  # pinned key -> slot offset
    window: tuple[int, int] = (0, 0)         # token range promised to the engine
    prefetch: object = None                  # concurrent.futures.Future while SSD→host runs
    fetched: bool = False
    counted: bool = False
    save_waits: int = 0
    tiers: Sequence[str] = ()               # where each hit was first found
    had_saves: bool = False


def count_request(st: ReqState, n: int, s: HitStats, p: dict, c: int, default_tier: str) -> None:
    """Count a request's lookup: ``n`` tokens promised (``st.window``), chunks of ``c``
    tokens, each hit under the tier it was first found in (``default_tier`` past those)."""
    full = len(st.view.prompt) // c
    s.requests += 1
    s.tokens_looked_up += len(st.view.prompt)
    s.chunks_looked_up += full
    p["requests"].inc()
    p["looked_up_tokens"].inc(len(st.view.prompt))
    p["chunks"].inc(full)
    by_tier: dict[str, int] = {}
    if n > 0:
        start, end = st.window
        s.requests_hit += 1
        s.tokens_hit += n
        p["request_hits"].inc()
        for i in range(start // c, (end + c - 1) // c):
            tier = st.tiers[i] if i < len(st.tiers) else default_tier
            by_tier[tier] = by_tier.get(tier, 0) + min(end, (i + 1) * c) - max(start, i * c)
        for tier, tokens in by_tier.items():
            s.add("tokens_hit_by_tier", tier, tokens)
            p["hit_tokens"].labels(tier).inc(tokens)
        s.chunks_hit += len(st.pins)
        p["chunk_hits"].inc(len(st.pins))
    s.log_request(len(st.view.prompt), max(n, 0), by_tier, bool(st.view.salt))


def identity_fields(identity: Identity) -> dict[str, object]:
    """The fields of ``identity`` (to rebuild it with another scope or adapter)."""
    return {f: getattr(identity, f) for f in identity.__dataclass_fields__}


__all__ = ["ReqState", "RequestView", "StepInput", "count_request", "identity_fields"]
