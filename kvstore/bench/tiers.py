"""``kvstore bench tiers``: host and SSD tiers against limits measured in the same run.

Limits: a copy of the same bytes into a reused buffer (``numpy.copyto``) for the host tier;
plain ``write`` + ``fsync`` of a new file and a plain ``readinto`` of a file dropped from
the page cache for the SSD tier, and the same ``readinto``, cold and warm, for the engine
identity's weight digest of a 1 GiB file.  Objects of 32 MiB and 28 MiB are both measured
(glibc treats fresh allocations of these sizes differently; a pooled tier must not care).
The integrity rows put the MAC every object is sealed and checked with (keyed BLAKE3,
``kvstore.integrity``), encryption at rest as the write-down and the reads do it
(``integrity.encrypt``: AES-256-GCM into a reused buffer plus the xxh3 of the ciphertext;
``integrity.decrypt_in_place`` plus the xxh3 of the plaintext) and the xxh3-128 checksum
beside a copy of the same 32 MiB object, one thread each.  The SSD hit rows time a 2 MiB
chunk read from SSD into the host pool through the store core (promotion: read, checks,
publish, then the copy out), encrypted against MAC-checked only, cold and warm.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import codec, integrity
from kvstore.bench.common import Row, gbps, print_rows, write_json, write_plot
from kvstore.bench.lookup import IDENT, hash_rows
from kvstore.keys import ObjectKey, chunk_hashes, object_keys
from kvstore.store.tiered import TieredStore
from tiers.base import put_bytes
from tiers.host import HostTier
from tiers.ssd import SSDTier, drop_page_cache

MiB = 1 << 20


def _object(size: int, seed: int) -> tuple[ObjectKey, np.ndarray]:
    """A sealed object of exactly ``size`` bytes, with random payload."""
    ns = IDENT.namespace()
    key = object_keys(ns, chunk_hashes(ns, np.full(256, seed), 256))[0]
    geom = codec.ObjectGeometry(1, 1, size - codec.HEADER_SIZE, "bf16", "bench:opaque")
    buf = np.empty(size, np.uint8)
    rng = np.random.default_rng(seed)
    codec.encode_into(buf, key, geom, rng.integers(0, 256, geom.payload_bytes, dtype=np.uint8))
    return key, buf


def _timed(samples: list[float], t0: float) -> None:
    samples.append(time.perf_counter() - t0)


async def _host_rows(size: int, repeat: int) -> list[Row]:
    """Steady state: one key put (then deleted, untimed, so the slot is reused) and read.
    Each operation runs in its own loop, so each meets the caches as the limit does."""
    key, src = _object(size, size)
    dst = np.empty(size, np.uint8)
    host = HostTier(2 * size + 4 * MiB)

    async def put() -> float:
        t0 = time.perf_counter()
        handle = await host.put_start(key, size)
        assert handle is not None and handle.buffer is not None, "the host tier refused a bench put"
        handle.buffer[:size] = src.data
        await host.put_commit(handle, True)
        return time.perf_counter() - t0

    def copy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    copies = [copy() for _ in range(repeat)]
    puts: list[float] = []
    for _ in range(repeat):
        puts.append(await put())
        await host.delete(key)
    await put()
    gets: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await host.read_into(key, memoryview(dst))
        gets.append(time.perf_counter() - t0)
    copies += [copy() for _ in range(repeat)]
    await host.aclose()
    limit = gbps(size, statistics.median(copies))
    mb = size // MiB
    return [
        Row(
            f"host put {mb} MiB",
            gbps(size, statistics.median(puts)),
            "GB/s",
            "copy into reused buffer",
            limit,
            target=0.8,
        ),
        Row(
            f"host get {mb} MiB",
            gbps(size, statistics.median(gets)),
            "GB/s",
            "copy into reused buffer",
            limit,
            target=0.8,
        ),
    ]


async def _host_rotating_row(size: int, repeat: int, slots: int = 8) -> Row:
    """Distinct keys into a full pool (evicting as it goes), against copies into the same
    number of rotating destinations: writing to cold memory costs both the same."""
    ring = np.ones(slots * size, np.uint8)  # prefaulted, like the host pool
    host = HostTier(slots * size)
    src = _object(size, size)[1]
    lim: list[float] = []
    put: list[float] = []
    for i in range(max(repeat, 2 * slots)):
        j = i % slots
        t0 = time.perf_counter()
        np.copyto(ring[j * size : (j + 1) * size], src)
        _timed(lim, t0)
        key, obj = _object(size, 1000 + i)
        t0 = time.perf_counter()
        handle = await host.put_start(key, size)
        assert handle is not None and handle.buffer is not None, "the host tier refused a bench put"
        handle.buffer[:size] = obj.data
        await host.put_commit(handle, True)
        _timed(put, t0)
    await host.aclose()
    return Row(
        f"host put {size // MiB} MiB, new keys, evicting",
        gbps(size, statistics.median(put)),
        "GB/s",
        f"copy into {slots} rotating buffers",
        gbps(size, statistics.median(lim)),
        target=0.8,
    )


def _plain_write(path: Path, data: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_read(path: Path, out: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(out)
        while view:
            n = f.readinto(view)
            if not n:
                break
            view = view[n:]


async def _ssd_rows(size: int, repeat: int, root: Path) -> list[Row]:
    key, src = _object(size, size + 1)
    dst = np.empty(size, np.uint8)
    ssd = SSDTier(root / "ssd", 4 * size)
    plain = root / "plain.bin"
    wlim: list[float] = []
    wput: list[float] = []
    rlim: list[float] = []
    rget: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _plain_write(plain, src)
        _timed(wlim, t0)
        t0 = time.perf_counter()
        await put_bytes(ssd, key, memoryview(src))
        _timed(wput, t0)
        drop_page_cache(plain)
        t0 = time.perf_counter()
        _plain_read(plain, dst)
        _timed(rlim, t0)
        drop_page_cache(ssd.path_of(key))
        t0 = time.perf_counter()
        n = await ssd.read_into(key, memoryview(dst))
        _timed(rget, t0)
        assert n == size, "SSD tier lost the benchmark object"
        await ssd.delete(key)
        plain.unlink()
    await ssd.aclose()
    mb = size // MiB
    return [
        Row(
            f"ssd write {mb} MiB",
            gbps(size, statistics.median(wput)),
            "GB/s",
            "plain write+fsync",
            gbps(size, statistics.median(wlim)),
            target=0.7,
        ),
        Row(
            f"ssd cold read {mb} MiB",
            gbps(size, statistics.median(rget)),
            "GB/s",
            "plain readinto, cold",
            gbps(size, statistics.median(rlim)),
            target=0.8,
        ),
    ]


async def _ssd_hit_rows(repeat: int, root: Path, size: int = 2 * MiB) -> list[Row]:
    """Milliseconds of a hit on SSD for one chunk through the store core, encrypted at rest
    against MAC-checked only (the limit), cold (dropped from the page cache) and warm."""
    ring = integrity.new_deployment().keyring("bench")
    key, obj = _object(size, 11)
    dst = memoryview(np.empty(size, np.uint8))
    ms: dict[tuple[bool, bool], float] = {}
    for encrypt in (False, True):
        keys = ring.encrypting(encrypt)
        store = await TieredStore.open(
            [("host:", {"capacity": 4 * size}), (f"ssd:{root / f'hit-{encrypt}'}", {"capacity": 4 * size})],
            keys=lambda _k, r=keys: r,
        )
        await store.put(key, memoryview(obj))
        await store.drain()
        ssd = store.lower[0]
        assert isinstance(ssd, SSDTier)  # the store was opened over an ssd: tier
        for cold in (True, False):
            samples: list[float] = []
            for _ in range(repeat):
                store.host.delete_sync(key)
                if cold:
                    drop_page_cache(ssd.path_of(key))
                t0 = time.perf_counter()
                got = await store.read_into(key, dst)
                _timed(samples, t0)
                assert got is not None and got.tier == ssd.name, "the SSD hit missed"
            ms[encrypt, cold] = statistics.median(samples) * 1e3
        assert store.counters.decrypted == (2 * repeat if encrypt else 0)
        await store.aclose()
    mb = size // MiB
    return [
        Row(
            f"ssd hit {mb} MiB encrypted, {'cold' if cold else 'warm'}",
            ms[True, cold],
            "ms",
            "MAC only",
            ms[False, cold],
            "lower",
        )
        for cold in (True, False)
    ]


def _digest_rows(repeat: int, root: Path, size: int = 1 << 30) -> list[Row]:
    """The engine identity's weight digest (``kvstore.weights``: xxh3-128 over 64 MiB
    pieces on a thread pool) of one file, cold and warm, beside a plain ``readinto`` of the
    same file into a reused buffer (cold: dropped from the page cache first)."""
    from kvstore.weights import default_threads, hash_files

    path = root / "weights.safetensors"
    rng = np.random.default_rng(7)
    with open(path, "wb") as f:
        for _ in range(size // (64 * MiB)):
            f.write(rng.integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes())
    threads, buf = default_threads(), np.empty(8 * MiB, np.uint8)
    samples: dict[str, list[float]] = {k: [] for k in ("cold", "cold_lim", "warm", "warm_lim")}
    for _ in range(repeat):
        for kind, fn in (("cold", lambda: hash_files([path], threads)), ("cold_lim", lambda: _stream(path, buf))):
            drop_page_cache(path)
            t0 = time.perf_counter()
            fn()
            _timed(samples[kind], t0)
        for kind, fn in (("warm", lambda: hash_files([path], threads)), ("warm_lim", lambda: _stream(path, buf))):
            t0 = time.perf_counter()
            fn()
            _timed(samples[kind], t0)
    path.unlink()
    rate = {k: gbps(size, statistics.median(v)) for k, v in samples.items()}
    gib = size // (1 << 30)
    return [
        Row(
            f"weight digest {gib} GiB cold, {threads} thr",
            rate["cold"],
            "GB/s",
            "plain readinto, cold",
            rate["cold_lim"],
            target=0.8,
        ),
        Row(
            f"weight digest {gib} GiB warm, {threads} thr",
            rate["warm"],
            "GB/s",
            "plain readinto, warm",
            rate["warm_lim"],
            target=0.8,
        ),
    ]


def _stream(path: Path, buf: np.ndarray) -> None:
    """Read the whole file through one reused buffer (the sequential read limit)."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass


