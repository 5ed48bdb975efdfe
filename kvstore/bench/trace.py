"""``kvstore bench trace FILE``: a production request trace through the host tier's real
retention policy, beside plain LRU and Belady's offline MIN of the same run.

The trace is Mooncake's format (FAST'25 release), one JSON object a line: ``timestamp``
(ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per 512-token block; equal
ids are equal prefix blocks).  ``read_trace`` reads it strictly: a malformed line is a
``ConfigError`` naming its line number, never skipped.

For each capacity (in blocks, or as a fraction of the trace's distinct blocks), requests in
file order; a request's hit is the longest prefix of its ``hash_ids`` cached, as tokens
(``512 × blocks``, capped at ``input_length``), and the figure is hit tokens over all input
tokens:

* **ours**: the store core (``TieredStore`` over a ``HostTier`` holding exactly that many
  objects, no lower tier, with the retention policy ``--retention``, ``tiers.retention``):
  a ``lookup`` of the request's keys, a read of each hit object (a use), then a put of
  each block not held, each one small object chained to the block before it (its
  parent); the tier's clock is the trace's ``timestamp``.
* **plain LRU**: every block of the request is inserted or touched, then the least
  recently used go while over capacity.
* **MIN** (Belady): every block of the request is inserted, then while over capacity the
  cached block whose next use (the index of the next request naming it) is farthest goes,
  never-used-again first; a block of the current request may go at once.  Ties (two blocks
  next used by the same request) evict the one deeper in that request.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore import codec
from kvstore.bench.common import Row, print_rows
from kvstore.config import RetentionPolicy
from kvstore.errors import ConfigError
from kvstore.keys import ROOT, ChunkHash, Identity, ObjectKey
from kvstore.store.tiered import TieredStore
from tiers.base import PutResult
from tiers.host import HostTier

BLOCK_TOKENS = 512
IDENT = Identity("bench-trace", "r0", "bf16", "bench:opaque", 1, 1, 1)
GEOMETRY = codec.ObjectGeometry(1, 1, 64)  # a small payload: the policy, not the bytes, is measured
ALIGNMENT = 64
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1)
TARGETS = {0.02: 0.6, 0.05: 0.8, 0.1: 0.8}  # ours / MIN (issue 24)


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: float  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int(value: object, name: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def parse_line(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    ts = obj["timestamp"]
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise ConfigError(f"{where}: timestamp must be a non-negative number, got {ts!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: hash_ids must be a list, got {type(ids).__name__}")
    return Request(
        float(ts),
        _int(obj["input_length"], "input_length", where),
        _int(obj["output_length"], "output_length", where),
        tuple(_int(h, "each hash id", where) for h in ids),
    )


def read_trace(path: str | Path) -> list[Request]:
    """Every request of a JSON-lines trace; the first malformed line raises ``ConfigError``
    naming it (``FILE:LINE``).  Blank lines are malformed too."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            requests.append(parse_line(line, f"{path}:{n}"))
    if not requests:
        raise ConfigError(f"{path}: no requests")
    return requests


def distinct_blocks(requests: list[Request]) -> int:
    return len({h for r in requests for h in r.hash_ids})


def _hit_tokens(request: Request, blocks: int) -> int:
    return min(blocks * BLOCK_TOKENS, request.input_length)


def _ratio(hit: int, requests: list[Request]) -> float:
    total = sum(r.input_length for r in requests)
    return hit / total if total else 0.0


def _prefix(cached, ids: tuple[int, ...]) -> int:
    n = 0
    for h in ids:
        if h not in cached:
            break
        n += 1
    return n


def lru_ratio(requests: list[Request], capacity: int) -> float:
    """Plain LRU's token hit ratio (see the module docstring)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for r in requests:
        hit += _hit_tokens(r, _prefix(cache, r.hash_ids))
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return _ratio(hit, requests)


def min_ratio(requests: list[Request], capacity: int) -> float:
    """Belady's MIN token hit ratio (see the module docstring).  O(blocks log blocks)."""
    never = len(requests)
    # Next use of each (request, block): walk backwards, remembering each id's next naming.
    nexts: list[list[tuple[int, int]]] = [[] for _ in requests]
    upcoming: dict[int, tuple[int, int]] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        nexts[i] = [upcoming.get(h, (never, 0)) for h in ids]
        for pos in range(len(ids) - 1, -1, -1):
            upcoming[ids[pos]] = (i, pos)
    cached: dict[int, tuple[int, int]] = {}  # id -> its (next request, position there)
    heap: list[tuple[int, int, int]] = []  # (-next request, -position, id), lazily stale
    hit = 0
    for i, r in enumerate(requests):
        hit += _hit_tokens(r, _prefix(cached, r.hash_ids))
        for h, nxt in zip(r.hash_ids, nexts[i]):
            cached[h] = nxt
            heapq.heappush(heap, (-nxt[0], -nxt[1], h))
        while len(cached) > capacity:
            neg_req, neg_pos, h = heapq.heappop(heap)
            if cached.get(h) == (-neg_req, -neg_pos):
                del cached[h]
        if len(heap) > 4 * len(cached) + 1024:
            heap = [(-nr, -np_, h) for h, (nr, np_) in cached.items()]
            heapq.heapify(heap)
    return _ratio(hit, requests)


