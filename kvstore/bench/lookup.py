"""The key and index rows of ``kvstore bench tiers``: chained hashing of a 256-token chunk,
hash + lookup of a 128k-token prompt through the store core, and the host index's Python
heap bytes per object (``host_index_overhead_bytes``, by tracemalloc), each against its
target.  Runs in the bench process, on a host tier of its own (no disk, no network).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import tracemalloc

import numpy as np

from kvstore import codec
from kvstore.bench.common import Row
from kvstore.keys import ROOT, Identity, chunk_hashes, object_keys
from kvstore.store.tiered import TieredStore
from tiers.host import HostTier

MiB = 1 << 20
IDENT = Identity("bench", "r0", "bf16", "bench:opaque", 32, 8, 128)


async def hash_rows(repeat: int) -> list[Row]:
    """Microseconds per chained chunk hash, milliseconds per prompt lookup, index bytes per object."""
    ns = IDENT.namespace()
    tokens = np.random.default_rng(1).integers(0, 128000, 512 * 256)
    hash_t: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        hashes = chunk_hashes(ns, tokens, 256)
        hash_t.append(time.perf_counter() - t0)
    per_chunk_us = statistics.median(hash_t) / 512 * 1e6
    keys = object_keys(ns, hashes)
    tiny = codec.ObjectGeometry(1, 1, 64)
    store = TieredStore(HostTier(len(keys) * 4096 + MiB))
    for i, key in enumerate(keys):
        await store.put_payload(key, tiny, np.zeros(64, np.uint8), hashes[i - 1] if i else ROOT)
    look_t: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        found = await store.lookup(object_keys(ns, chunk_hashes(ns, tokens, 256)))
        look_t.append(time.perf_counter() - t0)
    assert found.hits == 512
    await store.aclose()
    overhead = host_index_overhead_bytes(20_000)
    return [
        Row("chained hash per 256-token chunk", per_chunk_us, "µs", "target", 2.0, "lower", target=1.0),
        Row("hash+lookup 128k-token prompt", statistics.median(look_t) * 1e3, "ms", "target", 2.0, "lower", target=1.0),
        Row("host index bytes per object", overhead, "B", "target", 300.0, "lower", target=1.0),
    ]


def host_index_overhead_bytes(n: int) -> float:
    """Python heap bytes per object in the host index (key, entry, dict slot), by tracemalloc."""
    geom = codec.ObjectGeometry(1, 1, 1)
    host = HostTier(n * 512, alignment=512, pin=False)
    obj = np.empty(codec.object_size(geom), np.uint8)
    ns = IDENT.namespace()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keys = object_keys(ns, chunk_hashes(ns, np.arange(n), chunk_size=1))
    for i, key in enumerate(keys):
        codec.encode_into(obj, key, geom, b"\x01")
        handle = host.put_start_sync(key, len(obj), keys[i - 1] if i else None)
        assert handle is not None and handle.buffer is not None, "the host tier refused a bench put"
        handle.buffer[:] = obj
        assert host.put_commit_sync(handle)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base - sys.getsizeof(keys)
    tracemalloc.stop()
    assert host.stats().objects == n
    return used / n


__all__ = ["IDENT", "hash_rows", "host_index_overhead_bytes"]
