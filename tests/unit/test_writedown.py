"""The one write-down path (``kvstore.store.writedown``) on a real host pool and real SSD
directories: write-through and write-back, the in-flight bound, the bounded queue (a full
queue drops, counted, and leaks no host reference), failing tiers, deletes and close."""

from __future__ import annotations

import asyncio

import pytest
from test_host_tier import P, make_obj  # noqa: E402 - shared object maker

from kvstore.config import WritePolicy
from kvstore.keys import ObjectKey
from kvstore.store.observer import StoreCounters, StoreObserver
from kvstore.store.writedown import Offer, WriteDown
from tests.kits.chain import keys_of, namespace
from tiers.base import PutResult
from tiers.host import HostTier
from tiers.ssd import SSDTier

NS = namespace("writedown")


def keys(n: int, seed: int = 0) -> list[ObjectKey]:
    return keys_of(NS, n, seed)


class Recorder(StoreObserver):
    """Keeps what the write-down reports."""

    def __init__(self) -> None:
        self.log: list[tuple[str, PutResult, int, str]] = []
        self.dropped = 0

    def written(self, tier, result, size, err) -> None:
        self.log.append((tier.name, result, size, type(err).__name__ if err else ""))

    def write_down_dropped(self) -> None:
        self.dropped += 1


class Rig:
    """A host pool of ``pages`` 4 KiB units over SSD directories, and its write-down."""

    def __init__(
        self, tmp_path, policy: str, pages: int = 16, ssds: int = 1, ssd_capacity: int = 1 << 20, **kw
    ) -> None:
        self.host = HostTier(pages * P, pin=False)
        self.ssds = [SSDTier(tmp_path / f"ssd{i}", ssd_capacity, name=f"ssd{i}") for i in range(ssds)]
        self.counters, self.observer = StoreCounters(), Recorder()
        self.writer = WriteDown(self.host, self.ssds, WritePolicy(policy), self.counters, self.observer, **kw)

    def commit(self, key: ObjectKey, parent=None, pages: int = 1) -> Offer:
        obj = make_obj(key, pages)
        handle = self.host.put_start_sync(key, len(obj), parent)
        assert handle is not None
        handle.buffer[:] = obj
        assert self.host.put_commit_sync(handle)
        return self.writer.offer(key, parent)

    async def on_ssd(self, ks, i: int = 0) -> list[bool]:
        return await self.ssds[i].present(ks)

    def refs(self) -> int:
        return self.host.stats().extra["refs_held"]

    async def close(self) -> None:
        await self.writer.aclose(5)
        for ssd in self.ssds:
            await ssd.aclose()
        self.host.close()


@pytest.fixture
async def rigs(tmp_path):
    made: list[Rig] = []

    def make(policy: str, **kw) -> Rig:
        made.append(Rig(tmp_path / str(len(made)), policy, **kw))
        return made[-1]

    yield make
    for r in made:
        await r.close()


async def test_write_through_copies_each_commit_to_every_tier_and_releases_the_slot(rigs):
    r = rigs("write_through", ssds=2)
    ks = keys(3)
    assert [r.commit(k, ks[i - 1] if i else None) for i, k in enumerate(ks)] == [Offer.QUEUED] * 3
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks, 0) == await r.on_ssd(ks, 1) == [True] * 3
    size = len(make_obj(ks[0], 1))
    assert sorted(r.observer.log) == sorted([(f"ssd{i}", PutResult.STORED, size, "") for i in (0, 1)] * 3)
    assert r.writer.written == 3 and r.counters.write_down == {"ssd0:stored": 3, "ssd1:stored": 3}
    assert r.refs() == 0 and all(r.host.delete_sync(k) for k in ks)
    assert r.host.stats().bytes_used == 0


async def test_at_most_max_in_flight_copies_run_and_the_rest_wait_in_the_queue(rigs):
    r = rigs("write_through", pages=16, max_in_flight=3)
    ks = keys(10, seed=1)
    for k in ks:  # no await in between: nothing has run yet
        assert r.commit(k) is Offer.QUEUED
    assert r.writer.copying == 3 and r.writer.in_flight == 10
    assert r.refs() == 10  # every queued object holds its slot
    assert await r.writer.drain(10)
    assert await r.on_ssd(ks) == [True] * 10 and r.writer.in_flight == 0 and r.refs() == 0


