"""The host tier's retention order (``tiers.host_slots``): objects used once go before
reused ones, uses inside ``reuse_window_s`` count as one, the write-down's hold is not a
use, and a key evicted then stored again counts as reused.  Real ``HostTier``s on 4-page
pools, time from a fake clock."""

import numpy as np
from test_host_tier import CHAIN, FakeClock, present, put, tier


def test_a_reused_object_outlives_newer_objects_used_once():
    clock = FakeClock()
    t = tier(4, clock=clock)
    a, b, c, d, e, f = CHAIN.keys(6, seed=21)  # stored without parents: all tails
    put(t, a)
    clock.now += 5
    t.read_into_sync(a, np.zeros(4096, np.uint8))  # a: used again 5 s later, reused
    clock.now += 5
    for k in (b, c, d):  # newer than a's last use
        put(t, k)
    put(t, e)  # b goes (used once, oldest), not a
    put(t, f)  # then c
    assert present(t, [a, b, c, d, e, f]) == [True, False, False, True, True, True]
    assert t.pool_stats("") == {
        "objects": 4,
        "bytes_used": 4 * 4096,
        "capacity_bytes": 4 * 4096,
        "evictions": 2,
        "pending": 0,
    }


def test_uses_inside_the_reuse_window_count_as_one():
    clock = FakeClock()
    t = tier(3, clock=clock, reuse_window_s=10.0)
    a, b, c, d = CHAIN.keys(4, seed=22)
    for k in (a, b, c):
        put(t, k)
    clock.now += 5  # inside the window: not a reuse
    assert t.acquire(a) is not None
    t.release(a)
    put(t, d)  # plain LRU: b goes
    assert present(t, [a, b, c, d]) == [True, False, True, True]
    clock.now += 20
    assert t.lease(c, ttl=1) is not None  # c leased 25 s after its put: reused
    clock.now += 2  # (the lease has expired)
    (x, y) = CHAIN.keys(2, seed=23)
    put(t, x)  # a goes (used once), then d, never c
    put(t, y)
    assert present(t, [a, c, d, x, y]) == [False, True, False, True, True]


def test_the_write_downs_hold_is_not_a_use():
    clock = FakeClock()
    t = tier(2, clock=clock)
    a, b, c = CHAIN.keys(3, seed=24)
    put(t, a)
    put(t, b)
    clock.now += 5
    t.read_into_sync(b, np.zeros(4096, np.uint8))  # b: reused
    assert t.acquire(a, use=False) is not None  # a held later, as the write-down holds
    t.release(a)  # a saved object: recent, but not reused
    clock.now += 5
    put(t, c)  # so a, used once, goes before b
    assert present(t, [a, b, c]) == [False, True, True]


def test_a_key_stored_again_after_its_eviction_counts_as_reused():
    clock = FakeClock()
    t = tier(2, clock=clock)
    a, b, c, d, e = CHAIN.keys(5, seed=25)
    put(t, a)
    put(t, b)
    put(t, c)  # a goes: remembered
    put(t, a)  # b goes; a comes back, reused
    put(t, d)  # c goes (used once, oldest)
    put(t, e)  # d goes, not the older a
    assert present(t, [a, b, c, d, e]) == [True, False, False, False, True]
    t.delete_sync(a)  # a deleted key is forgotten:
    put(t, a)  # stored again, it is used once
    put(t, b)  # (e goes: the oldest used once)
    put(t, c)  # so a, older than b, goes now
    assert present(t, [a, b, c, e]) == [False, True, True, False]
