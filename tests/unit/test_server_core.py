"""ServerStore stories in one process: leases that pin slots, renewals, the reaper, tenants,
lookups and promotions, on a 4-slot shared pool and a fake clock (no gRPC, no sleeps).

Every object takes exactly one slot, so "the pool is full" and "a slot came back" are exact
byte counts.  Keys are the client's; the store holds them tenant-scoped (``scoped``).
"""

import asyncio

import numpy as np
import pytest

from kvstore.errors import LeaseError
from kvstore.server.auth import Permission, Principal
from kvstore.server.scoping import Scoper
from tests.kits.server_core import LEASE_TTL, SLOT, FakeClock, gauges, keys, make_store, put, put_lower, scoped, sealed
from tiers.base import PutResult
from tiers.ssd import SSDTier


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
async def pool(clock):
    store, host = make_store(clock)
    yield store, host
    await store.aclose()


@pytest.fixture
async def ssd_pool(clock, tmp_path):
    ssd = SSDTier(tmp_path / "ssd", 64 * SLOT, fsync=False)
    store, host = make_store(clock, lower=[ssd])
    yield store, host, ssd
    await store.aclose()


async def visible(store, ks, tenant="a") -> list[bool]:
    """Whether each key is visible to lookups, one by one."""
    return [bool((await store.lookup([scoped(k, tenant)]))[0]) for k in ks]


def slot_bytes(host, granted) -> bytes:
    return bytes(host.array[granted.offset : granted.offset + granted.length])


# --- a lease pins its slot ------------------------------------------------------------------


async def test_delete_hides_a_leased_object_but_its_bytes_stay_until_the_release(pool):
    store, host = pool
    a, b, c, d, e = keys(5)
    for i, key in enumerate((a, b, c, d)):
        assert await put(store, key, seed=i) is PutResult.STORED
    granted = await store.lease(scoped(a), "a", LEASE_TTL)
    assert (granted.length, granted.tier) == (SLOT, "host")
    before = slot_bytes(host, granted)
    for key in (b, c, d):  # leased too: nothing in the pool is evictable
        assert await store.lease(scoped(key), "a", LEASE_TTL) is not None

    assert await store.delete(scoped(a)) is True
    assert await store.lookup([scoped(a)]) == ([], [])  # hidden at once
    assert await store.lease(scoped(a), "a", LEASE_TTL) is None  # new reads miss
    assert gauges(store) | {"leases": 0} == {
        "leases": 0,
        "puts": 0,
        "bytes": 4 * SLOT,
        "refs": 4,
        "doomed": 1,
        "objects": 3,
    }
    assert await put(store, e) is PutResult.NO_ROOM  # its room stays taken
    assert slot_bytes(host, granted) == before  # its bytes stay put

    assert store.release_leases([granted.lease_id], "a") == [False]  # deleted: not vouched for
    assert gauges(store)["doomed"] == 0 and gauges(store)["bytes"] == 3 * SLOT
    assert await put(store, e) is PutResult.STORED  # fits exactly now


async def test_a_lease_keeps_its_object_from_eviction(pool):
    store, _ = pool
    leased, *rest = keys(9)
    assert await put(store, leased) is PutResult.STORED
    granted = await store.lease(scoped(leased), "a", LEASE_TTL)
    for key in rest:  # two pool-fulls of churn
        assert await put(store, key) is PutResult.STORED
    assert await store.lookup([scoped(leased)]) == (["host"], [SLOT])
    assert await visible(store, rest) == [False] * 5 + [True] * 3
    assert store.release_leases([granted.lease_id], "a") == [True]


async def test_a_pool_of_leased_objects_refuses_puts_until_one_is_released(pool):
    store, _ = pool
    *leased, extra = keys(5)
    leases = []
    for key in leased:
        assert await put(store, key) is PutResult.STORED
        leases.append((await store.lease(scoped(key), "a", LEASE_TTL)).lease_id)
    assert await put(store, extra) is PutResult.NO_ROOM
    assert store.release_leases(leases[:1], "a") == [True]
    assert await put(store, extra) is PutResult.STORED  # the released one went
    assert await visible(store, leased) == [False, True, True, True]