def _integrity_rows(repeat: int, size: int = 32 * MiB) -> list[Row]:
    """MAC seal and check, AES-256-GCM and xxh3-128 of one object, against copying it."""
    _, obj = _object(size, 7)
    dst = np.empty_like(obj)
    ring = integrity.new_deployment().keyring("bench")
    payload = obj[codec.HEADER_SIZE :]

    def median_s(fn) -> float:
        samples: list[float] = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            _timed(samples, t0)
        return statistics.median(samples)

    copy = gbps(size, median_s(lambda: np.copyto(dst, obj)))
    sealed = median_s(lambda: integrity.seal(obj, ring))
    checked = median_s(lambda: integrity.check(obj, ring))
    xxh = median_s(lambda: codec.checksum(payload))
    scratch = bytearray(size + codec.AEAD_OVERHEAD)  # reused, as the write-down does
    enc = median_s(lambda: integrity.encrypt(obj, ring, scratch))
    cipher = np.frombuffer(integrity.encrypt(obj, ring), np.uint8)
    work = np.empty_like(cipher)
    dec_samples: list[float] = []
    for _ in range(repeat):
        np.copyto(work, cipher)  # untimed: decryption is in place
        t0 = time.perf_counter()
        integrity.decrypt_in_place(work, ring)
        _timed(dec_samples, t0)
    dec = statistics.median(dec_samples)
    mb = size // MiB
    return [
        Row(f"MAC seal (keyed BLAKE3) {mb} MiB", gbps(size, sealed), "GB/s", "copy", copy),
        Row(f"MAC check (keyed BLAKE3) {mb} MiB", gbps(size, checked), "GB/s", "copy", copy),
        Row(f"AES-256-GCM encrypt {mb} MiB", gbps(size, enc), "GB/s", "copy", copy),
        Row(f"AES-256-GCM decrypt {mb} MiB", gbps(size, dec), "GB/s", "copy", copy),
        Row(f"xxh3-128 checksum {mb} MiB", gbps(size, xxh), "GB/s", "copy", copy),
    ]


