"""``kvstore bench redis``: the Redis tier against limits measured in the same run.

For 1 MiB, 4 MiB and 32 MiB objects (valid codec objects): the tier's put and get (into a
reused buffer) beside plain redis-py ``SET``/``GET`` of the same bytes (sync client, hiredis)
and beside a loopback TCP transfer of the same size (``kvstore.bench.loopback``, the limit
for a Python client).  Targets: a 32 MiB get and put at least 2× plain redis-py and half of
TCP; an object of one part (1 MiB, the default ``part_size``) got at least as fast as plain
redis-py, in one round trip (counted by the tier: its own row).  Then a batch lookup of 512 chunk keys: its
round trips (the tier's count and the server's ``total_commands_processed``) and its latency beside one plain
redis-py ``GET`` round trip.  Without ``--redis`` a redis-server is started on a free port
in a temporary directory (``kvstore.testing.redis_proc``) and stopped at the end.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.cluster

from kvstore import codec
from kvstore.bench.common import Row, gbps, print_rows, write_json, write_plot
from kvstore.bench.loopback import measure_loopback
from kvstore.keys import Identity, ObjectKey, chunk_hashes, object_keys
from tiers.redis import RedisTier
from tiers.redis_config import RedisConfig

MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB, 32 * MiB)
LOOKUP_KEYS = 512
IDENT = Identity("bench-redis", "r0", "bf16", "bench:opaque", 1, 1, 1)
_PLAIN_KEY = "kvstore-bench:plain"


def _keys(n: int, seed: int) -> list[ObjectKey]:
    ns = IDENT.namespace()
    return object_keys(ns, chunk_hashes(ns, np.arange(n * 16) + (seed % 4099) * 100_000, 16))


def _object(size: int, key: ObjectKey) -> np.ndarray:
    geom = codec.ObjectGeometry(1, 1, size - codec.HEADER_SIZE, "bf16", "bench:opaque")
    buf = np.empty(size, np.uint8)
    payload = np.random.default_rng(size).integers(0, 256, geom.payload_bytes, dtype=np.uint8)
    codec.encode_into(buf, key, geom, payload)
    return buf


def _plain_client(cfg: RedisConfig) -> Any:
    """The naive peer: redis-py's sync client (hiredis parser) with the same credentials."""
    kw: dict[str, Any] = dict(username=cfg.username, password=cfg.password, socket_timeout=30.0)
    if cfg.tls:
        kw.update(ssl=True, ssl_ca_certs=cfg.tls_ca, ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key)
    if cfg.cluster:
        return redis.cluster.RedisCluster(host=cfg.host, port=cfg.port, **kw)
    return redis.Redis(host=cfg.host, port=cfg.port, db=cfg.db, **kw)


def _plain_times(plain: Any, obj: np.ndarray, repeat: int) -> tuple[float, float]:
    sets, gets = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plain.set(_PLAIN_KEY, memoryview(obj))
        sets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = plain.get(_PLAIN_KEY)
        gets.append(time.perf_counter() - t0)
        assert got is not None and len(got) == len(obj), "plain GET lost the benchmark value"
    plain.delete(_PLAIN_KEY)
    return statistics.median(sets), statistics.median(gets)


async def _tier_times(tier: RedisTier, key: ObjectKey, obj: np.ndarray, repeat: int) -> tuple[float, float, int]:
    """Fresh puts (the key is deleted, untimed, before each) and gets into one reused buffer:
    median seconds of each, and the most round trips one get took."""
    out = np.empty_like(obj)
    view, src = memoryview(out), memoryview(obj)
    puts, gets, trips = [], [], []
    for _ in range(repeat):
        await tier.delete(key)
        t0 = time.perf_counter()
        handle = await tier.put_start(key, len(obj))
        assert handle is not None, "the redis tier refused a put"
        await tier.put_write(handle, 0, src)
        ok = await tier.put_commit(handle, True)
        puts.append(time.perf_counter() - t0)
        assert ok, f"the redis tier failed a put: {tier.stats()}"
        before = tier.stats().extra["round_trips"]
        t0 = time.perf_counter()
        n = await tier.read_into(key, view)
        gets.append(time.perf_counter() - t0)
        trips.append(int(tier.stats().extra["round_trips"] - before))
        assert n == len(obj), "the redis tier lost the benchmark object"
    assert np.array_equal(out, obj), "the redis tier returned different bytes"
    await tier.delete(key)
    return statistics.median(puts), statistics.median(gets), max(trips)


