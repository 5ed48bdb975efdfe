"""The store core over a real redis-server that fails: killed (lookups and promotions are
misses, the breaker counts them), or stopped with SIGSTOP (write-downs hang until the close
gives up on them, releasing every host reference)."""

from __future__ import annotations

import os
import signal

from kvstore.config import WritePolicy
from kvstore.store.registry import open_tier
from kvstore.store.tiered import TieredStore
from kvstore.store.writedown import Offer
from tests.kits.chain import keys_of, namespace, sealed
from tiers.host import HostTier

NS = namespace("store-faults")
SIZE = 3000


async def store_over(server, **options) -> TieredStore:
    redis = await open_tier(server.url, **options)
    return TieredStore(HostTier(64 * 4096, pin=False), [redis], WritePolicy.WRITE_THROUGH)


def publish(store: TieredStore, key, seed: int = 0) -> Offer:
    obj = sealed(key, SIZE, seed)
    handle = store.host.put_start_sync(key, SIZE)
    handle.buffer[:] = obj
    assert store.host.put_commit_sync(handle)
    return store.written(key, None)


async def test_sized_lookup_asks_redis_twice_then_misses_once_it_is_killed(redis_factory):
    server = redis_factory()
    store = await store_over(server, retry_s=60)
    redis = store.lower[0]
    ks = keys_of(NS, 5)
    try:
        for i, k in enumerate(ks[:4]):
            assert publish(store, k, i) is Offer.QUEUED
        assert await store.drain(10)
        for k in ks[1:4]:
            store.host.delete_sync(k)  # host keeps chunk 0 only
        before = redis.stats().extra["round_trips"]
        found = await store.lookup(ks)
        assert found.tiers == ["host", "redis", "redis", "redis"] and found.sizes == [SIZE] * 4
        # one batch for presence (the keys the host lacks), one for the sizes of the prefix hits
        assert redis.stats().extra["round_trips"] - before == 2
        server.kill()
        found = await store.lookup(ks)
        assert found.tiers == ["host"] and found.sizes == [SIZE]  # a miss, not an error
        assert await store.promote(ks[1]) is None
        assert redis.stats().extra["breaker_open"] == 1
    finally:
        await store.aclose(2)


async def test_close_gives_up_on_hanging_write_downs_and_releases_every_reference(redis_factory):
    server = redis_factory()
    store = await store_over(server, op_timeout_s=30)
    os.kill(server.pid, signal.SIGSTOP)  # up, but never answers
    try:
        for i, k in enumerate(keys_of(NS, 3, seed=1)):
            assert publish(store, k, i) is Offer.QUEUED
        assert not await store.drain(0.3)  # the first copy hangs, the others wait behind it
        assert store.writer.copying == 2 and store.writer.in_flight == 3
        await store.settle(0.3)
        assert store.counters.write_down_abandoned == 3
        assert store.host.stats().extra["refs_held"] == 0 and store.writer.in_flight == 0
    finally:
        os.kill(server.pid, signal.SIGCONT)
        await store.aclose(2)