async def _run(args) -> list[Row]:
    rows: list[Row] = _integrity_rows(args.repeat)
    for size in (32 * MiB, 28 * MiB):
        rows += await _host_rows(size, args.repeat)
        rows.append(await _host_rotating_row(size, args.repeat))
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.dir) as tmp:
        for size in (32 * MiB, 28 * MiB):
            rows += await _ssd_rows(size, args.repeat, Path(tmp))
        rows += await _ssd_hit_rows(args.repeat, Path(tmp))
        rows += _digest_rows(args.repeat, Path(tmp))
    rows += await hash_rows(args.repeat)
    return rows


def run(args) -> int:
    if getattr(args, "growth", False):
        return _run_growth(args)
    rows = asyncio.run(_run(args))
    title = f"kvstore bench tiers (median of {args.repeat}; limits measured in this run)"
    print_rows(title, rows)
    write_json(args.json, rows)
    write_plot(getattr(args, "plot", None), title, rows)
    return 0


def _run_growth(args) -> int:
    """``--growth``: only the growth rows (``kvstore.bench.growth``); ``--json`` writes
    ``{"rows": [...], "runs": [...]}`` (each run's counts: objects held, hits, misses)."""
    import json

    from kvstore.bench import growth

    runs = asyncio.run(growth.run_all(args.host_sizes, args.ssd_sizes, args.tenants, args.ops, args.dir))
    rows = growth.rows_of(runs)
    title = f"kvstore bench tiers --growth ({args.ops} operations each; reference: the smallest size, same run)"
    print_rows(title, rows)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": [r.as_dict() for r in rows], "runs": [growth.run_dict(r) for r in runs]}, indent=2)
        )
    write_plot(getattr(args, "plot", None), title, rows)
    return 0
