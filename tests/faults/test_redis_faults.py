"""The Redis tier under faults, against real redis-server processes: kill -9 mid-get and
mid-put, the circuit breaker while Redis is down and after it is back, maxmemory with
noeviction and allkeys-lru, values corrupted by hand, wrong credentials, TLS, and an
unreachable port.  A fault is a miss or a failed put, counted; never an exception out of a
read or lookup, never wrong or partial bytes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from kvstore.errors import ConfigError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.testing.redis_proc import free_port
from tests.kits import chain as kv
from tests.kits.redis_tier import PART, open_redis_tier
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier

NS = kv.namespace("redis-faults")


def keys_of(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def make_object(key: ObjectKey, size: int) -> np.ndarray:
    return kv.make_object(key, size)


async def read_back(tier: RedisTier, key: ObjectKey, size: int) -> np.ndarray | None:
    out = np.empty(size, np.uint8)
    n = await tier.read_into(key, memoryview(out))
    return None if n is None else out[:n]


async def wait_for(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


# --- kill -9 -------------------------------------------------------------------------------


async def test_kill_mid_get_is_a_miss_and_opens_the_breaker(redis_factory):
    server = redis_factory()
    tier = await open_redis_tier(server.url, part_size="16KiB", max_inflight_parts=2)
    key = keys_of(1, 1)[0]
    size = 32 << 20  # 2048 parts: the read is still running when the server dies
    assert await put_bytes(tier, key, memoryview(make_object(key, size))) is PutResult.STORED
    out = np.full(size, 0xA5, np.uint8)
    task = asyncio.create_task(tier.read_into(key, memoryview(out)))
    for _ in range(200_000):  # run until the first part has landed, the read still going
        if (out[:4096] != 0xA5).any():
            break
        assert not task.done(), "the read ended before its first part arrived"
        await asyncio.sleep(0)
    os.kill(server.pid, signal.SIGSTOP)  # frozen mid-object, then killed
    assert not task.done()
    await asyncio.to_thread(server.kill)
    assert await task is None  # no exception: a miss
    s = tier.stats()
    assert (s.misses, s.hits, s.extra["breaker_opened"], s.extra["breaker_open"]) == (1, 0, 1, 1.0)
    assert s.extra["lost"] == 0 and s.corrupt == 0  # unreachable is not "lost"
    await tier.aclose()


async def test_kill_mid_put_never_leaves_a_partial_object(redis_factory):
    server = redis_factory(appendonly=True)
    tier = await open_redis_tier(server.url)
    keys = keys_of(400, 2)
    size = 6 * PART + 11
    acked: list[ObjectKey] = []

    async def writer() -> None:
        for key in keys:
            result = await put_bytes(tier, key, memoryview(make_object(key, size)))
            if result is PutResult.STORED:
                acked.append(key)

    task = asyncio.create_task(writer())
    await wait_for(lambda: len(acked) >= 5, 10.0)
    await asyncio.to_thread(server.kill)  # most likely in the middle of some put's parts
    await asyncio.wait_for(task, 20.0)  # the writer finishes (failing fast), no exception
    assert tier.stats().put_failures >= 1
    await tier.aclose()
    await asyncio.to_thread(server.restart)  # same port, data reloaded from the AOF
    reader = await open_redis_tier(server.url)
    with server.client() as c:
        manifests = {k.decode() for k in c.keys("kvstore:m:*")}
    visible = [k for k in keys if f"kvstore:m:{k.printable()}" in manifests]
    assert set(acked) <= set(visible)  # every acknowledged put survived the crash
    assert len(visible) <= len(acked) + 1  # at most the put whose reply the kill cut off
    for key in visible:  # any visible manifest reads back whole and verified
        got = await read_back(reader, key, size)
        assert got is not None and np.array_equal(got, make_object(key, size))
    for key in keys[len(visible) + 1 :]:
        assert await read_back(reader, key, size) is None
    s = reader.stats()
    assert (s.corrupt, s.extra["lost"]) == (0, 0)
    await reader.aclose()


async def test_breaker_answers_misses_without_the_network_while_down_and_closes_when_back(redis_factory):
    server = redis_factory(appendonly=True)
    tier = await open_redis_tier(server.url, retry_s=0.1)
    keys = keys_of(8, 3)
    for key in keys:
        assert await put_bytes(tier, key, memoryview(make_object(key, 2 * PART))) is PutResult.STORED
    assert await tier.lookup(keys) == 8
    await asyncio.to_thread(server.kill)
    found = [await tier.lookup(keys) for _ in range(200)]
    assert found == [0] * 200
    trips = tier.stats().extra["round_trips"]
    assert await read_back(tier, keys[0], 2 * PART) is None
    assert not await tier.contains(keys[0]) and await tier.present(keys) == [False] * 8
    assert tier.stats().extra["round_trips"] == trips  # answered without touching the network
    assert (
        await put_bytes(tier, keys_of(1, 99)[0], memoryview(make_object(keys_of(1, 99)[0], 300))) is PutResult.NO_ROOM
    )  # put_start refuses while the breaker is open
    s = tier.stats()
    assert (s.extra["breaker_opened"], s.extra["breaker_open"]) == (1, 1.0)
    assert s.extra["breaker_rejected"] >= 200
    await asyncio.to_thread(server.restart)
    await wait_for(lambda: tier.stats().extra["breaker_open"] == 0, 30.0)  # a retry (every 0.1 s) closed it
    assert tier.stats().extra["breaker_opened"] == 1
    assert await tier.lookup(keys) == 8
    got = await read_back(tier, keys[0], 2 * PART)
    assert got is not None and np.array_equal(got, make_object(keys[0], 2 * PART))
    s = tier.stats()
    assert (s.extra["breaker_opened"], s.extra["breaker_closed"]) == (1, 1)
    await tier.aclose()


# --- maxmemory -----------------------------------------------------------------------------


async def test_noeviction_full_puts_fail_cleanly_and_earlier_objects_stay(redis_factory):
    server = redis_factory(maxmemory="6mb", maxmemory_policy="noeviction")
    tier = await open_redis_tier(server.url)
    keys = keys_of(40, 4)
    size = 4 * PART + 1
    results = [await put_bytes(tier, key, memoryview(make_object(key, size))) for key in keys]
    stored = [k for k, r in zip(keys, results) if r is PutResult.STORED]
    failed = [k for k, r in zip(keys, results) if r is PutResult.FAILED]
    assert len(stored) >= 3 and len(failed) >= 10 and len(stored) + len(failed) == 40
    s = tier.stats()
    assert (s.puts, s.put_failures, s.extra["breaker_opened"]) == (len(stored), len(failed), 0)
    for key in stored:
        got = await read_back(tier, key, size)
        assert got is not None and np.array_equal(got, make_object(key, size))
    for key in failed:
        assert not await tier.contains(key)
    with server.client() as c:
        assert c.dbsize() == len(stored) * (1 + 5)  # failed puts left no parts behind
    await tier.aclose()


async def test_allkeys_lru_evicted_parts_are_detected_counted_and_cleaned(redis_factory):
    server = redis_factory(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    tier = await open_redis_tier(server.url)
    size = 4 * PART + 3
    old, new = keys_of(6, 5), keys_of(30, 6)
    for key in old:
        assert await put_bytes(tier, key, memoryview(make_object(key, size))) is PutResult.STORED
    for key in new:  # keep the old manifests hot so eviction takes their (cold) parts
        await tier.present(old)
        await put_bytes(tier, key, memoryview(make_object(key, size)))
    hits = misses = 0
    for key in old + new:
        got = await read_back(tier, key, size)
        if got is None:
            misses += 1
        else:
            hits += 1
            assert np.array_equal(got, make_object(key, size))  # never wrong bytes
    s = tier.stats()
    assert hits + misses == len(old + new) and misses >= 1
    assert s.extra["lost"] >= 1 and s.corrupt == 0 and s.misses == misses
    with server.client() as c:  # a lost object's manifest is gone, and nothing is half there
        for key in old + new:
            assert c.exists(f"kvstore:m:{key.printable()}") == int(await tier.contains(key))
    for key in old + new:
        if await tier.contains(key):
            got = await read_back(tier, key, size)
            assert got is not None and np.array_equal(got, make_object(key, size))
    await tier.aclose()


# --- damage by hand ------------------------------------------------------------------------


async def test_part_corrupted_by_hand_is_a_counted_miss_and_deleted(redis_server):
    tier = await open_redis_tier(redis_server.url)
    k1, k2 = keys_of(2, 7)
    size = 3 * PART + 100
    for key in (k1, k2):
        assert await put_bytes(tier, key, memoryview(make_object(key, size))) is PutResult.STORED
    with redis_server.client() as c:
        part1 = next(k for k in c.keys(f"kvstore:p:{k1.printable()}:*") if k.endswith(b":1"))
        c.setrange(part1, 1000, b"\xff\x00\xff")
        part0 = next(k for k in c.keys(f"kvstore:p:{k2.printable()}:*") if k.endswith(b":0"))
        c.append(part0, b"extra")  # a part of the wrong length
        assert await read_back(tier, k1, size) is None
        assert await read_back(tier, k2, size) is None
        assert c.dbsize() == 0  # manifests and every part removed
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits, s.extra["lost"]) == (2, 2, 0, 0)
    await tier.aclose()


async def test_corrupt_manifest_is_a_miss_and_deleted(redis_server):
    tier = await open_redis_tier(redis_server.url)
    key = keys_of(1, 8)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, 2 * PART))) is PutResult.STORED
    mkey = f"kvstore:m:{key.printable()}"
    with redis_server.client() as c:
        c.setrange(mkey, 12, b"\x7f")
        assert await tier.contains(key) is False  # a damaged manifest is not "present"
        assert await read_back(tier, key, 2 * PART) is None
        assert c.exists(mkey) == 0
        c.set(mkey, b"not a manifest")
        assert await tier.size_of(key) is None and c.exists(mkey) == 0
    assert tier.stats().corrupt == 2
    await tier.aclose()


@pytest.mark.parametrize("size", [PART, PART + 1])  # one inline value; two parts
async def test_object_verifying_under_another_key_is_corrupt(redis_server, size):
    """Data copied under another key's manifest: intact bytes, wrong key -> a miss."""
    tier = await open_redis_tier(redis_server.url)
    k1, k2 = keys_of(2, 9)
    assert await put_bytes(tier, k1, memoryview(make_object(k1, size))) is PutResult.STORED
    with redis_server.client() as c:
        manifest = c.get(f"kvstore:m:{k1.printable()}")
        for name in c.keys(f"kvstore:[ip]:{k1.printable()}*"):
            c.set(name.replace(k1.printable().encode(), k2.printable().encode()), c.get(name))
        c.set(f"kvstore:m:{k2.printable()}", manifest)
    assert await read_back(tier, k2, size) is None
    assert tier.stats().corrupt == 1
    got = await read_back(tier, k1, size)
    assert got is not None and np.array_equal(got, make_object(k1, size))
    with redis_server.client() as c:  # k2's copies were cleaned up, k1's stay
        assert all(k1.printable().encode() in name for name in c.keys("*"))
    await tier.aclose()


