"""The Redis tier's zero-copy bulk read path (``tiers.redis_bulk``) against real redis-server
processes: byte-exact reads of many shapes through it (its counters prove it was used), a
missing part (LOST), a part of the wrong length (CORRUPT) with the connection drained and
reused, error replies falling back to redis-py, AUTH/ACL, SELECT, TLS and mutual TLS, a server
stopped or killed mid-read (a miss, the breaker opens), cancellation that leaves the caller's
buffer alone, connection reuse, concurrent reads, and a 3-node cluster."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from kvstore import codec
from kvstore.keys import ObjectKey
from tests.kits import chain as kv
from tests.kits.redis_tier import PART, open_redis_tier
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier
from tiers.redis_config import RedisConfig
from tiers.redis_manifest import inline_key, manifest_key, part_keys, unpack

KiB, MiB = 1024, 1 << 20
SENTINEL = 0xA5
NS = kv.namespace("redis-bulk")


def keys_of(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def make_object(key: ObjectKey, size: int) -> np.ndarray:
    return kv.make_object(key, size)


async def store(tier: RedisTier, key: ObjectKey, size: int) -> np.ndarray:
    obj = make_object(key, size)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    return obj


def extra(tier: RedisTier, *names: str) -> tuple[float, ...]:
    s = tier.stats().extra
    return tuple(s[n] for n in names)


def part_names(client, key: ObjectKey) -> list[str]:
    return part_keys("kvstore:", key, unpack(client.get(manifest_key("kvstore:", key))))


async def until_landed(task: asyncio.Task, out: np.ndarray, at: slice) -> None:
    """Let ``task`` run until bytes have landed in ``out[at]`` (it still running)."""
    for _ in range(200_000):
        if (out[at] != SENTINEL).any():
            return
        assert not task.done(), "the read ended before its first part arrived"
        await asyncio.sleep(0)
    raise AssertionError("no bytes arrived")


# --- byte-exact reads through the bulk path ---------------------------------------------------

SIZES = [codec.HEADER_SIZE + 1, 4 * KiB, PART - 1, PART, PART + 1, 5 * PART, 7 * PART + 333, 40 * PART]


async def test_objects_of_every_shape_read_back_byte_equal_over_one_connection(redis_server):
    tier = await open_redis_tier(redis_server.url)
    keys = keys_of(len(SIZES), 1)
    objs = [await store(tier, key, size) for key, size in zip(keys, SIZES)]
    for _ in range(2):
        for key, obj in zip(keys, objs):
            out = np.full(len(obj) + 100, SENTINEL, np.uint8)  # larger than the object
            assert await tier.read_into(key, memoryview(out)) == len(obj)
            assert np.array_equal(out[: len(obj)], obj) and (out[len(obj) :] == SENTINEL).all()
    parts = sum(-(-size // PART) for size in SIZES)
    n = len(SIZES)
    assert extra(tier, "bulk_reads", "bulk_parts", "bulk_bytes") == (2 * n, 2 * parts, 2 * sum(SIZES))
    assert extra(tier, "bulk_connects", "bulk_fallbacks", "bulk_dropped") == (1, 0, 0)
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt, s.bytes_read) == (2 * n, 0, 0, 2 * sum(SIZES))
    await tier.aclose()


async def test_default_1mib_parts_of_a_32mib_object(redis_server):
    tier = await RedisTier.open(RedisConfig.from_url(redis_server.url))
    key = keys_of(1, 2)[0]
    obj = await store(tier, key, 32 * MiB + 17)  # 33 parts, the last one 17 bytes
    out = np.full(len(obj), SENTINEL, np.uint8)
    for _ in range(3):
        assert await tier.read_into(key, memoryview(out)) == len(obj)
        assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_parts", "bulk_connects") == (3, 3 * 33, 1)
    await tier.aclose()


async def test_connection_is_reused_across_many_reads(redis_server):
    tier = await open_redis_tier(redis_server.url)
    keys = keys_of(10, 3)
    objs = [await store(tier, key, (i + 1) * PART // 2 + 300) for i, key in enumerate(keys)]
    out = np.empty(6 * PART, np.uint8)
    assert await tier.read_into(keys[0], memoryview(out)) == len(objs[0])  # opens the connection
    before = int(redis_server.info("stats")["total_connections_received"])
    for i in range(60):
        obj = objs[i % len(objs)]
        assert await tier.read_into(keys[i % len(keys)], memoryview(out)) == len(obj)
        assert np.array_equal(out[: len(obj)], obj)
    # The observer's INFO is the only new connection: neither path reconnected.
    assert int(redis_server.info("stats")["total_connections_received"]) - before == 1
    # Every read's first round trip (manifest + inline value) and, for an object of parts,
    # one more for the parts: all on the one bulk connection.
    of_parts = sum(len(objs[i % len(objs)]) > PART for i in range(60))
    assert extra(tier, "bulk_reads", "bulk_round_trips", "bulk_connects") == (61, 61 + of_parts, 1)
    await tier.aclose()


async def test_concurrent_reads_share_a_small_pool(redis_server):
    tier = await open_redis_tier(redis_server.url, max_inflight_parts=3)
    keys = keys_of(12, 4)
    objs = [await store(tier, key, 3 * PART + i) for i, key in enumerate(keys)]
    outs = [np.full(len(obj), SENTINEL, np.uint8) for obj in objs]
    for _ in range(3):
        sizes = await asyncio.gather(*(tier.read_into(k, memoryview(o)) for k, o in zip(keys, outs)))
        assert sizes == [len(obj) for obj in objs]
        assert all(np.array_equal(o, obj) for o, obj in zip(outs, objs))
    assert extra(tier, "bulk_reads", "bulk_fallbacks") == (36, 0)
    assert 1 <= extra(tier, "bulk_connects")[0] <= 3  # at most max_inflight_parts per server
    await tier.aclose()


# --- lost and corrupt parts -------------------------------------------------------------------


async def test_missing_part_is_lost_cleaned_up_and_the_connection_drained(redis_server):
    tier = await open_redis_tier(redis_server.url)
    lost, good = keys_of(2, 5)
    await store(tier, lost, 6 * PART + 1)
    obj = await store(tier, good, 3 * PART)
    with redis_server.client() as c:
        assert c.delete(part_names(c, lost)[2]) == 1
    out = np.empty(7 * PART, np.uint8)
    assert await tier.read_into(lost, memoryview(out)) is None
    s = tier.stats()
    assert (s.misses, s.corrupt, s.extra["lost"], s.extra["breaker_opened"]) == (1, 0, 1, 0)
    with redis_server.client() as c:
        assert c.dbsize() == 1 + 3  # the lost object's manifest and parts are gone
    assert await tier.read_into(good, memoryview(out)) == len(obj)  # same connection, in step
    assert np.array_equal(out[: len(obj)], obj)
    assert extra(tier, "bulk_reads", "bulk_connects", "bulk_dropped", "bulk_fallbacks") == (1, 1, 0, 0)
    await tier.aclose()


@pytest.mark.parametrize("delta", [-1, +1, PART])
async def test_part_of_wrong_length_is_corrupt_and_never_lands(redis_server, delta):
    tier = await open_redis_tier(redis_server.url)
    bad, good = keys_of(2, 6)
    await store(tier, bad, 4 * PART)
    obj = await store(tier, good, 2 * PART + 9)
    with redis_server.client() as c:
        c.set(part_names(c, bad)[1], b"\x11" * (PART + delta))
    out = np.full(4 * PART, SENTINEL, np.uint8)
    assert await tier.read_into(bad, memoryview(out)) is None
    assert (out[PART : 2 * PART] == SENTINEL).all()  # drained into the sink, not the buffer
    s = tier.stats()
    assert (s.misses, s.corrupt, s.extra["lost"], s.extra["breaker_opened"]) == (1, 1, 0, 0)
    with redis_server.client() as c:
        assert c.dbsize() == 1 + 3  # cleaned up: only the good object is left
    assert await tier.read_into(good, memoryview(out)) == len(obj)
    assert np.array_equal(out[: len(obj)], obj)
    assert extra(tier, "bulk_connects", "bulk_dropped") == (1, 0)  # drained, not dropped
    await tier.aclose()


async def test_damaged_bytes_of_the_right_length_fail_verification(redis_server):
    tier = await open_redis_tier(redis_server.url)
    key = keys_of(1, 7)[0]
    obj = await store(tier, key, 3 * PART)
    with redis_server.client() as c:
        c.setrange(part_names(c, key)[2], 100, bytes([obj[2 * PART + 100] ^ 0xFF]))
    assert await tier.read_into(key, memoryview(np.empty(3 * PART, np.uint8))) is None
    assert (tier.stats().corrupt, extra(tier, "bulk_reads")[0]) == (1, 1)  # arrived whole, then refused
    assert not await tier.contains(key)
    await tier.aclose()


# --- error replies fall back to redis-py ------------------------------------------------------


async def test_refused_auth_on_the_bulk_connection_falls_back_to_redis_py(redis_factory):
    server = redis_factory(password="old-pass")
    tier = await open_redis_tier(server.url_with_auth, max_inflight_parts=1)  # one pooled connection
    key = keys_of(1, 8)[0]
    obj = await store(tier, key, 3 * PART + 5)
    with server.client() as c:  # pooled connections stay authenticated; new ones are refused
        c.config_set("requirepass", "new-pass")
    out = np.empty(len(obj), np.uint8)
    assert await tier.read_into(key, memoryview(out)) == len(obj)
    assert np.array_equal(out, obj)
    assert extra(tier, "bulk_fallbacks", "bulk_reads", "breaker_opened") == (1, 0, 0)
    await tier.aclose()


async def test_error_reply_falls_back_and_is_a_plain_miss(redis_server):
    tier = await open_redis_tier(redis_server.url)
    key = keys_of(1, 9)[0]
    await store(tier, key, 2 * PART)
    with redis_server.client() as c:
        name = part_names(c, key)[1]
        c.delete(name)
        c.rpush(name, b"not a string")  # GET answers -WRONGTYPE
    assert await tier.read_into(key, memoryview(np.empty(2 * PART, np.uint8))) is None
    s = tier.stats()
    assert (s.misses, s.corrupt, s.extra["lost"], s.extra["breaker_opened"]) == (1, 0, 0, 0)
    assert extra(tier, "bulk_fallbacks", "bulk_dropped") == (1, 0)
    assert await tier.contains(key)  # an error reply is not proof the object is dead
    await tier.aclose()


# --- AUTH / ACL, SELECT, TLS ------------------------------------------------------------------


@pytest.mark.parametrize("username", [None, "kv-user"])
async def test_password_and_acl_user_and_database(redis_factory, username):
    server = redis_factory(password="s3cret:/@", username=username)
    url = server.url_with_auth.rsplit("/", 1)[0] + "/3"
    tier = await open_redis_tier(url)
    key = keys_of(1, 10)[0]
    obj = await store(tier, key, 5 * PART + 3)
    with server.client(db=3) as c:
        assert c.dbsize() == 1 + 6  # SELECT 3 on the bulk connection reads these, not db 0
    out = np.empty(len(obj), np.uint8)
    assert await tier.read_into(key, memoryview(out)) == len(obj)
    assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_fallbacks") == (1, 0)
    await tier.aclose()


@pytest.mark.parametrize("mutual", [False, True])
async def test_tls_and_mutual_tls(redis_factory, tls_files, mutual):
    server = redis_factory(tls=tls_files, tls_auth_clients=mutual)
    opts = {"tls_ca": str(tls_files.ca_cert)}
    if mutual:
        opts.update(tls_cert=str(tls_files.client_cert), tls_key=str(tls_files.client_key))
    tier = await open_redis_tier(server.url, **opts)
    key = keys_of(1, 11)[0]
    obj = await store(tier, key, 30 * PART + 77)
    out = np.empty(len(obj), np.uint8)
    for _ in range(2):
        assert await tier.read_into(key, memoryview(out)) == len(obj)
        assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_connects", "bulk_fallbacks") == (2, 1, 0)
    await tier.aclose()


# --- failures mid-read --------------------------------------------------------------------------


async def test_server_killed_mid_read_is_a_miss_and_opens_the_breaker(redis_factory):
    server = redis_factory()
    tier = await RedisTier.open(RedisConfig.from_url(server.url, retry_s=0.2, op_timeout_s=2.0))
    key = keys_of(1, 12)[0]
    obj = await store(tier, key, 24 * MiB)
    out = np.full(len(obj), SENTINEL, np.uint8)
    task = asyncio.create_task(tier.read_into(key, memoryview(out)))
    await until_landed(task, out, slice(0, 4096))
    os.kill(server.pid, signal.SIGSTOP)  # frozen mid-object, then killed
    assert (out[-MiB:] == SENTINEL).all()
    await asyncio.to_thread(server.kill)
    assert await task is None  # no exception: a miss
    s = tier.stats()
    assert (s.misses, s.hits, s.corrupt, s.extra["lost"]) == (1, 0, 0, 0)
    assert (s.extra["breaker_opened"], s.extra["breaker_open"], s.extra["bulk_dropped"]) == (1, 1.0, 1)
    await tier.aclose()


async def test_stalled_server_times_out_and_writes_nothing_after(redis_factory):
    server = redis_factory()
    tier = await RedisTier.open(RedisConfig.from_url(server.url, retry_s=5.0, op_timeout_s=0.3))
    key = keys_of(1, 13)[0]
    obj = await store(tier, key, 24 * MiB)
    out = np.full(len(obj), SENTINEL, np.uint8)
    task = asyncio.create_task(tier.read_into(key, memoryview(out)))
    await until_landed(task, out, slice(0, 4096))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await asyncio.wait_for(task, 60) is None  # (the wait_for only turns a hang into a failure)
        assert loop.time() - t0 >= 0.25  # it gave up after op_timeout_s without progress
        snapshot = out.copy()
        assert (snapshot[-MiB:] == SENTINEL).all()
        s = tier.stats()
        assert (s.misses, s.extra["breaker_opened"], s.extra["bulk_dropped"]) == (1, 1, 1)
    finally:
        os.kill(server.pid, signal.SIGCONT)  # its queued replies now flow, to nobody
    await asyncio.sleep(0.2)
    assert np.array_equal(out, snapshot)
    await tier.aclose()


async def test_cancelled_read_leaves_the_buffer_alone_after_it_returns(redis_server):
    tier = await RedisTier.open(RedisConfig.from_url(redis_server.url))
    key = keys_of(1, 14)[0]
    obj = await store(tier, key, 24 * MiB)
    out = np.full(len(obj), SENTINEL, np.uint8)
    # Cancelled before any byte, then cancelled mid-object.
    task = asyncio.create_task(tier.read_into(key, memoryview(out)))
    await asyncio.sleep(0)
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert (out == SENTINEL).all()
    task = asyncio.create_task(tier.read_into(key, memoryview(out)))
    await until_landed(task, out, slice(0, 4096))
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snapshot = out.copy()
    assert (snapshot[-MiB:] == SENTINEL).all()  # it was cancelled mid-object
    await asyncio.sleep(0.2)  # the rest of the object would have arrived by now
    assert np.array_equal(out, snapshot)
    assert extra(tier, "bulk_dropped", "breaker_opened") == (1, 0)
    assert await tier.read_into(key, memoryview(out)) == len(obj)  # a fresh connection works
    assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_connects") == (1, 2)
    await tier.aclose()


async def test_server_restarted_between_reads_costs_nothing(redis_factory):
    server = redis_factory(appendonly=True)
    tier = await open_redis_tier(server.url)
    key = keys_of(1, 15)[0]
    obj = await store(tier, key, 4 * PART)
    out = np.empty(len(obj), np.uint8)
    assert await tier.read_into(key, memoryview(out)) == len(obj)
    await asyncio.to_thread(server.restart)  # the idle bulk connection is now dead
    assert await tier.read_into(key, memoryview(out)) == len(obj)  # retried once, fresh
    assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_connects", "breaker_opened") == (2, 2, 0)
    await tier.aclose()


# --- cluster ------------------------------------------------------------------------------------


async def test_cluster_reads_each_nodes_parts_over_its_own_connection(redis_cluster):
    tier = await open_redis_tier(redis_cluster.url, part_size="16KiB")
    keys = keys_of(6, 16)
    objs = [await store(tier, key, 20 * 16 * KiB + i) for i, key in enumerate(keys)]  # 21 parts
    for key, obj in zip(keys, objs):
        out = np.full(len(obj), SENTINEL, np.uint8)
        assert await tier.read_into(key, memoryview(out)) == len(obj)
        assert np.array_equal(out, obj)
    assert extra(tier, "bulk_reads", "bulk_fallbacks") == (6, 0)
    assert extra(tier, "bulk_connects") == (3,)  # one per node, reused
    # The first round trip asks the nodes of the manifest and of the inline value (one or
    # two), then every object's parts span all three nodes.
    first = sum(len({tier._node(manifest_key("kvstore:", k)), tier._node(inline_key("kvstore:", k))}) for k in keys)
    assert extra(tier, "bulk_round_trips")[0] == first + 6 * 3
    for key in keys:
        await tier.delete(key)
    await tier.aclose()