async def test_a_full_queue_drops_the_write_counts_it_and_keeps_no_reference(rigs):
    size = len(make_obj(keys(1)[0], 1))
    r = rigs("write_through", max_in_flight=2, queue_bytes=2 * size)
    ks = keys(6, seed=2)
    offers = [r.commit(k) for k in ks]
    # two copies start at once, two objects fill the queue, the last two find it full
    assert offers == [Offer.QUEUED] * 4 + [Offer.DROPPED] * 2
    assert r.counters.write_down_dropped == 2 and r.observer.dropped == 2
    assert r.refs() == 4  # the dropped ones released theirs already
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks) == [True] * 4 + [False] * 2  # a future miss below, never wrong data
    assert all(r.host.contains_sync(k) for k in ks) and r.refs() == 0
    assert r.commit(keys(1, seed=3)[0]) is Offer.QUEUED  # room again once the queue drained


async def test_submit_waits_a_bounded_time_for_room_instead_of_dropping(rigs):
    size = len(make_obj(keys(1)[0], 1))
    r = rigs("write_through", max_in_flight=1, queue_bytes=size)
    ks = keys(4, seed=15)
    assert [r.commit(k) for k in ks[:2]] == [Offer.QUEUED] * 2  # one copying, one queued: full
    for k in ks[2:]:
        obj = make_obj(k, 1)
        handle = r.host.put_start_sync(k, len(obj))
        handle.buffer[:] = obj
        assert r.host.put_commit_sync(handle)
    assert await r.writer.submit(ks[2], None, wait_s=0) is Offer.DROPPED  # no wait: dropped
    assert await r.writer.submit(ks[3], None, wait_s=10) is Offer.QUEUED  # waited for room
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks) == [True, True, False, True] and r.refs() == 0


async def test_an_object_larger_than_the_queue_is_taken_when_the_queue_is_empty(rigs):
    r = rigs("write_through", max_in_flight=1, queue_bytes=10)
    ks = keys(3, seed=4)
    assert [r.commit(k) for k in ks] == [Offer.QUEUED, Offer.QUEUED, Offer.DROPPED]
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks) == [True, True, False]


async def test_offers_from_another_thread_are_copied_on_the_loop(rigs):
    r = rigs("write_through")
    ks = keys(4, seed=5)
    for k in ks:
        obj = make_obj(k, 1)
        handle = r.host.put_start_sync(k, len(obj))
        handle.buffer[:] = obj
        assert r.host.put_commit_sync(handle)
        assert await asyncio.to_thread(r.writer.offer, k, None) is Offer.QUEUED
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks) == [True] * 4 and r.refs() == 0


async def test_a_busy_loop_does_not_turn_offers_from_another_thread_into_drops(rigs):
    """The engine's scheduler thread offers a request's chunks back to back while the loop has
    not yet started any copy: those a free copy slot will take do not fill the queue.  (CI once
    lost a chunk's SSD copy this way: a one-object queue behind two idle copy slots.)"""
    size = len(make_obj(keys(1)[0], 1))
    r = rigs("write_through", max_in_flight=2, queue_bytes=size)
    ks = keys(5, seed=16)
    for k in ks:
        obj = make_obj(k, 1)
        handle = r.host.put_start_sync(k, len(obj))
        handle.buffer[:] = obj
        assert r.host.put_commit_sync(handle)

    def offer_all() -> list[Offer]:  # one call on another thread: the loop waits meanwhile
        return [r.writer.offer(k, None) for k in ks]

    offers = await asyncio.to_thread(offer_all)
    # as if on the loop: two copies start, one object waits, the rest find the queue full
    assert offers == [Offer.QUEUED] * 3 + [Offer.DROPPED] * 2
    assert r.counters.write_down_dropped == 2
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks) == [True] * 3 + [False] * 2 and r.refs() == 0


