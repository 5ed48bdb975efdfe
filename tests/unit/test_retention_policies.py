"""The host tier's retention policies (``tiers.retention``), each through a real ``HostTier``
on 4-page pools with time from a fake clock: ``reuse`` (the default) and ``adaptive`` keep
reused objects through a scan of objects used once where ``lru`` does not; ``adaptive``
lets stale reused objects go once evicted newcomers come back; under all, parents outlive
their children and a leased, acquired or pinned object is never evicted; the policy
changes which objects stay, never the bytes a held object returns; the ``host_retention``
setting reaches the tier the embedded store opens, and a bad name is a ``ConfigError``
naming it.  About 2 s."""

import asyncio

import numpy as np
import pytest
from test_host_tier import CHAIN, FakeClock, P, make_obj, present, put, tier

from kvstore.config import RetentionPolicy, StoreConfig
from kvstore.errors import ConfigError
from kvstore.store.tiered import TieredStore

POLICIES = ["reuse", "adaptive", "lru"]


def _reuse(t, clock, key) -> None:
    """Read ``key`` well outside the reuse window (a reuse under either policy)."""
    clock.now += 5
    assert t.read_into_sync(key, np.zeros(P, np.uint8)) == len(make_obj(key, 1))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_scan_of_objects_used_once_flushes_reused_ones_only_under_lru(policy):
    clock = FakeClock()
    t = tier(4, clock=clock, retention=policy)
    a, b = CHAIN.keys(2, seed=31)
    put(t, a)
    put(t, b)
    _reuse(t, clock, a)
    _reuse(t, clock, b)
    scan = CHAIN.keys(6, seed=32)  # one-shot objects, each newer than a's and b's last use
    for k in scan:
        clock.now += 1
        put(t, k)
    kept = present(t, [a, b])
    assert kept == ([False, False] if policy == "lru" else [True, True])
    assert sum(present(t, scan)) == (4 if policy == "lru" else 2)
    assert t.retention is RetentionPolicy(policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_parents_outlive_their_children(policy):
    clock = FakeClock()
    t = tier(4, clock=clock, retention=policy)
    k0, k1, k2 = CHAIN.keys(3, seed=33)
    put(t, k0)
    put(t, k1, parent=k0)
    put(t, k2, parent=k1)
    x, y, z = CHAIN.keys(3, seed=34)
    put(t, x)
    put(t, y)  # k2 goes: k0 and k1 are older, but have a child
    assert present(t, [k0, k1, k2]) == [True, True, False]
    put(t, z)  # then k1, a tail now, never k0 before it
    assert present(t, [k0, k1, k2, x, y, z]) == [True, False, False, True, True, True]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_leased_acquired_or_pinned_object_is_never_evicted(policy):
    clock = FakeClock()
    t = tier(4, clock=clock, retention=policy)
    a, b, c, d = CHAIN.keys(4, seed=35)
    for k in (a, b, c, d):
        put(t, k)  # a, b, c first in either policy's order
    lease = t.lease(a, ttl=60)
    view = t.acquire(b)
    assert lease is not None and view is not None
    assert t.pin(c) is not None
    clock.now += 10
    more = CHAIN.keys(6, seed=36)
    assert put(t, more[0]) is not None  # only d may go
    assert put(t, more[1]) is not None  # then the newcomer
    assert present(t, [a, b, c, d]) == [True, True, True, False]
    assert bytes(view) == make_obj(b, 1).tobytes()  # the held bytes are untouched
    t.release(b)
    t.release(c)
    t.release_lease(lease.lease_id)
    for k in more[2:5]:  # now a, b, c may go, and do
        assert put(t, k) is not None
    assert present(t, [a, b, c]) == [False, False, False]


@pytest.mark.parametrize("policy", ["reuse", "adaptive"])
def test_reused_objects_no_longer_used_age_out_only_under_adaptive(policy):
    """Two reused objects stop being used while new objects, evicted as used once, come
    back: ``reuse`` evicts the newcomers first, always; ``adaptive`` learns from their
    returns that used-once objects are worth room, and lets a stale reused one go."""
    clock = FakeClock()
    t = tier(4, clock=clock, retention=policy)
    a, b = CHAIN.keys(2, seed=37)
    put(t, a)
    put(t, b)
    _reuse(t, clock, a)
    _reuse(t, clock, b)  # a, b: reused, and never used again below
    x1, x2, x3 = CHAIN.keys(3, seed=38)
    for k in (x1, x2, x3, x1, x2):  # x1, then x2, evicted as used once, come back
        clock.now += 1
        put(t, k)
    assert present(t, [a, b, x1, x2]) == [policy == "reuse", True, True, True]


def test_bad_policy_names_are_config_errors_naming_the_setting():
    with pytest.raises(ConfigError, match="retention must be one of reuse, adaptive, lru, got 'mru'"):
        tier(4, retention="mru")
    with pytest.raises(ConfigError, match="host_retention"):
        StoreConfig.from_mapping({"host_retention": "mru"}, env={})


@pytest.mark.parametrize("policy", POLICIES)
def test_host_retention_reaches_the_embedded_stores_host_tier(policy):
    async def main() -> RetentionPolicy:
        cfg = StoreConfig.from_mapping({"host_capacity": "1MiB"}, env={"KVSTORE_HOST_RETENTION": policy})
        store = await TieredStore.from_config(cfg)
        try:
            return store.host.retention  # type: ignore[attr-defined]
        finally:
            await store.aclose()

    assert asyncio.run(main()) is RetentionPolicy(policy)