# --- opening: credentials, TLS, unreachable -----------------------------------------------


async def test_wrong_password_is_a_config_error_naming_user_not_password(redis_factory):
    server = redis_factory(password="right-pass")
    with pytest.raises(ConfigError) as err:
        await open_redis_tier(f"redis://:wrong-pass@127.0.0.1:{server.port}/0")
    text = str(err.value)
    assert "refused user 'default'" in text and "wrong-pass" not in text and "right-pass" not in text
    with pytest.raises(ConfigError, match="refused user 'default'"):
        await open_redis_tier(server.url)  # no password at all
    tier = await open_redis_tier(server.url_with_auth)
    assert await tier.lookup(keys_of(1, 10)) == 0
    await tier.aclose()


async def test_wrong_acl_user_is_a_config_error(redis_factory):
    server = redis_factory(username="kv", password="pw-ok")
    with pytest.raises(ConfigError) as err:
        await open_redis_tier(f"redis://intruder:pw-ok@127.0.0.1:{server.port}")
    assert "refused user 'intruder'" in str(err.value) and "pw-ok" not in str(err.value)
    tier = await open_redis_tier(server.url, username="kv", password="pw-ok")
    key = keys_of(1, 11)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, 300))) is PutResult.STORED
    await tier.aclose()


async def test_tls_with_self_signed_ca_works_and_plain_client_fails_clearly(redis_factory, tls_files, tmp_path):
    server = redis_factory(tls=tls_files)
    assert server.url.startswith("rediss://")
    tier = await open_redis_tier(server.url, tls_ca=str(tls_files.ca_cert))
    key = keys_of(1, 12)[0]
    obj = make_object(key, 3 * PART + 1)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    got = await read_back(tier, key, len(obj))
    assert got is not None and np.array_equal(got, obj)
    await tier.aclose()
    with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{server.port}.*use rediss://"):
        await open_redis_tier(f"redis://127.0.0.1:{server.port}")  # told what is wrong, not a timeout
    with pytest.raises(ConfigError, match="tls_ca file .* does not exist"):
        await open_redis_tier(server.url, tls_ca=str(tmp_path / "missing-ca.pem"))
    with pytest.raises(ConfigError, match="TLS handshake .* failed"):
        await open_redis_tier(server.url)  # the system CAs do not know the self-signed one