async def _size_rows(tier: RedisTier, plain: Any, size: int, repeat: int) -> list[Row]:
    key = _keys(1, size)[0]
    obj = _object(size, key)
    p_set, p_get = _plain_times(plain, obj, repeat)
    t_put, t_get, trips = await _tier_times(tier, key, obj, repeat)
    tcp = measure_loopback(size, repeat)
    mb, big, small = size // MiB, size >= 32 * MiB, size <= tier.cfg.part_size
    put, get = gbps(size, t_put), gbps(size, t_get)
    get_target = 2.0 if big else 1.0 if small else None
    rows = [
        Row(
            f"redis tier put {mb} MiB",
            put,
            "GB/s",
            "plain redis-py SET",
            gbps(size, p_set),
            target=2.0 if big else None,
        ),
        Row(f"redis tier get {mb} MiB", get, "GB/s", "plain redis-py GET", gbps(size, p_get), target=get_target),
        Row(
            f"redis tier put {mb} MiB vs TCP",
            put,
            "GB/s",
            "loopback TCP put",
            tcp.put_gbps,
            target=0.5 if big else None,
        ),
        Row(
            f"redis tier get {mb} MiB vs TCP",
            get,
            "GB/s",
            "loopback TCP get",
            tcp.get_gbps,
            target=0.5 if big else None,
        ),
    ]
    if small:  # an object of one part: manifest and bytes in one round trip
        rows.append(
            Row(f"redis tier get {mb} MiB: round trips", trips, "count", "one round trip", 1.0, "lower", target=1.0)
        )
    return rows


def _server_commands(plain: Any) -> tuple[int, int]:
    """Commands processed by all servers (primaries of a cluster), and how many answered."""
    if isinstance(plain, redis.cluster.RedisCluster):
        info = plain.info("stats", target_nodes=redis.cluster.RedisCluster.PRIMARIES)
        return sum(int(v["total_commands_processed"]) for v in info.values()), len(info)
    return int(plain.info("stats")["total_commands_processed"]), 1


async def _lookup_rows(tier: RedisTier, plain: Any, repeat: int) -> list[Row]:
    keys = _keys(LOOKUP_KEYS, 7)
    geom = codec.ObjectGeometry(1, 1, 64, "bf16", "bench:opaque")
    small = np.empty(codec.object_size(geom), np.uint8)
    for key in keys:
        codec.encode_into(small, key, geom, np.zeros(64, np.uint8))
        handle = await tier.put_start(key, len(small))
        assert handle is not None
        await tier.put_write(handle, 0, memoryview(small))
        assert await tier.put_commit(handle, True)
    plain.set(_PLAIN_KEY, b"x" * 64)
    rtt, lat, trips, cmds = [], [], [], []
    for _ in range(max(repeat, 5)):
        t0 = time.perf_counter()
        plain.get(_PLAIN_KEY)
        rtt.append(time.perf_counter() - t0)
        before, (server_before, _) = tier.stats().extra["round_trips"], _server_commands(plain)
        t0 = time.perf_counter()
        hits = await tier.lookup(keys)
        lat.append(time.perf_counter() - t0)
        trips.append(tier.stats().extra["round_trips"] - before)
        server_after, infos = _server_commands(plain)
        cmds.append(server_after - server_before - infos)  # minus the first INFOs themselves
        assert hits == LOOKUP_KEYS, f"lookup found {hits} of {LOOKUP_KEYS}"
    plain.delete(_PLAIN_KEY)
    for key in keys:
        await tier.delete(key)
    return [
        Row(f"lookup {LOOKUP_KEYS} keys: round trips", max(trips), "count", "target", 2.0, "lower", target=1.0),
        Row(f"lookup {LOOKUP_KEYS} keys: server commands", max(cmds), "count", "target", 2.0, "lower", target=1.0),
        Row(
            f"lookup {LOOKUP_KEYS} keys: latency",
            statistics.median(lat) * 1e6,
            "µs",
            "plain redis-py GET round trip",
            statistics.median(rtt) * 1e6,
            "lower",
        ),
    ]


async def _run(url: str, repeat: int) -> list[Row]:
    cfg = RedisConfig.from_url(url)
    plain = _plain_client(cfg)
    tier = await RedisTier.open(cfg)
    try:
        rows: list[Row] = []
        for size in SIZES:
            rows += await _size_rows(tier, plain, size, repeat)
        rows += await _lookup_rows(tier, plain, repeat)
        return rows
    finally:
        await tier.aclose()
        plain.close()


def run(args) -> int:
    if args.redis:
        rows = asyncio.run(_run(args.redis, args.repeat))
        where = RedisConfig.from_url(args.redis).redacted_url
    else:
        from kvstore.testing.redis_proc import RedisServer

        with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as tmp:
            with RedisServer(Path(tmp)).start() as server:
                rows = asyncio.run(_run(server.url, args.repeat))
                where = f"{server.url} (started by the benchmark)"
    title = f"kvstore bench redis on {where} (median of {args.repeat}; limits measured in this run)"
    print_rows(title, rows)
    write_json(args.json, rows)
    write_plot(getattr(args, "plot", None), title, rows)
    return 0
