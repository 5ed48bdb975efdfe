"""Reservation stories of the store process (``ServerStore.puts``, a ``PutPath``) in one
process, on a 4-slot shared pool and a fake clock: a ``PutStart`` that is never committed
expires after ``put_ttl`` and its slot comes back; a commit after that fails cleanly; a
commit whose bytes are not the announced object is refused and frees the slot; a stream's
reservation is never reaped; a put id is bound to its tenant; write-through lands in SSD.
"""

import asyncio

import numpy as np
import pytest

from kvstore.config import WritePolicy
from kvstore.errors import CapacityError, ConfigError, LeaseError, ObjectFormatError
from kvstore.server.leases import ExpiredPutError
from tests.kits.server_core import PUT_TTL, SLOT, FakeClock, gauges, keys, make_store, put, scoped, sealed
from tiers.base import PutResult
from tiers.ssd import SSDTier

EMPTY = {"leases": 0, "puts": 0, "bytes": 0, "refs": 0, "doomed": 0, "objects": 0}


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
async def store(clock):
    store, _ = make_store(clock)
    yield store
    await store.aclose()


async def reserve(store, key, size=SLOT, tenant="a", streamed=False):
    return await store.puts.reserve(tenant, key, scoped(key, tenant), size, None, streamed)


async def test_an_uncommitted_put_start_expires_after_put_ttl_and_its_room_comes_back(store, clock):
    big, other = keys(2)
    pending = await reserve(store, big, 3 * SLOT)
    assert gauges(store) == EMPTY | {"puts": 1, "bytes": 3 * SLOT}
    assert await reserve(store, other, 2 * SLOT) is PutResult.NO_ROOM  # the room is held
    clock.advance(PUT_TTL - 0.001)
    store.reap()
    assert gauges(store)["puts"] == 1  # not yet
    clock.advance(0.001)
    store.reap()
    assert gauges(store) == EMPTY and store.metrics.counters.puts_reaped == 1
    with pytest.raises(LeaseError) as info:  # gone: NOT_FOUND
        store.puts.claim(pending.put_id, "a")
    assert not isinstance(info.value, ExpiredPutError)
    assert await put(store, other, 2 * SLOT) is PutResult.STORED


async def test_a_commit_after_expiry_fails_cleanly_even_before_the_reaper(store, clock):
    (key,) = keys(1)
    pending = await reserve(store, key)
    pending.handle.buffer[:] = sealed(key)  # written in time...
    clock.advance(PUT_TTL)  # ...committed too late
    with pytest.raises(ExpiredPutError):
        store.puts.claim(pending.put_id, "a")
    assert gauges(store) == EMPTY and store.metrics.counters.puts_reaped == 1
    with pytest.raises(LeaseError):  # a retry: unknown now
        store.puts.claim(pending.put_id, "a")
    assert await store.lookup([scoped(key)]) == ([], [])
    assert await put(store, key) is PutResult.STORED


async def test_a_commit_in_time_publishes_under_the_scoped_key(store, clock):
    (key,) = keys(1)
    pending = await reserve(store, key, 1000)
    pending.handle.buffer[:] = sealed(key, 1000, seed=5)
    clock.advance(PUT_TTL - 0.001)
    claimed = store.puts.claim(pending.put_id, "a")
    assert await store.puts.finish(claimed, "shm") is PutResult.STORED
    assert await store.lookup([scoped(key)]) == (["host"], [1000])
    view, _ = await store.acquire(scoped(key))
    assert bytes(view[256:]) == bytes(sealed(key, 1000, seed=5)[256:])  # payload as sent
    assert bytes(view) == bytes(sealed(scoped(key), 1000, seed=5))  # header rekeyed
    store.release(scoped(key), len(view))
    assert store.metrics.counters.puts == {("shm", "stored"): 1}


def _flip_payload(key, size):
    obj = sealed(key, size)
    obj[-1] ^= 0xFF
    return obj