async def test_a_stream_read_holds_a_reference_not_a_lease(pool):
    store, _ = pool
    (key,) = keys(1)
    assert await put(store, key, seed=3) is PutResult.STORED
    view, tier = await store.acquire(scoped(key))
    assert tier == "host" and bytes(view[256:]) == bytes(sealed(key, seed=3)[256:])
    assert (gauges(store)["refs"], gauges(store)["leases"]) == (1, 0)
    assert await store.delete(scoped(key))
    assert gauges(store)["doomed"] == 1
    store.release(scoped(key), len(view))
    assert gauges(store) == {"leases": 0, "puts": 0, "bytes": 0, "refs": 0, "doomed": 0, "objects": 0}


# --- renewal, expiry and the reaper ---------------------------------------------------------


async def test_a_renewal_outlives_the_first_ttl_and_an_unrenewed_lease_expires(pool, clock):
    store, _ = pool
    a, b = keys(2)
    for key in (a, b):
        assert await put(store, key) is PutResult.STORED
    renewed = (await store.lease(scoped(a), "a", LEASE_TTL)).lease_id
    plain = (await store.lease(scoped(b), "a", LEASE_TTL)).lease_id
    for _ in range(4):  # twice the TTL, renewing every half TTL
        clock.advance(LEASE_TTL / 2)
        assert store.renew_lease(renewed, "a", LEASE_TTL) == LEASE_TTL
    store.reap()
    assert gauges(store)["leases"] == 1  # the plain one was reaped
    assert store.release_leases([renewed, plain], "a") == [True, False]
    with pytest.raises(LeaseError):
        store.renew_lease(plain, "a", LEASE_TTL)


async def test_an_expired_lease_still_pins_until_reaped_then_the_memory_comes_back(pool, clock):
    store, _ = pool
    *held, extra = keys(5)
    for key in held:
        assert await put(store, key) is PutResult.STORED
        assert await store.lease(scoped(key), "a", LEASE_TTL) is not None
    assert await store.delete(scoped(held[0]))  # doomed, still pinned
    clock.advance(LEASE_TTL - 0.001)
    store.reap()
    assert gauges(store)["leases"] == 4  # not yet
    clock.advance(0.001)
    assert await put(store, extra) is PutResult.NO_ROOM  # expired, but pinned
    store.reap()
    assert gauges(store) == {"leases": 0, "puts": 0, "bytes": 3 * SLOT, "refs": 0, "doomed": 0, "objects": 3}
    assert store.snapshot().leases_expired == 3  # the deleted object's lease ended with it
    assert await put(store, extra) is PutResult.STORED


async def test_renewing_an_expired_lease_fails_and_drops_its_pin_at_once(pool, clock):
    store, _ = pool
    (key,) = keys(1)
    assert await put(store, key) is PutResult.STORED
    lease = (await store.lease(scoped(key), "a", LEASE_TTL)).lease_id
    clock.advance(LEASE_TTL)
    with pytest.raises(LeaseError):
        store.renew_lease(lease, "a", LEASE_TTL)
    assert (gauges(store)["leases"], gauges(store)["refs"]) == (0, 0)  # no reaper pass needed
    assert store.release_leases([lease], "a") == [False]


async def test_renewing_a_deleted_objects_lease_fails_and_frees_its_slot(pool):
    store, _ = pool
    (key,) = keys(1)
    assert await put(store, key) is PutResult.STORED
    lease = (await store.lease(scoped(key), "a", LEASE_TTL)).lease_id
    assert await store.delete(scoped(key))
    with pytest.raises(LeaseError):
        store.renew_lease(lease, "a", LEASE_TTL)
    assert gauges(store) == {"leases": 0, "puts": 0, "bytes": 0, "refs": 0, "doomed": 0, "objects": 0}