async def test_write_back_holds_objects_until_the_dirty_limit_then_writes_the_oldest(rigs):
    r = rigs("write_back", pages=16)
    size = len(make_obj(keys(1)[0], 1))
    assert r.writer.dirty_limit == 8 * P
    per_limit = r.writer.dirty_limit // size  # objects that fit under the limit
    ks = keys(per_limit + 1, seed=6)
    assert [r.commit(k) for k in ks[:per_limit]] == [Offer.DIRTY] * per_limit
    assert await r.writer.drain(5)
    assert await r.on_ssd(ks[:per_limit]) == [False] * per_limit  # nothing written yet
    assert r.writer.dirty_bytes == per_limit * size
    r.commit(ks[per_limit])  # crosses the limit: flush down to half of it, oldest first
    assert await r.writer.drain(5)
    flushed = await r.on_ssd(ks)
    n = sum(flushed)
    assert flushed == [True] * n + [False] * (len(ks) - n)
    assert r.writer.dirty_bytes == (len(ks) - n) * size <= r.writer.dirty_limit // 2
    assert await r.writer.flush(5)
    assert await r.on_ssd(ks) == [True] * len(ks) and r.writer.dirty_bytes == 0
    assert r.refs() == 0


async def test_dirty_objects_are_never_evicted_unwritten(rigs):
    r = rigs("write_back", pages=8)
    ks = keys(3, seed=7)
    for k in ks:  # 3 of 8 units: under the limit of 4, all dirty and referenced
        assert r.commit(k) is Offer.DIRTY
    big = keys(1, seed=8)[0]
    # a 6-unit put needs room that only evicting a dirty object could give: refused
    assert r.host.put_start_sync(big, len(make_obj(big, 6))) is None
    await r.writer.aclose(5)  # close writes everything dirty down and releases it
    assert await r.on_ssd(ks) == [True] * 3 and r.refs() == 0
    handle = r.host.put_start_sync(big, len(make_obj(big, 6)))
    assert handle is not None and r.host.put_commit_sync(handle, ok=False) is False
    assert r.commit(keys(1, seed=14)[0]) is Offer.DROPPED and r.refs() == 0  # closed: none taken


async def test_host_only_writes_nothing_and_takes_no_reference(rigs):
    r = rigs("host_only")
    k = keys(1, seed=9)[0]
    assert r.commit(k) is Offer.SKIPPED and r.refs() == 0
    assert await r.writer.drain(1) and await r.on_ssd([k]) == [False]


async def test_a_failing_lower_tier_is_counted_and_the_next_tier_still_gets_the_object(rigs):
    r = rigs("write_through", ssds=2)
    await r.ssds[0].aclose()  # a real tier that now raises TierUnavailableError
    k = keys(1, seed=10)[0]
    r.commit(k)
    assert await r.writer.drain(5)
    assert [w[0::3] for w in r.observer.log] == [("ssd0", "TierUnavailableError"), ("ssd1", "")]
    assert r.counters.write_down == {"ssd0:failed": 1, "ssd1:stored": 1}
    assert await r.on_ssd([k], 1) == [True] and r.host.contains_sync(k) and r.refs() == 0


async def test_no_room_below_is_a_counted_result_and_keeps_the_host_copy(rigs):
    r = rigs("write_through", ssd_capacity=1000)  # smaller than one object
    k = keys(1, seed=11)[0]
    r.commit(k)
    assert await r.writer.drain(5)
    assert r.observer.log[0][:2] in (("ssd0", PutResult.NO_ROOM), ("ssd0", PutResult.FAILED))
    assert await r.on_ssd([k]) == [False] and r.host.contains_sync(k) and r.refs() == 0


async def test_settle_key_takes_a_queued_object_out_so_a_delete_stays_deleted(rigs):
    r = rigs("write_through", max_in_flight=1)
    ks = keys(3, seed=12)
    for k in ks:
        r.commit(k)
    await r.writer.settle_key(ks[2])  # queued: taken out, its reference released
    await r.writer.settle_key(ks[0])  # copying: cancelled and waited for
    assert r.host.delete_sync(ks[0]) and r.host.delete_sync(ks[2])
    assert await r.writer.drain(5)
    assert (await r.on_ssd(ks))[1:] == [True, False] and r.refs() == 0
