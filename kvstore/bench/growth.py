"""``kvstore bench tiers --growth``: how put and lookup latency grow with the objects held.

Runs on the machine of the bench (embedded store, no server).  For each size, the host tier
is filled through the real store core (``TieredStore.put_payload`` into a ``HostTier``; one
pool per tenant with several tenants, as the store process has), and the SSD tier over
object files written before it starts (the same bytes and paths its own put writes,
``write_files``, then ``sync``), timing its start-up scan.  Then, per operation: lookups of present keys
(hits) and of absent ones (misses), and puts of new keys into the full tier (each evicts
an old one; SSD puts are the store's write-through, waited for).  Each row is a size's p50
or p99 beside the same figure at the smallest size of the same run; the target is 2×.

Objects are 1 KiB (a 256-byte header and a 768-byte payload) in 1 KiB host slots, so the
host pool of a size is ``size`` KiB (1M objects: 977 MiB; the process peaked at 1.34 GiB).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from kvstore import codec
from kvstore.bench.common import Row
from kvstore.keys import DIGEST_SIZE, ChunkHash, Identity, ObjectKey
from kvstore.store.tiered import TieredStore
from tiers.base import PutResult
from tiers.host import HostTier
from tiers.ssd import SSDTier
from tiers.ssd_files import object_path

T = TypeVar("T")

GEOM = codec.ObjectGeometry(1, 1, 768)
OBJ = codec.object_size(GEOM)  # 1 KiB
PAYLOAD = np.arange(GEOM.payload_bytes, dtype=np.uint8)


@dataclass
class Run:
    """What one (tier, tenants, size) run held and saw: the proof the objects were there."""

    tier: str
    tenants: int
    size: int
    objects: int = 0  # objects the tier held after the fill (or the start-up scan)
    fill_s: float = 0.0  # seconds to fill (host) or to write the files (SSD)
    scan_s: float = 0.0  # SSD start-up scan (tier construction), seconds
    hits: int = 0  # lookups of present keys that hit
    misses: int = 0  # lookups of absent keys that missed
    stored: int = 0  # new puts stored
    lookups: int = 0  # lookups of each kind
    pool_bytes: int = 0  # host pool bytes (host runs)
    lat: dict[str, list[float]] = field(default_factory=dict, repr=False)  # op -> seconds


class Keys:
    """Object ``i``'s key: tenant ``i % tenants``'s namespace, a chunk hash derived from ``i``."""

    def __init__(self, tenants: int) -> None:
        self.spaces = [
            Identity(f"tenant{j}", "r0", "bf16", "bench:growth", 32, 8, 128).namespace() for j in range(tenants)
        ]
        self.tenant_of = {bytes(ns): f"t{j}" for j, ns in enumerate(self.spaces)}

    def __call__(self, i: int) -> ObjectKey:
        digest = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=DIGEST_SIZE).digest()
        return ObjectKey(self.spaces[i % len(self.spaces)], ChunkHash(digest))

    def part(self, key: bytes) -> str | None:
        return self.tenant_of.get(bytes(key[:DIGEST_SIZE]))

    def quotas(self, size: int) -> dict[str, int] | None:
        """Bytes of each tenant's share of objects ``0..size-1`` (None for one tenant)."""
        n = len(self.spaces)
        return None if n == 1 else {f"t{j}": len(range(j, size, n)) * OBJ for j in range(n)}