async def test_stats_doc_reaps_first(pool, clock):
    store, _ = pool
    (key,) = keys(1)
    assert await put(store, key) is PutResult.STORED
    assert await store.lease(scoped(key), "a", LEASE_TTL) is not None
    clock.advance(LEASE_TTL)
    assert gauges(store)["leases"] == 1
    doc = store.stats_doc()
    assert (doc["leases"]["held"], doc["leases"]["expired"], doc["tiers"]["host"]["refs_held"]) == (0, 1, 0)


# --- releases in batches, and tenants ---------------------------------------------------------


async def test_one_release_call_answers_validity_per_lease(pool, clock):
    """Valid, expired, deleted, already released, unknown and another tenant's, in one call."""
    store, _ = pool
    ks = keys(4)
    for key in ks[:3]:
        assert await put(store, key) is PutResult.STORED
    assert await put(store, ks[3], tenant="b") is PutResult.STORED
    expired = (await store.lease(scoped(ks[0]), "a", LEASE_TTL / 2)).lease_id
    valid = (await store.lease(scoped(ks[0]), "a", LEASE_TTL)).lease_id
    deleted = (await store.lease(scoped(ks[1]), "a", LEASE_TTL)).lease_id
    twice = (await store.lease(scoped(ks[2]), "a", LEASE_TTL)).lease_id
    theirs = (await store.lease(scoped(ks[3], "b"), "b", LEASE_TTL)).lease_id
    assert store.release_leases([twice], "a") == [True]
    assert await store.delete(scoped(ks[1]))
    clock.advance(LEASE_TTL / 2)
    calls, released = store.metrics.counters.release_calls, store.metrics.counters.leases_released
    ids = [valid, expired, deleted, twice, 987654321, theirs]
    assert store.release_leases(ids, "a") == [True, False, False, False, False, False]
    c = store.metrics.counters
    assert (c.release_calls - calls, c.leases_released - released) == (1, 1)
    assert gauges(store)["leases"] == 1 and gauges(store)["refs"] == 1  # only b's lease is left
    assert store.release_leases([theirs], "b") == [True]


async def test_a_tenant_cannot_renew_or_release_another_tenants_lease(pool, clock):
    store, _ = pool
    (key,) = keys(1)
    assert await put(store, key, tenant="a") is PutResult.STORED
    lease = (await store.lease(scoped(key), "a", LEASE_TTL)).lease_id
    with pytest.raises(LeaseError):
        store.renew_lease(lease, "b", 100.0)
    assert store.release_leases([lease], "b") == [False]
    assert gauges(store)["leases"] == 1  # untouched by b
    clock.advance(LEASE_TTL)  # b's renewal did not count
    store.reap()
    assert gauges(store)["leases"] == 0 and store.release_leases([lease], "a") == [False]


async def test_tenants_see_only_their_own_objects(pool):
    """The same request bytes from two tenants' principals go through the servicer's own
    scoping (``Scoper``, as every RPC and the data channel do): b's lookup and lease of the
    key a stored miss, and b's put of it is a separate object."""
    store, _ = pool
    (key,) = keys(1)
    scope, perms = Scoper(), frozenset(Permission)
    raw = (bytes(key.namespace), bytes(key.chunk_hash), key.tag)  # what each client sends
    client_a, as_a = scope.keys(Principal("a", perms), *raw)
    client_b, as_b = scope.keys(Principal("b", perms), *raw)
    assert client_a == client_b == key and as_a != as_b
    assert await put(store, key, tenant="a", seed=1) is PutResult.STORED
    assert await store.lookup([as_a]) == (["host"], [SLOT])  # a finds it its own way
    assert await store.lease(as_b, "b", LEASE_TTL) is None
    assert await store.lookup([as_b]) == ([], [])
    assert await put(store, key, tenant="b", seed=2) is PutResult.STORED  # a separate object
    assert gauges(store)["objects"] == 2


