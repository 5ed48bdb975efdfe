"""RemoteTier against a real ``kvstore serve`` process: the Tier contract over shared
memory and streams, queued lease releases sent at close, and the circuit breaker when the
store is killed and restarted."""

import asyncio
import socket
import time

import numpy as np
import pytest

from kvstore.client.store_client import StoreClient
from kvstore.client.tier import RemoteTier
from kvstore.errors import TierUnavailableError
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.chain import Chain, namespace, sealed
from tiers.base import PutResult, Tier, put_bytes

MiB = 1 << 20
CHAIN = Chain(namespace("remote-test"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "128MiB")


@pytest.mark.parametrize("transport", ["shm", "stream"])
async def test_tier_contract(store, transport):
    keys = CHAIN.keys(5, seed=1 if transport == "shm" else 2)
    objs = [CHAIN.seal(k, 2 * MiB + i, i) for i, k in enumerate(keys)]
    async with await RemoteTier.open(store.target, transport=transport) as tier:
        assert isinstance(tier, Tier) and tier.name == "remote"
        assert tier.client.uses_shm is (transport == "shm")
        for i in range(3):
            assert await put_bytes(tier, keys[i], objs[i], CHAIN.parent_of(keys[i])) is PutResult.STORED
        assert await put_bytes(tier, keys[0], objs[0]) is PutResult.EXISTS
        assert await tier.lookup(keys) == 3
        assert await tier.present(keys) == [True, True, True, False, False]
        assert await tier.contains(keys[2]) and not await tier.contains(keys[3])
        assert await tier.size_of(keys[1]) == len(objs[1]) and await tier.size_of(keys[4]) is None
        buf = np.zeros(3 * MiB, np.uint8)
        assert await tier.read_into(keys[1], memoryview(buf)) == len(objs[1])
        assert np.array_equal(buf[: len(objs[1])], objs[1])
        assert await tier.read_into(keys[3], memoryview(buf)) is None
        assert await tier.put(keys[3], objs[3], keys[2]) is PutResult.STORED
        assert await tier.lookup(keys) == 4
        assert await tier.delete(keys[1]) and not await tier.delete(keys[1])
        assert await tier.lookup(keys) == 1
        s = tier.stats()
        assert (s.hits, s.misses, s.puts, s.corrupt) == (1, 1, 4, 0)
        assert s.extra["breaker_open"] == 0 and s.extra["errors"] == 0
        for key in keys:
            await tier.delete(key)


async def test_closing_the_tier_sends_its_queued_lease_releases(store):
    """Same-host reads leave their releases queued (a 30 s delay here); ``aclose`` sends
    them, in one call, before the channel goes."""
    keys = CHAIN.keys(3, seed=6)
    objs = [sealed(k, MiB + i, 10 + i) for i, k in enumerate(keys)]
    buf = np.zeros(2 * MiB, np.uint8)
    async with await StoreClient.connect(store.target, transport="stream") as watcher:
        tier = await RemoteTier.open(store.target, transport="shm", release_delay_s=30)
        for key, obj in zip(keys, objs):
            assert await tier.put(key, obj) is PutResult.STORED
        base = (await watcher.stats())["server_counters"]
        for key, obj in zip(keys, objs):
            assert await tier.read_into(key, memoryview(buf)) == len(obj)
            assert np.array_equal(buf[: len(obj)], obj)
        s = tier.stats()
        assert (s.hits, s.extra["releases_deferred"], s.extra["release_calls"]) == (3, 3, 0)
        held = (await watcher.stats())["server_counters"]
        assert (held["leases_held"], held["host.refs_held"]) == (3, 3)
        await tier.aclose()
        after = (await watcher.stats())["server_counters"]
        assert (after["leases_held"], after["host.refs_held"]) == (0, 0)
        assert after["store.release_calls"] - base["store.release_calls"] == 1
        assert after["store.leases_released"] - base["store.leases_released"] == 3
        for key in keys:
            assert await watcher.delete(key)


@pytest.mark.parametrize("transport", ["shm", "stream"])
async def test_put_in_parts_and_abort(store, transport):
    keys = CHAIN.keys(3, seed=3 if transport == "shm" else 4)
    obj = sealed(keys[0], 3 * MiB + 17, 5)
    async with await RemoteTier.open(store.target, transport=transport) as tier:
        handle = await tier.put_start(keys[0], len(obj))
        assert (handle.buffer is not None) is (transport == "shm")  # in place over shm
        view = memoryview(obj)
        for lo in range(0, len(obj), MiB):
            await tier.put_write(handle, lo, view[lo : lo + MiB])
        assert await tier.put_commit(handle) is True
        aborted = await tier.put_start(keys[1], len(obj))
        await tier.put_write(aborted, 0, memoryview(sealed(keys[1], len(obj), 6)))
        assert await tier.put_commit(aborted, ok=False) is False
        again = await tier.put_start(keys[0], len(obj))  # the store holds it
        if transport == "shm":
            assert again.buffer is None
            assert await tier.put_commit(again) is True
        assert await tier.present(keys) == [True, False, False]
        buf = np.empty(len(obj), np.uint8)
        assert await tier.read_into(keys[0], memoryview(buf)) == len(obj)
        assert np.array_equal(buf, obj)
        assert await tier.delete(keys[0])


async def test_breaker_opens_on_kill_and_closes_after_restart(tmp_path):
    port = free_port()
    proc = StoreProcess(
        tmp_path,
        "--listen",
        f"127.0.0.1:{port}",
        "--host-capacity",
        "64MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--ssd-capacity",
        "256MiB",
    ).start()
    keys = CHAIN.keys(4, seed=7)
    objs = [CHAIN.seal(k, MiB + 100 * i, 20 + i) for i, k in enumerate(keys)]
    try:
        async with await RemoteTier.open(proc.target, retry_s=0.2, timeout_s=1.0) as tier:
            assert tier.client.uses_shm
            for key, obj in zip(keys, objs):
                assert await tier.put(key, obj, CHAIN.parent_of(key)) is PutResult.STORED
            await _until_written_through(tier, len(keys))
            proc.kill()

            answers = [await tier.lookup(keys) for _ in range(100)]
            assert answers == [0] * 100
            assert tier.breaker.counters.opened == 1 and tier.breaker.is_open
            assert tier.breaker.counters.rejected >= 99  # answered by the open breaker, not the dead store
            buf = np.empty(2 * MiB, np.uint8)
            assert await tier.read_into(keys[0], memoryview(buf)) is None
            assert await tier.put(keys[0], objs[0]) is PutResult.FAILED
            assert await tier.put_start(keys[0], len(objs[0])) is None
            assert tier.stats().extra["breaker_rejected"] >= 100

            proc.start()  # same SSD dir, same port
            deadline = time.monotonic() + 15
            while tier.breaker.is_open and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not tier.breaker.is_open and tier.breaker.counters.closed == 1
            assert tier.client.uses_shm  # remapped the new segment
            assert await tier.lookup(keys) == 4
            for key, obj in zip(keys, objs):
                assert await tier.read_into(key, memoryview(buf)) == len(obj)
                assert np.array_equal(buf[: len(obj)], obj)
            assert tier.stats().corrupt == 0
    finally:
        proc.kill()


async def _until_written_through(tier, n, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = (await tier.client.stats())["server"]
        if doc["tiers"]["ssd"]["objects"] == n and doc["write_throughs_in_flight"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the store did not write {n} objects through to SSD in {timeout} s")


async def test_open_fails_clearly_when_the_store_is_down():
    port = free_port()
    with pytest.raises(TierUnavailableError, match=str(port)):
        await RemoteTier.open(f"127.0.0.1:{port}", timeout_s=0.3)


async def test_refusals_do_not_trip_the_breaker(tmp_path):
    import yaml

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": "rw", "tenant": "a", "permissions": ["read", "write", "shm"]},
                    {"token": "ro", "tenant": "a", "permissions": ["read"]},
                    {"token": "wo", "tenant": "a", "permissions": ["write"]},
                ]
            }
        )
    )
    proc = StoreProcess(tmp_path, "--host-capacity", "32MiB", "--auth-tokens", str(tokens)).start()
    keys = CHAIN.keys(2, seed=8)
    obj = sealed(keys[0], MiB, 30)
    buf = np.empty(MiB, np.uint8)
    try:
        async with (
            await RemoteTier.open(proc.target, token="rw") as rw,
            await RemoteTier.open(proc.target, token="ro") as ro,
            await RemoteTier.open(proc.target, token="wo") as wo,
        ):
            assert await rw.put(keys[0], obj) is PutResult.STORED
            assert await ro.read_into(keys[0], memoryview(buf)) == MiB  # same tenant
            assert await ro.put(keys[1], sealed(keys[1], MiB, 31), keys[0]) is PutResult.FAILED
            assert await put_bytes(ro, keys[1], sealed(keys[1], MiB, 31), keys[0]) is PutResult.FAILED
            assert await wo.read_into(keys[0], memoryview(buf)) is None  # PERMISSION_DENIED: a miss
            assert await wo.lookup(keys) == 0
            for tier in (ro, wo):
                s = tier.stats()
                assert tier.breaker.counters.opened == 0 and s.extra["breaker_open"] == 0
            assert ro.stats().put_failures == 2
            assert wo.stats().extra["errors"] == 2 and wo.stats().misses == 1
            assert await rw.lookup(keys) == 1  # nothing else stored
    finally:
        assert proc.terminate(30) == 0