def write_files(root: Path, keys: Keys, n: int) -> None:
    """The SSD tier's files of objects ``0..n-1``, as its put publishes them (path, bytes,
    modes 0600/0700), written without the per-file fsync (a fast path for the bench)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    buf = np.empty(OBJ, np.uint8)
    made: set[str] = set()
    for i in range(n):
        key = keys(i)
        codec.encode_into(buf, key, GEOM, PAYLOAD)
        path = object_path(root, key)
        if path.parent.name not in made:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            made.add(path.parent.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, buf.data)
        finally:
            os.close(fd)


async def _timed(samples: list[float], coro: Awaitable[T]) -> T:
    t0 = time.perf_counter()
    out = await coro
    samples.append(time.perf_counter() - t0)
    return out


async def _lookups(store: TieredStore, keys: Keys, run: Run, ops: int, tier: str) -> None:
    """``ops`` lookups of present keys (a random sample) and ``ops`` of keys never stored."""
    hit_t, miss_t = run.lat.setdefault("lookup hit", []), run.lat.setdefault("lookup miss", [])
    rng = np.random.default_rng(run.size)
    for i in rng.integers(0, run.size, ops):
        found = await _timed(hit_t, store.lookup([keys(int(i))]))
        run.hits += found.by_tier.get(tier, 0)
    for i in range(ops):
        found = await _timed(miss_t, store.lookup([keys(run.size + ops + i)]))
        run.misses += found.hits == 0
    run.lookups = ops


async def _puts(store: TieredStore, keys: Keys, run: Run, ops: int, wait: bool) -> None:
    """``ops`` puts of new keys into the full tier (``wait``: for the write-through too)."""
    put_t = run.lat.setdefault("put", [])
    for i in range(ops):
        t0 = time.perf_counter()
        result = await store.put_payload(keys(run.size + i), GEOM, PAYLOAD)
        if wait:
            await store.drain()
        put_t.append(time.perf_counter() - t0)
        run.stored += result is PutResult.STORED


async def host_run(size: int, tenants: int, ops: int) -> Run:
    """Fill a host tier of exactly ``size`` slots through the store core, then measure."""
    keys, run = Keys(tenants), Run("host", tenants, size)
    quotas = keys.quotas(size)
    host = HostTier(size * OBJ, alignment=OBJ, pin=False, pools=quotas, pool_of=keys.part if quotas else None)
    run.pool_bytes = host.stats().capacity_bytes
    async with TieredStore(host) as store:
        t0 = time.perf_counter()
        for i in range(size):
            await store.put_payload(keys(i), GEOM, PAYLOAD)
        run.fill_s = time.perf_counter() - t0
        run.objects = host.stats().objects
        await _lookups(store, keys, run, ops, "host")
        await _puts(store, keys, run, ops, wait=False)
    return run


async def ssd_run(size: int, tenants: int, ops: int, parent: Path) -> Run:
    """Write ``size`` object files, start an SSD tier of exactly their bytes over them
    (timing its scan), and measure through a store whose host tier is small."""
    keys, run = Keys(tenants), Run("ssd", tenants, size)
    with tempfile.TemporaryDirectory(prefix="kvstore-growth-", dir=parent) as tmp:
        root = Path(tmp) / "ssd"
        t0 = time.perf_counter()
        await asyncio.to_thread(write_files, root, keys, size)
        await asyncio.to_thread(os.sync)  # the files' writeback must not land in the timed puts
        run.fill_s = time.perf_counter() - t0
        quotas = keys.quotas(size)
        t0 = time.perf_counter()
        ssd = await SSDTier.open(root, size * OBJ, partition=keys.part if quotas else None, quotas=quotas)
        run.scan_s = time.perf_counter() - t0
        run.objects = ssd.stats().objects
        async with TieredStore(HostTier(256 * OBJ, alignment=OBJ, pin=False), [ssd]) as store:
            await _lookups(store, keys, run, ops, "ssd")
            await _puts(store, keys, run, ops, wait=True)
    return run


def pct(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, in microseconds."""
    if len(samples) == 1:
        return samples[0] * 1e6
    return statistics.quantiles(samples, n=100, method="inclusive")[round(q * 100) - 1] * 1e6


def rows_of(runs: list[Run]) -> list[Row]:
    """Each run's p50/p99 per operation beside the same figure at the run's smallest size
    (same tier and tenants); p99 rows carry the 2× target.  SSD runs add the scan per object."""
    rows = []
    for run in runs:
        base = min((r for r in runs if (r.tier, r.tenants) == (run.tier, run.tenants)), key=lambda r: r.size)
        label = f"{run.tier} {_count(run.size)} obj {run.tenants}t"
        for op in ("put", "lookup hit", "lookup miss"):
            for q, target in ((0.5, None), (0.99, 2.0)):
                name = f"{label} {op} p{round(q * 100)}"
                rows.append(
                    Row(
                        name,
                        pct(run.lat[op], q),
                        "µs",
                        f"same at {_count(base.size)}",
                        pct(base.lat[op], q),
                        "lower",
                        target,
                    )
                )
        if run.tier == "ssd":
            rows.append(
                Row(
                    f"{label} scan per object",
                    run.scan_s / run.size * 1e6,
                    "µs",
                    f"same at {_count(base.size)}",
                    base.scan_s / base.size * 1e6,
                    "lower",
                    2.0,
                )
            )
    return rows


def _count(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def run_dict(run: Run) -> dict[str, object]:
    """A run for ``--json``: counts and timings, latencies as p50/p99 (µs)."""
    d = asdict(run)
    lat = d.pop("lat")
    d["latency_us"] = {op: {"p50": pct(s, 0.5), "p99": pct(s, 0.99), "n": len(s)} for op, s in lat.items()}
    return d


async def run_all(
    host_sizes: list[int], ssd_sizes: list[int], tenants: list[int], ops: int, parent: str | None
) -> list[Run]:
    """Every host size, then every SSD size, for each tenant count; a line per run as it ends."""
    runs = []
    for t in tenants:
        for size in sorted(host_sizes):
            runs.append(await host_run(size, t, ops))
            _progress(runs[-1])
        for size in sorted(ssd_sizes):
            runs.append(await ssd_run(size, t, ops, Path(parent or tempfile.gettempdir())))
            _progress(runs[-1])
    return runs


def _progress(run: Run) -> None:
    extra = f", scan {run.scan_s:.2f} s" if run.tier == "ssd" else f", pool {run.pool_bytes / 2**20:.0f} MiB"
    print(
        f"{run.tier} {run.size} objects, {run.tenants} tenant(s): held {run.objects}, filled in "
        f"{run.fill_s:.1f} s{extra}; hits {run.hits}/{run.lookups}, misses {run.misses}/{run.lookups}, "
        f"puts stored {run.stored}",
        flush=True,
    )