async def test_mutual_tls_with_client_certificate(redis_factory, tls_files):
    server = redis_factory(tls=tls_files, tls_auth_clients=True)
    tier = await open_redis_tier(
        server.url,
        tls_ca=str(tls_files.ca_cert),
        tls_cert=str(tls_files.client_cert),
        tls_key=str(tls_files.client_key),
    )
    assert await tier.lookup(keys_of(2, 13)) == 0
    await tier.aclose()
    with pytest.raises((ConfigError, TierUnavailableError)):
        await open_redis_tier(server.url, tls_ca=str(tls_files.ca_cert))  # no client certificate


async def test_unreachable_port_is_tier_unavailable_naming_the_address():
    port = free_port()
    with pytest.raises(TierUnavailableError, match=f"cannot reach redis at 127.0.0.1:{port}"):
        await open_redis_tier(f"redis://127.0.0.1:{port}")
    with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}"):
        await open_redis_tier(f"redis+cluster://127.0.0.1:{port}")


async def test_part_size_above_the_servers_bulk_limit_is_refused_at_open(redis_factory):
    server = redis_factory(extra_args=["--proto-max-bulk-len", "1mb"])
    with pytest.raises(ConfigError, match="part_size 2097152 exceeds proto-max-bulk-len 1048576"):
        await open_redis_tier(server.url, part_size="2MiB")
    tier = await open_redis_tier(server.url, part_size="1MiB")
    assert tier.bulk_limit == 1 << 20
    await tier.aclose()


async def test_user_without_config_permission_assumes_the_default_bulk_limit(redis_server):
    with redis_server.client() as c:
        c.acl_setuser("nocfg", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"])
    tier = await open_redis_tier(redis_server.url, username="nocfg", password="pw")
    assert tier.bulk_limit == 512 << 20
    key = keys_of(1, 14)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, PART))) is PutResult.STORED
    await tier.aclose()