# --- lookups and promotions -------------------------------------------------------------------


async def test_lookup_answers_the_contiguous_prefix_with_tiers_and_sizes(ssd_pool):
    store, _, ssd = ssd_pool
    ks = keys(6)
    sizes = [300, 1000, 2000, SLOT, 700]
    for i in (0, 1, 3):
        assert await put(store, ks[i], sizes[i]) is PutResult.STORED
    await put_lower(ssd, ks[2], sizes[2])
    await put_lower(ssd, ks[4], sizes[4])
    want = (["host", "host", "ssd", "host", "ssd"], sizes)
    assert await store.lookup([scoped(k) for k in ks]) == want
    assert await store.lookup([bytes(scoped(k)) for k in ks]) == want  # the servicer's raw bytes
    assert await store.delete(scoped(ks[1]))
    assert await store.lookup([scoped(k) for k in ks]) == (["host"], [300])
    c = store.metrics.counters
    assert (c.lookups, c.lookup_keys, c.lookup_hits) == (3, 18, {"host": 7, "ssd": 4})


async def test_a_get_promotes_from_ssd_into_the_pool_and_leases_it(ssd_pool):
    store, host, ssd = ssd_pool
    (key,) = keys(1)
    await put_lower(ssd, key, 3000, seed=7)
    assert await store.lookup([scoped(key)]) == (["ssd"], [3000])
    granted = await store.lease(scoped(key), "a", LEASE_TTL)
    assert (granted.tier, granted.length) == ("ssd", 3000)
    assert slot_bytes(host, granted) == bytes(sealed(scoped(key), 3000, seed=7))
    assert await store.lookup([scoped(key)]) == (["host"], [3000])
    assert (gauges(store)["leases"], gauges(store)["refs"]) == (1, 1)
    assert store.metrics.counters.promotions == {"ssd": 1}
    assert store.release_leases([granted.lease_id], "a") == [True]


async def test_concurrent_gets_share_one_promotion(ssd_pool):
    store, _, ssd = ssd_pool
    (key,) = keys(1)
    await put_lower(ssd, key)
    got = await asyncio.gather(*(store.lease(scoped(key), "a", LEASE_TTL) for _ in range(3)))
    assert {g.offset for g in got} == {got[0].offset} and {g.tier for g in got} == {"ssd"}
    assert store.metrics.counters.promotions == {"ssd": 1}
    assert store.release_leases([g.lease_id for g in got], "a") == [True] * 3
    assert gauges(store)["refs"] == 0


async def test_a_promotion_into_a_pool_of_leased_objects_is_a_miss(ssd_pool):
    store, _, ssd = ssd_pool
    *held, cold = keys(5)
    leases = []
    for key in held:
        assert await put(store, key) is PutResult.STORED
        leases.append((await store.lease(scoped(key), "a", LEASE_TTL)).lease_id)
    await put_lower(ssd, cold)
    assert await store.lease(scoped(cold), "a", LEASE_TTL) is None
    c = store.metrics.counters
    assert (c.failures, c.get_misses) == ({"promote_no_room": 1}, {"shm": 1})
    assert store.release_leases(leases[:1], "a") == [True]
    granted = await store.lease(scoped(cold), "a", LEASE_TTL)
    assert granted is not None and granted.tier == "ssd"


async def test_a_stream_read_promotes_too(ssd_pool):
    store, _, ssd = ssd_pool
    (key,) = keys(1)
    await put_lower(ssd, key, 2000, seed=4)
    view, tier = await store.acquire(scoped(key))
    assert tier == "ssd" and np.array_equal(np.frombuffer(view, np.uint8), sealed(scoped(key), 2000, 4))
    store.release(scoped(key), len(view))
    assert gauges(store)["refs"] == 0 and store.metrics.counters.gets == {("stream", "ssd"): 1}
