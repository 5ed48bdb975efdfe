"""SSD tier eviction against real files in tmp_path: chain tails before parents, LRU
first, and never an object being read (reads held inside their worker thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_ssd_tier import CHAIN, SIZE, kv_files, read, store  # noqa: E402 - shared helpers

from kvstore.keys import ObjectKey
from tiers import ssd as ssd_mod
from tiers.ssd import SSDTier


async def present(tier: SSDTier) -> set[ObjectKey]:
    return {k for k in CHAIN.made if await tier.contains(k)}


async def evicted_by(tier: SSDTier, key: ObjectKey) -> set[ObjectKey]:
    before = await present(tier)
    await store(tier, [key])
    return before - await present(tier)


async def test_eviction_takes_lru_chain_tails_before_parents(tmp_path):
    a0, a1, a2 = CHAIN.keys(3, seed=1)
    b0, c0, d0, e0 = (CHAIN.keys(1, seed=s)[0] for s in (2, 3, 4, 5))
    tier = SSDTier(tmp_path, 4 * SIZE)
    await store(tier, [a0, a1, a2])
    await store(tier, [b0])
    assert await evicted_by(tier, c0) == {a2}  # LRU is a0, but a2 is the oldest tail
    assert await evicted_by(tier, d0) == {a1}  # a1 became a tail, older than b0
    assert await read(tier, b0) is not None  # b0 is now most recently used
    assert await evicted_by(tier, e0) == {a0}
    assert await evicted_by(tier, a0) == {c0}
    st = tier.stats()
    assert st.evictions == 4 and st.objects == 4 and st.bytes_used == 4 * SIZE
    assert len(kv_files(tmp_path)) == 4 and not tier.path_of(a2).exists()
    await tier.aclose()


@pytest.fixture
def held_reads(monkeypatch):
    """Reads block (inside the worker thread, file open) until ``release`` is set."""
    release, started = threading.Event(), threading.Semaphore(0)
    real = ssd_mod._read_file

    def blocking(path, view, key):
        started.release()
        assert release.wait(10)
        return real(path, view, key)

    monkeypatch.setattr(ssd_mod, "_read_file", blocking)
    return release, started


async def start_read(tier: SSDTier, key: ObjectKey, started: threading.Semaphore) -> asyncio.Task:
    task = asyncio.create_task(tier.read_into(key, memoryview(bytearray(SIZE))))
    assert await asyncio.to_thread(started.acquire, True, 10)
    return task


async def test_an_object_being_read_is_not_evicted(tmp_path, held_reads):
    release, started = held_reads
    x0, y0, z0, w0 = (CHAIN.keys(1, seed=s)[0] for s in range(4))
    tier = SSDTier(tmp_path, 2 * SIZE)
    await store(tier, [x0, y0])
    reading = await start_read(tier, x0, started)
    assert await evicted_by(tier, z0) == {y0}  # x0 is LRU but pinned by the reader
    handle = await tier.put_start(w0, SIZE)  # x0 pinned, z0 evictable: evicts z0
    assert handle is not None and not await tier.contains(z0)
    assert await tier.put_start(CHAIN.keys(1, seed=9)[0], SIZE) is None  # only x0 left, pinned
    release.set()
    assert await reading == SIZE and await tier.contains(x0)
    assert not await tier.put_commit(handle, ok=False)
    await tier.aclose()


async def test_fallback_evicts_a_parent_when_no_tail_is_evictable(tmp_path, held_reads):
    release, started = held_reads
    p0, p1 = CHAIN.keys(2, seed=1)
    tier = SSDTier(tmp_path, 2 * SIZE)
    await store(tier, [p0, p1])
    reading = await start_read(tier, p1, started)
    assert await evicted_by(tier, CHAIN.keys(1, seed=2)[0]) == {p0}
    release.set()
    assert await reading == SIZE
    await tier.aclose()


async def test_a_cancelled_read_drains_before_it_unpins(tmp_path, held_reads):
    release, started = held_reads
    x0, y0 = CHAIN.keys(1, seed=1)[0], CHAIN.keys(1, seed=2)[0]
    tier = SSDTier(tmp_path, SIZE)
    await store(tier, [x0])
    reading = await start_read(tier, x0, started)
    reading.cancel()
    await asyncio.sleep(0.05)
    assert not reading.done()  # the worker thread still owns the buffer
    assert await tier.put_start(y0, SIZE) is None  # and x0 is still pinned
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert await evicted_by(tier, y0) == {x0}
    await tier.aclose()