async def test_present_is_per_key_and_the_core_asks_the_lowest_tier_for_a_prefix(store):
    """The store answers prefixes: ``present`` finds keys after a gap with one Lookup per key
    past the first miss, while the core, for which the store process is the lowest tier,
    asks one prefix Lookup and one for the sizes of the hits."""
    from kvstore.store.registry import open_tier
    from kvstore.store.tiered import TieredStore

    keys = CHAIN.keys(6, seed=21)
    tier = await open_tier(f"kvstore://{store.target}", transport="stream")
    core = TieredStore(await open_tier("host:", capacity=8 * MiB, pin=False), [tier])
    try:
        objs = {i: sealed(keys[i], 4096 + i, 40 + i) for i in (0, 1, 3)}
        for i, obj in objs.items():
            assert await put_bytes(tier, keys[i], obj) is PutResult.STORED
        c = tier.client.counters
        assert await tier.present(keys) == [True, True, False, True, False, False]
        assert await tier.sizes(keys) == [4096, 4097, None, 4099, None, None]
        before = c.lookups
        found = await core.lookup(keys)
        assert found.tiers == ["remote", "remote"] and found.sizes == [4096, 4097]
        assert c.lookups - before == 2
        assert await core.promote(keys[3]) == "remote"
        assert (await core.lookup(keys[3:4])).tiers == ["host"]
    finally:
        await core.aclose()