BAD_OBJECTS = {  # what the client wrote into a reservation for `key` of `size` bytes
    "payload bit flipped": _flip_payload,
    "another key's object": lambda key, size: sealed(keys(2, seed=9)[1], size),
    "sealed for the scoped key": lambda key, size: sealed(scoped(key), size),
    "header says another length": lambda key, size: np.concatenate([sealed(key, size - 100), np.zeros(100, np.uint8)]),
    "never written": lambda key, size: np.zeros(size, np.uint8),
}


@pytest.mark.parametrize("path", ["shm", "stream"])
@pytest.mark.parametrize("bad", BAD_OBJECTS)
async def test_a_commit_of_the_wrong_bytes_is_refused_and_frees_the_slot(store, bad, path):
    (key,) = keys(1)
    pending = await reserve(store, key, 2000, streamed=path == "stream")
    pending.handle.buffer[:] = BAD_OBJECTS[bad](key, 2000)
    if path == "shm":
        pending = store.puts.claim(pending.put_id, "a")
    with pytest.raises(ObjectFormatError):
        await store.puts.finish(pending, path)
    assert gauges(store) == EMPTY
    assert store.metrics.counters.failures == {"bad_object": 1}
    assert await store.lookup([scoped(key)]) == ([], [])
    assert await put(store, key, 2000) is PutResult.STORED  # the key is free again


async def test_a_streams_reservation_is_never_reaped_and_cannot_be_claimed(store, clock):
    (key,) = keys(1)
    pending = await reserve(store, key, streamed=True)
    clock.advance(100 * PUT_TTL)
    store.reap()
    assert gauges(store)["puts"] == 1  # its handler owns it
    with pytest.raises(LeaseError):  # no PutCommit for it
        store.puts.claim(pending.put_id, "a")
    store.puts.abort(pending)  # the handler's exit
    assert gauges(store) == EMPTY


async def test_a_put_id_is_bound_to_its_tenant(store):
    (key,) = keys(1)
    pending = await reserve(store, key, tenant="a")
    with pytest.raises(LeaseError):
        store.puts.claim(pending.put_id, "b")
    assert gauges(store)["puts"] == 1  # b's try took nothing
    pending.handle.buffer[:] = sealed(key)
    assert await store.puts.finish(store.puts.claim(pending.put_id, "a"), "shm") is PutResult.STORED


async def test_an_abort_frees_the_slot_and_a_second_abort_changes_nothing(store):
    (key,) = keys(1)
    pending = store.puts.claim((await reserve(store, key)).put_id, "a")
    store.puts.abort(pending)
    assert gauges(store) == EMPTY
    with pytest.raises(LeaseError):
        store.puts.claim(pending.put_id, "a")


async def test_reserve_answers_exists_and_refuses_impossible_sizes(store):
    (key,) = keys(1)
    assert await put(store, key) is PutResult.STORED
    assert await reserve(store, key) is PutResult.EXISTS
    with pytest.raises(ConfigError):
        await reserve(store, keys(2)[1], 255)  # smaller than a header
    with pytest.raises(CapacityError):
        await reserve(store, keys(2)[1], 5 * SLOT)  # larger than the pool
    assert gauges(store)["puts"] == 0


async def test_aclose_aborts_uncommitted_reservations(clock):
    store, host = make_store(clock)
    a, b = keys(2)
    await reserve(store, a)
    await reserve(store, b, streamed=True)
    await store.aclose()
    assert host.stats().extra["pending"] == 1  # only the stream's: its handler frees it


async def test_a_committed_put_is_written_through_to_ssd_and_a_delete_removes_both(clock, tmp_path):
    ssd = SSDTier(tmp_path / "ssd", 64 * SLOT, fsync=False)
    store, _ = make_store(clock, lower=[ssd], policy=WritePolicy.WRITE_THROUGH)
    try:
        (key,) = keys(1)
        assert await put(store, key, 3000, seed=2) is PutResult.STORED
        async with asyncio.timeout(10):
            while store.puts.writes_in_flight:
                await asyncio.sleep(0.01)
        assert await ssd.size_of(scoped(key)) == 3000
        assert store.metrics.counters.write_through == {("ssd", "stored"): 1}
        assert await store.delete(scoped(key)) is True
        assert await ssd.size_of(scoped(key)) is None and await store.lookup([scoped(key)]) == ([], [])
    finally:
        await store.aclose()
