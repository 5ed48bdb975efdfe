"""The store core (``kvstore.store.TieredStore``) on a small real host pool over real SSD
directories: sized contiguous lookups (gaps, failing tiers), per-key presence, single-flight
promotion with tier errors as misses, deletes that settle write-downs, and reads that fall
back to the lower tier when the pool is full."""

from __future__ import annotations

import asyncio

import pytest
from test_host_tier import P, make_obj  # noqa: E402 - shared object maker

from kvstore.config import WritePolicy
from kvstore.keys import ObjectKey
from kvstore.store.observer import StoreObserver
from kvstore.store.tiered import TieredStore
from tests.kits.chain import Chain, keys_of, namespace
from tiers.base import put_bytes
from tiers.host import HostTier
from tiers.ssd import SSDTier

NS = namespace("store-core")
SIZE = len(make_obj(keys_of(NS, 1)[0], 1))  # one 4 KiB slot unit


class Failures(StoreObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def tier_failed(self, tier, op, err) -> None:
        self.seen.append((tier.name, op, type(err).__name__))


@pytest.fixture
async def rig(tmp_path):
    """``make(slots, ssds)``: a store over a ``slots``-unit pool and ``ssds`` SSD tiers."""
    made: list[TieredStore] = []

    def make(slots: int = 16, ssds: int = 1, policy: WritePolicy = WritePolicy.WRITE_THROUGH) -> TieredStore:
        lower = [SSDTier(tmp_path / f"{len(made)}-ssd{i}", 1 << 22, fsync=False, name=f"ssd{i}") for i in range(ssds)]
        made.append(TieredStore(HostTier(slots * P, pin=False), lower, policy, observer=Failures()))
        return made[-1]

    yield make
    for store in made:
        await store.aclose(5)


def put_host(store: TieredStore, key: ObjectKey, parent: ObjectKey | None = None) -> None:
    obj = make_obj(key, 1)
    handle = store.host.put_start_sync(key, len(obj), parent)
    handle.buffer[:] = obj
    assert store.host.put_commit_sync(handle)


async def put_lower(tier, key: ObjectKey) -> None:
    await put_bytes(tier, key, memoryview(make_obj(key, 1)))


async def test_lookup_names_the_fastest_tier_and_size_of_each_hit_and_fills_host_gaps(rig):
    store = rig(ssds=2)
    ks = keys_of(NS, 7)
    for i in (0, 1, 3):
        put_host(store, ks[i])
    await put_lower(store.lower[0], ks[2])
    for i in (2, 3, 4):  # ssd1 also has 2 and 3: the faster tier wins
        await put_lower(store.lower[1], ks[i])
    await put_lower(store.lower[0], ks[6])  # after the gap at 5: unreachable
    found = await store.lookup(ks)
    assert found.tiers == ["host", "host", "ssd0", "host", "ssd1"]
    assert found.sizes == [SIZE] * 5 and found.by_tier == {"host": 3, "ssd0": 1, "ssd1": 1}
    assert (found.looked_up, found.hits) == (7, 5)
    assert store.counters.keys_hit == {"host": 3, "ssd0": 1, "ssd1": 1}
    unsized = await store.lookup([bytes(k) for k in ks], sized=False)  # canonical bytes work too
    assert unsized.tiers == found.tiers and unsized.sizes == [SIZE, SIZE, None, SIZE, None]


async def test_present_answers_per_key_across_tiers(rig):
    store = rig()
    ks = keys_of(NS, 5, seed=1)
    put_host(store, ks[0])
    await put_lower(store.lower[0], ks[2])
    await put_lower(store.lower[0], ks[4])
    assert await store.present(ks) == [True, False, True, False, True]
    assert await store.contains(ks[4]) and not await store.contains(ks[1])


async def test_a_failing_lower_tier_is_a_counted_miss_and_the_next_tier_still_answers(rig):
    store = rig(ssds=2)
    ks = keys_of(NS, 4, seed=2)
    put_host(store, ks[0])
    for k in ks[1:3]:
        await put_lower(store.lower[0], k)
        await put_lower(store.lower[1], k)
    await store.lower[0].aclose()  # a real tier that now raises TierUnavailableError
    found = await store.lookup(ks)
    assert found.tiers == ["host", "ssd1", "ssd1"] and found.sizes == [SIZE] * 3
    assert store.counters.tier_errors == {"ssd0:lookup": 1}
    assert store.observer.seen == [("ssd0", "lookup", "TierUnavailableError")]
    await store.lower[1].aclose()
    assert (await store.lookup(ks)).tiers == ["host"]  # nothing below answers: the host prefix
    assert await store.present(ks) == [True, False, False, False]
    assert not await store.contains(ks[1])
    assert store.counters.tier_errors["ssd1:lookup"] == 2 and store.counters.tier_errors["ssd1:contains"] == 1


async def test_concurrent_promotions_of_one_key_read_it_once(rig):
    store = rig()
    (key,) = keys_of(NS, 1, seed=3)
    await put_lower(store.lower[0], key)
    got = await asyncio.gather(*(store.promote(key) for _ in range(8)))
    assert got == ["ssd0"] * 8
    assert store.lower[0].stats().hits == 1 and store.counters.promotions == 1
    assert store.host.contains_sync(key) and await store.promote(key) == "host"
    assert (await store.lookup([key])).tiers == ["host"]


async def test_promotion_treats_tier_errors_as_misses_and_tries_the_next_tier(rig):
    store = rig(ssds=2)
    (key,) = keys_of(NS, 1, seed=4)
    await put_lower(store.lower[0], key)
    await put_lower(store.lower[1], key)
    await store.lower[0].aclose()
    assert await store.promote(key) == "ssd1"
    assert store.counters.tier_errors == {"ssd0:promote": 1}
    store.host.delete_sync(key)
    await store.lower[1].aclose()
    assert await store.promote(key) is None  # every tier failing: a miss, not an error
    assert store.counters.tier_errors == {"ssd0:promote": 2, "ssd1:promote": 1}
    assert [s[:2] for s in store.observer.seen] == [("ssd0", "promote")] * 2 + [("ssd1", "promote")]


async def test_promotion_without_room_is_a_counted_miss(rig):
    store = rig(slots=2)
    a, b, c = keys_of(NS, 3, seed=5)
    for k in (a, b):
        put_host(store, k)
        store.host.acquire(k)  # referenced: not evictable
    await put_lower(store.lower[0], c)
    assert await store.promote(c) is None and store.counters.promote_no_room == 1
    for k in (a, b):
        store.host.release(k)
    assert await store.promote(c) == "ssd0"


async def test_a_promoted_chain_keeps_its_parents_so_host_eviction_drops_the_tail(rig):
    store = rig(slots=2)
    _, hashes, (a, b, c) = Chain(namespace("chain")).links(3, seed=6)
    await put_bytes(store.lower[0], a, memoryview(make_obj(a, 1)))
    await put_bytes(store.lower[0], b, memoryview(make_obj(b, 1, hashes[0])))  # names a as parent
    assert await store.promote(a) == "ssd0" and await store.promote(b) == "ssd0"
    put_host(store, c)  # needs a slot: the tail b goes, its parent a (older) stays
    assert store.host.contains_sync(a) and not store.host.contains_sync(b)


async def test_get_into_promotes_and_falls_back_to_the_lower_tier_when_the_pool_is_full(rig):
    store = rig(slots=1)
    a, b = keys_of(NS, 2, seed=7)
    await put_lower(store.lower[0], a)
    await put_lower(store.lower[0], b)
    buf = memoryview(bytearray(SIZE))
    got = await store.read_into(a, buf)
    assert (got.length, got.tier) == (SIZE, "ssd0") and store.host.contains_sync(a)
    store.host.acquire(a)  # the one slot stays referenced
    got = await store.read_into(b, buf)
    assert (got.length, got.tier) == (SIZE, "ssd0") and not store.host.contains_sync(b)
    assert bytes(buf) == bytes(make_obj(b, 1))
    store.host.release(a)
    assert await store.read_into(keys_of(NS, 1, seed=8)[0], buf) is None and store.counters.get_misses == 1


async def test_delete_settles_a_queued_write_down_so_the_object_stays_deleted(rig):
    store = rig()
    ks = keys_of(NS, 3, seed=9)
    for k in ks:
        put_host(store, k)
        store.written(k, None)
    assert await store.delete(ks[2]) is True  # still queued behind two copies
    assert await store.drain(5)
    assert await store.lower[0].present(ks) == [True, True, False]
    assert await store.delete(ks[0]) is True and await store.lower[0].present(ks) == [False, True, False]
    assert store.host.stats().extra["refs_held"] == 0


async def test_write_back_store_writes_dirty_objects_at_close(tmp_path):
    ssd = SSDTier(tmp_path / "ssd", 1 << 22, fsync=False)
    store = TieredStore(HostTier(16 * P, pin=False), [ssd], WritePolicy.WRITE_BACK)
    ks = keys_of(NS, 3, seed=10)
    for k in ks:
        put_host(store, k)
        store.written(k, None)
    assert store.stats()["write_down"]["dirty_bytes"] == 3 * SIZE
    await store.settle(5)
    assert await ssd.present(ks) == [True] * 3
    await store.aclose()


class SlowReads:
    """Each read of ``tier`` first waits on ``gate`` (a congested link), then reads."""

    def __init__(self, tier, gate: asyncio.Event) -> None:
        self.inner, self.gate, self.reads = tier.read_into, gate, 0
        tier.read_into = self

    async def __call__(self, key, buf):
        self.reads += 1
        await self.gate.wait()
        return await self.inner(key, buf)


async def test_a_promotion_nobody_waits_for_any_more_is_cancelled_and_its_slot_released(rig):
    store = rig()
    (key,) = keys_of(NS, 1)
    await put_lower(store.lower[0], key)
    slow = SlowReads(store.lower[0], asyncio.Event())
    waiter = asyncio.ensure_future(store.promote(key))
    await asyncio.sleep(0.01)
    assert slow.reads == 1 and store.host.stats().as_dict()["pending"] == 1  # reading into a slot
    waiter.cancel()  # the prefetch gave up
    await asyncio.gather(waiter, return_exceptions=True)
    await store.promoter.drain(1)
    assert store.promoter.in_flight == 0
    assert store.host.stats().as_dict()["pending"] == 0 and not store.host.contains_sync(key)


async def test_a_promotion_another_caller_still_waits_for_goes_on(rig):
    store = rig()
    (key,) = keys_of(NS, 1)
    await put_lower(store.lower[0], key)
    gate = asyncio.Event()
    slow = SlowReads(store.lower[0], gate)
    first, second = asyncio.ensure_future(store.promote(key)), asyncio.ensure_future(store.promote(key))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    gate.set()
    assert await second == "ssd0" and store.host.contains_sync(key) and slow.reads == 1
