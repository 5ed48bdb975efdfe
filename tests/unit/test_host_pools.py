"""HostTier pools and its eviction plan on small pools of 4 KiB pages: a put that cannot fit
evicts nothing; each pool's flood evicts only its own objects; pool memory is a sealed memfd
that reaches only its own bytes."""

import mmap
import os

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.keys import ObjectKey, tenant_mark
from tests.unit.test_host_tier import CHAIN, FakeClock, P, make_obj, put, tier
from tiers.host import HostTier


def _slot_keys(t: HostTier) -> set:
    return {k for k, *_ in t.slots()}


def test_a_put_that_cannot_fit_evicts_nothing():
    """The issue's story, scaled: four leased objects split the pool so no 4-page hole can
    ever exist; the 4-page put is NO_ROOM and all 16 objects stay."""
    clock = FakeClock()
    t = tier(16, clock=clock)
    keys = CHAIN.keys(16)
    assert [put(t, k) for k in keys] == [i * P for i in range(16)]
    for i in (3, 7, 11, 15):
        assert t.lease(keys[i], ttl=10.0) is not None
    big = CHAIN.keys(1, seed=9)[0]
    assert t.put_start_sync(big, 4 * P) is None
    assert t.stats().evictions == 0 and _slot_keys(t) == set(keys)
    assert put(t, big, 3) is not None  # a 3-page hole can be made: evicts to make it
    assert t.stats().evictions >= 3


def test_a_put_that_fits_after_eviction_evicts_only_until_it_fits():
    t = tier(4)
    keys = CHAIN.keys(4)
    for k in keys:
        put(t, k)
    t.acquire(keys[0])  # referenced: never a victim
    assert put(t, CHAIN.keys(1, seed=5)[0], 2) is not None
    assert t.stats().evictions == 2 and t.contains_sync(keys[0])


def _pools(sizes: dict[str, int], clock=None) -> HostTier:
    marks = {tenant_mark(name): name for name in sizes}
    kw = {"clock": clock} if clock else {}
    return HostTier(sum(sizes.values()), pin=False, pools=sizes, pool_of=lambda key: marks.get(bytes(key[:8])), **kw)


def _tenant_keys(tenant: str, n: int, seed: int = 0) -> list[ObjectKey]:
    return CHAIN.scoped(tenant).keys(n, seed)


def _put(t: HostTier, key: ObjectKey, pages: int = 1) -> int | None:
    obj = make_obj(key, pages)
    handle = t.put_start_sync(key, len(obj))
    if handle is None:
        return None
    handle.buffer[:] = obj
    assert t.put_commit_sync(handle)
    return handle.offset


def test_each_pool_evicts_only_its_own_objects():
    t = _pools({"a": 4 * P, "b": 4 * P})
    try:
        a_keys, b_keys = _tenant_keys("a", 4), _tenant_keys("b", 40, seed=1)
        assert [_put(t, k) for k in a_keys] == [0, P, 2 * P, 3 * P]  # offsets within a's pool
        for k in b_keys:  # b floods its own pool
            assert _put(t, k) is not None
        assert all(t.contains_sync(k) for k in a_keys)
        assert t.pool_stats("a") == {
            "objects": 4,
            "bytes_used": 4 * P,
            "capacity_bytes": 4 * P,
            "evictions": 0,
            "pending": 0,
        }
        assert t.pool_stats("b")["evictions"] == 36
        assert t.pool_of(a_keys[0]) == "a" and t.pool_of(b_keys[0]) == "b"
    finally:
        t.close()


def test_a_key_no_pool_takes_never_fits():
    t = _pools({"a": 4 * P})
    try:
        assert t.put_start_sync(_tenant_keys("zz", 1)[0], P) is None
        assert t.pool_of(_tenant_keys("zz", 1)[0]) is None
        assert t.put_start_sync(CHAIN.keys(1)[0], P) is None  # an unscoped key: no pool
    finally:
        t.close()


def test_pools_must_fit_the_capacity_and_need_a_placement():
    with pytest.raises(ConfigError, match="more than its capacity"):
        HostTier(4 * P, pin=False, pools={"a": 4 * P, "b": P}, pool_of=lambda k: "a")
    with pytest.raises(ConfigError, match="pool_of"):
        HostTier(4 * P, pin=False, pools={"a": 4 * P})


def test_a_pool_is_a_sealed_memfd_that_holds_only_its_own_bytes():
    t = _pools({"a": 4 * P, "b": 4 * P})
    try:
        ka, kb = _tenant_keys("a", 1)[0], _tenant_keys("b", 1)[0]
        _put(t, ka), _put(t, kb)
        fd = t.pool_memfd("b").fd
        assert os.fstat(fd).st_size == 4 * P and os.fstat(fd).st_mode & 0o777 == 0o600
        assert not os.path.exists(t.pool_memfd("b").path)  # no name to open it by
        whole = mmap.mmap(fd, 4 * P, prot=mmap.PROT_READ)
        assert bytes(ka) not in whole[:] and bytes(kb.chunk_hash) in whole[:]
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)  # a client cannot shrink it
        ro = t.pool_memfd("b").readonly_fd()
        with pytest.raises(PermissionError):
            mmap.mmap(ro, 4 * P)  # a read-only descriptor maps read-only
        os.close(ro)
        whole.close()
    finally:
        t.close()


def test_a_write_sealed_pool_maps_read_only_for_everyone_but_its_owner():
    t = _pools({"a": 4 * P})
    try:
        memfd = t.pool_memfd("a")
        memfd.seal_writes()
        with pytest.raises(PermissionError):
            mmap.mmap(memfd.fd, 4 * P)  # no new writable mapping
        key = _tenant_keys("a", 1)[0]
        assert _put(t, key) == 0  # the owner still writes
        view = mmap.mmap(memfd.fd, 4 * P, prot=mmap.PROT_READ)
        obj = make_obj(key, 1)
        assert np.array_equal(np.frombuffer(view, np.uint8)[: len(obj)], obj)
    finally:
        t.close()


def test_pool_leases_and_pins_report_offsets_within_the_pool():
    t = _pools({"a": 2 * P, "b": 2 * P})
    try:
        ka, kb = _tenant_keys("a", 2), _tenant_keys("b", 2)
        for k in (*ka, *kb):
            _put(t, k)
        assert t.pin(kb[1]) == (P, len(make_obj(kb[1], 1)))
        t.release(kb[1])
        assert t.lookup_sync(ka) == 2 and t.stats().objects == 4
    finally:
        t.close()