def block_hash(hash_id: int) -> ChunkHash:
    return ChunkHash((hash_id + 1).to_bytes(32, "big"))  # never ROOT (all zeros)


async def ours_ratio(
    requests: list[Request], capacity: int, retention: RetentionPolicy = RetentionPolicy.REUSE
) -> float:
    """The host tier's own policy through the store core (see the module docstring)."""
    now = [0.0]
    slot = -(-codec.object_size(GEOMETRY) // ALIGNMENT) * ALIGNMENT
    host = HostTier(capacity * slot, alignment=ALIGNMENT, pin=False, clock=lambda: now[0], retention=retention)
    store = TieredStore(host)
    payload = np.zeros(GEOMETRY.payload_bytes, np.uint8)
    buf = memoryview(np.empty(slot, np.uint8))
    ns = IDENT.namespace()
    hashes: dict[int, ChunkHash] = {}
    hit = 0
    try:
        for r in requests:
            now[0] = r.timestamp / 1000.0
            hs = [hashes.get(h) or hashes.setdefault(h, block_hash(h)) for h in r.hash_ids]
            ks = [ObjectKey(ns, h) for h in hs]
            n = (await store.lookup(ks, sized=False)).hits
            got = 0
            for key in ks[:n]:  # load the hit: each read is a use
                if await store.read_into(key, buf) is None:
                    break
                got += 1
            hit += _hit_tokens(r, got)
            for pos in range(n, len(ks)):
                result = await store.put_payload(ks[pos], GEOMETRY, payload, hs[pos - 1] if pos else ROOT)
                if result not in (PutResult.STORED, PutResult.EXISTS):
                    raise RuntimeError(f"trace replay: a put answered {result.name}")
    finally:
        await store.aclose()
    return _ratio(hit, requests)


@dataclass(frozen=True, slots=True)
class Result:
    capacity_fraction: float
    capacity_blocks: int
    ours: float
    lru: float
    min: float


def measure(
    requests: list[Request], capacities: list[tuple[float, int]], retention: RetentionPolicy = RetentionPolicy.REUSE
) -> list[Result]:
    out = []
    for fraction, blocks in capacities:
        out.append(
            Result(
                fraction,
                blocks,
                asyncio.run(ours_ratio(requests, blocks, retention)),
                lru_ratio(requests, blocks),
                min_ratio(requests, blocks),
            )
        )
    return out


def capacities_of(
    requests: list[Request], fractions: list[float] | None, blocks: int | None
) -> list[tuple[float, int]]:
    distinct = distinct_blocks(requests)
    if blocks is not None:
        return [(blocks / distinct, blocks)]
    return [(f, max(1, int(f * distinct))) for f in (fractions or DEFAULT_FRACTIONS)]


def rows_of(results: list[Result]) -> list[Row]:
    rows = []
    for r in results:
        cap = f"{r.capacity_fraction:.3g} ({r.capacity_blocks} blocks)"
        target = TARGETS.get(round(r.capacity_fraction, 6))
        rows.append(Row(f"ours, cap {cap}", r.ours, "hit", "Belady MIN", r.min, target=target))
        rows.append(Row(f"plain LRU, cap {cap}", r.lru, "hit", "Belady MIN", r.min))
    return rows


def run(args) -> int:
    requests = read_trace(args.file)
    fractions = args.fractions
    retention = RetentionPolicy(getattr(args, "retention", "reuse"))
    results = measure(requests, capacities_of(requests, fractions, args.capacity_blocks), retention)
    print(
        f"trace {args.file}: {len(requests)} requests, {distinct_blocks(requests)} distinct blocks, "
        f"{sum(r.input_length for r in requests)} input tokens; ours: host retention {retention.value}"
    )
    print_rows("token hit ratio, beside Belady's offline MIN of the same run (ratio = ours/MIN)", rows_of(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [
                        {
                            "capacity_fraction": r.capacity_fraction,
                            "capacity_blocks": r.capacity_blocks,
                            "ours": r.ours,
                            "lru": r.lru,
                            "min": r.min,
                        }
                        for r in results
                    ]
                },
                indent=2,
            )
        )
    return 0
