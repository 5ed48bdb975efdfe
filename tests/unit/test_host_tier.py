"""HostTier stories on a 16-page pool: exact slots, eviction order, protection, two-phase puts.

Objects are real (``kvstore.codec.encode_into``) with a geometry chosen so an object of
``n`` pages needs exactly ``n`` 4 KiB slot units.  The last test is a randomised concurrent
simulation checked against a plain dict model.
"""

import asyncio
import random
import sys
import threading

import numpy as np
import pytest

from kvstore.bench.lookup import host_index_overhead_bytes
from kvstore.codec import ObjectGeometry, encode_into, object_size
from kvstore.errors import CapacityError, ConfigError, LeaseError, TierUnavailableError
from kvstore.keys import ROOT, Identity
from tests.kits.chain import Chain
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier, SlotState

P = 4096
CHAIN = Chain(Identity("m", "r1", "bf16", "cpu:test", 2, 1, 8).namespace(), chunk_tokens=4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_obj(key, pages: int, parent_hash=ROOT) -> np.ndarray:
    """A sealed object of ``pages`` slot units whose payload depends on the key."""
    geo = ObjectGeometry(2, 2 * pages - 1, 1024)
    buf = np.empty(object_size(geo), np.uint8)
    seed = int.from_bytes(key[32:40], "little")
    payload = np.random.default_rng(seed).integers(0, 256, geo.payload_bytes, dtype=np.uint8)
    encode_into(buf, key, geo, payload, parent_hash)
    return buf


def put(tier: HostTier, key, pages: int = 1, parent=None) -> int | None:
    """Put a fresh object; the offset it landed at, or None when there was no room."""
    obj = make_obj(key, pages)
    handle = tier.put_start_sync(key, len(obj), parent)
    if handle is None:
        return None
    handle.buffer[:] = obj
    assert tier.put_commit_sync(handle)
    return handle.token.offset


def tier(pages: int = 16, **kw) -> HostTier:
    return HostTier(pages * P, pin=False, **kw)


def present(t: HostTier, keys) -> list[bool]:
    return [t.contains_sync(k) for k in keys]


# --- construction and placement -----------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -1, P - 1])
def test_bad_capacity_is_a_config_error(capacity):
    with pytest.raises(ConfigError):
        HostTier(capacity, pin=False)


@pytest.mark.parametrize("shared", [False, True])
def test_buffer_is_one_writable_uint8_region(shared):
    t = tier(shared=shared)
    assert t.buffer.format == "B" and t.buffer.ndim == 1 and not t.buffer.readonly
    assert t.buffer.nbytes == 16 * P and t.array.nbytes == 16 * P
    assert isinstance(t, Tier)
    assert (t.shm_path is not None) == shared
    t.close()


def test_buffer_is_pinned_exactly_when_cuda_is_present():
    import torch

    if torch.cuda.is_available():
        assert HostTier(4 * P).tensor.is_pinned()
        assert HostTier(4 * P, pin=False).tensor is None
    else:
        with pytest.raises(ConfigError):
            HostTier(4 * P, pin=True)
        assert HostTier(4 * P).tensor is None


def test_shared_pool_is_pinned_exactly_when_cuda_is_present():
    import torch

    t = HostTier(4 * P, shared=True)
    try:
        if torch.cuda.is_available():
            assert t.tensor.is_pinned() and t.tensor.data_ptr() == t.array.ctypes.data
        else:
            assert t.tensor is None
    finally:
        t.close()


def test_objects_land_first_fit_and_reuse_freed_holes():
    t = tier()
    a, b, c, d, e = CHAIN.keys(5)
    assert [put(t, a, 1), put(t, b, 2), put(t, c, 1)] == [0, P, 3 * P]
    assert t.delete_sync(b)
    assert put(t, d, 1) == P  # first hole fits
    assert put(t, e, 2) == 4 * P  # the 1-page hole at 2P is skipped
    assert t.stats().bytes_used == 5 * P
    assert t.stats().objects == 4


def test_oversize_object_is_a_capacity_error_and_exact_fit_is_not():
    t = tier(4)
    with pytest.raises(CapacityError):
        t.put_start_sync(CHAIN.keys(1)[0], 4 * P + 1)
    assert t.put_start_sync(CHAIN.keys(1)[0], 4 * P) is not None


def test_read_into_copies_exact_bytes_and_counts():
    t = tier()
    (k, missing) = CHAIN.keys(2)
    put(t, k, 3)
    out = np.zeros(4 * P, np.uint8)
    n = t.read_into_sync(k, out)
    assert n == len(make_obj(k, 3))
    assert np.array_equal(out[:n], make_obj(k, 3)) and not out[n:].any()
    assert t.read_into_sync(missing, out) is None
    with pytest.raises(ConfigError):
        t.read_into_sync(k, np.zeros(n - 1, np.uint8))
    s = t.stats()
    assert (s.hits, s.misses, s.bytes_read, s.bytes_written, s.puts) == (1, 1, n, n, 1)
    assert s.extra["refs_held"] == 0


def test_lookup_counts_only_the_contiguous_prefix():
    t = tier()
    keys = CHAIN.keys(5)
    for i in (0, 1, 3, 4):
        put(t, keys[i], parent=keys[i - 1] if i else None)
    assert t.lookup_sync(keys) == 2
    assert t.lookup_sync(keys[3:]) == 2
    assert t.lookup_sync([]) == 0


class CountingLock:
    """The tier's lock, counting acquisitions (how many times a batch call locks)."""

    def __init__(self) -> None:
        self._lock, self.acquired = threading.Lock(), 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.acquired += 1

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_sizes_answer_every_key_under_one_lock_without_touching_lru():
    t = tier(5)
    a, b, c, d, e, f = CHAIN.keys(6, seed=12)
    put(t, a, pages=1)
    put(t, b, pages=2, parent=a)
    put(t, d, pages=1)
    pending = t.put_start_sync(e, len(make_obj(e, 1)))  # reserved, not committed
    t.acquire(d)
    t.delete_sync(d)  # doomed: still referenced
    t._lock = lock = CountingLock()
    n_a, n_b = len(make_obj(a, 1)), len(make_obj(b, 2))
    assert t.sizes_sync([a, b, c, d, e, a]) == [n_a, n_b, None, None, None, n_a]
    assert lock.acquired == 1
    assert t.sizes_sync([bytes(b), bytes(c)]) == [n_b, None]  # canonical bytes find it too
    assert t.sizes_sync([]) == []
    assert asyncio.run(t.sizes([c, a])) == [None, n_a]
    assert lock.acquired == 4
    assert [t.size_of_sync(k) for k in (a, b, c, d, e)] == [n_a, n_b, None, None, None]
    assert t.stats().hits == 0  # sizes are not reads
    t.put_commit_sync(pending, False)
    t.release(d)
    lru = tier(3)
    for k in (a, b, c):
        put(lru, k)
    lru.sizes_sync([b, a])
    assert put(lru, f) == 0 and present(lru, [a, b, c]) == [False, True, True]  # a: still LRU


# --- eviction ---------------------------------------------------------------------------


def test_lease_and_acquire_count_as_use():
    t = tier(3)
    a, b, c, d, e = CHAIN.keys(5, seed=11)
    for k in (a, b, c):
        put(t, k)
    t.release_lease(t.lease(a, ttl=1).lease_id)
    t.acquire(b)
    t.release(b)
    assert put(t, d) == 2 * P and put(t, e) == 0  # c, then a
    assert present(t, [a, b, c]) == [False, True, False]


def test_lru_evicts_least_recently_used_first():
    t = tier(4)
    a, b, c, d, e, f = CHAIN.keys(6, seed=1)  # stored without parents: all leaves
    assert [put(t, k) for k in (a, b, c, d)] == [0, P, 2 * P, 3 * P]
    t.read_into_sync(a, np.zeros(P, np.uint8))  # a becomes most recent
    assert put(t, e) == P  # evicts b
    assert put(t, f) == 2 * P  # evicts c
    assert present(t, [a, b, c, d, e, f]) == [True, False, False, True, True, True]
    assert t.stats().evictions == 2


def test_chain_tails_are_evicted_before_their_parents():
    t = tier(4)
    k0, k1, k2 = CHAIN.keys(3)
    x, y, z, w = CHAIN.keys(4, seed=2)
    assert put(t, k0) == 0 and put(t, k1, parent=k0) == P and put(t, k2, parent=k1) == 2 * P
    assert put(t, x) == 3 * P
    assert put(t, y) == 2 * P  # k0 and k1 are older but have children: k2 goes
    assert put(t, z) == P  # now k1 is a tail and the oldest one
    assert put(t, w) == 0  # then k0
    assert present(t, [k0, k1, k2, x, y, z, w]) == [False, False, False, True, True, True, True]


def test_parent_is_evicted_only_when_no_tail_qualifies():
    t = tier(2)
    p, c = CHAIN.keys(2)
    (x,) = CHAIN.keys(1, seed=3)
    put(t, p)
    put(t, c, parent=p)
    assert t.acquire(c) is not None  # the only tail is referenced
    assert put(t, x) == 0  # so the parent goes
    assert present(t, [p, c, x]) == [False, True, True]
    t.release(c)


def test_eviction_coalesces_until_a_multi_page_hole_exists():
    t = tier(4)
    a, b, c, d, e = CHAIN.keys(5, seed=4)
    for k in (a, b, c, d):
        put(t, k)
    assert put(t, e, pages=2) == 0  # evicts a, then b; their holes merge
    assert present(t, [a, b, c, d, e]) == [False, False, True, True, True]
    assert t.stats().evictions == 2


def test_eviction_skips_protected_slots_and_keeps_going():
    t = tier(4)
    a, b, c, d, e = CHAIN.keys(5, seed=5)
    for k in (a, b, c, d):
        put(t, k)
    assert t.lease(b, ttl=60) is not None
    assert put(t, e, pages=2) == 2 * P  # a's hole cannot grow past leased b: a, c, d go
    assert present(t, [a, b, c, d, e]) == [False, True, False, False, True]
    assert t.stats().evictions == 3


def test_put_start_returns_none_when_everything_is_protected():
    clock = FakeClock()
    t = tier(4, clock=clock)
    a, b, c, d, e = CHAIN.keys(5, seed=6)
    for k in (a, b, d):
        put(t, k)
    lease_a = t.lease(a, ttl=10)
    assert t.acquire(b) is not None
    pending = t.put_start_sync(c, len(make_obj(c, 1)))  # incomplete: never evicted
    t.lease(d, ttl=10)
    assert t.put_start_sync(e, P) is None
    assert t.stats().evictions == 0 and pending.token.state is SlotState.PENDING
    t.release_lease(lease_a.lease_id)
    assert put(t, e) == 0  # now a may go
    assert present(t, [a, b, d, e]) == [False, True, True, True]


def test_lease_protects_only_until_it_expires():
    clock = FakeClock()
    t = tier(1, clock=clock)
    a, b = CHAIN.keys(2, seed=7)
    put(t, a)
    lease = t.lease(a, ttl=5)
    assert put(t, b) is None
    clock.now += 3
    assert t.renew_lease(lease.lease_id, ttl=5).expires_at == clock.now + 5
    clock.now += 4
    assert put(t, b) is None  # renewed lease still valid
    clock.now += 2
    with pytest.raises(LeaseError):
        t.check_lease(lease.lease_id)
    assert put(t, b) == 0
    assert t.stats().extra["leases_expired"] == 1


def test_expired_lease_does_not_free_a_referenced_buffer():
    clock = FakeClock()
    t = tier(1, clock=clock)
    a, b = CHAIN.keys(2, seed=8)
    put(t, a)
    t.lease(a, ttl=5)
    view = t.acquire(a)
    clock.now += 10
    extra = t.stats().extra
    assert (extra["leases_held"], extra["leases_expired"], extra["refs_held"]) == (0, 1, 1)
    assert t.put_start_sync(b, P) is None  # the reference still pins it
    assert bytes(view) == make_obj(a, 1).tobytes()
    t.release(a)
    assert put(t, b) == 0


def test_on_evict_sees_the_bytes_before_the_slot_is_freed():
    seen = []
    t = tier(1, on_evict=lambda key, view: seen.append((key, bytes(view))))
    a, b = CHAIN.keys(2, seed=9)
    put(t, a)
    put(t, b)
    assert seen == [(a, make_obj(a, 1).tobytes())]


# --- references and deletion ------------------------------------------------------------


def test_delete_while_referenced_hides_at_once_and_frees_at_last_release():
    t = tier(4)
    a, b, c = CHAIN.keys(3, seed=10)
    put(t, a, pages=2)
    v1, v2 = t.acquire(a), t.acquire(a)
    assert t.delete_sync(a) and not t.delete_sync(a)
    assert not t.contains_sync(a) and t.lookup_sync([a]) == 0 and t.acquire(a) is None
    assert t.read_into_sync(a, np.zeros(2 * P, np.uint8)) is None
    assert t.allocator.free_bytes == 2 * P
    assert t.put_start_sync(a, len(make_obj(a, 2))) is None  # old copy still referenced
    assert put(t, b, pages=2) == 2 * P
    assert put(t, c, pages=2) == 2 * P  # evicts b: a's slot stays taken
    t.release(a)
    assert t.stats().bytes_used == 4 * P and bytes(v1) == make_obj(a, 2).tobytes()
    t.release(a)
    assert t.stats().bytes_used == 2 * P and t.stats().extra["doomed"] == 0
    assert put(t, a, pages=2) == 0
    with pytest.raises(RuntimeError):
        t.release(b)
    del v2


def test_delete_drops_leases_of_the_object():
    t = tier()
    (a,) = CHAIN.keys(1)
    put(t, a)
    lease = t.lease(a, ttl=60)
    t.delete_sync(a)
    with pytest.raises(LeaseError):
        t.check_lease(lease.lease_id)
    assert t.lease(a, ttl=60) is None


def test_releasing_more_than_acquired_is_an_error():
    t = tier()
    (a,) = CHAIN.keys(1)
    put(t, a)
    t.acquire(a)
    t.release(a)
    with pytest.raises(RuntimeError):
        t.release(a)


# --- two-phase puts ---------------------------------------------------------------------


def test_incomplete_object_is_invisible_until_commit():
    t = tier()
    (a,) = CHAIN.keys(1)
    obj = make_obj(a, 1)
    h = t.put_start_sync(a, len(obj))
    h.buffer[:] = obj
    assert not t.contains_sync(a) and t.lookup_sync([a]) == 0 and t.size_of_sync(a) is None
    assert t.acquire(a) is None and t.lease(a, 1) is None
    assert t.read_into_sync(a, np.zeros(P, np.uint8)) is None
    assert t.put_start_sync(a, len(obj)) is None  # concurrent second writer
    assert t.put_commit_sync(h)
    assert t.size_of_sync(a) == len(obj)
    with pytest.raises(RuntimeError):
        t.put_commit_sync(h)


def test_failed_commit_leaves_nothing():
    t = tier()
    (a,) = CHAIN.keys(1)
    h = t.put_start_sync(a, len(make_obj(a, 2)))
    h.buffer[:] = make_obj(a, 2)
    assert t.put_commit_sync(h, ok=False) is False
    s = t.stats()
    assert (s.objects, s.bytes_used, s.put_failures, s.puts) == (0, 0, 1, 0)
    assert not t.contains_sync(a) and t.slots() == []
    assert put(t, a) == 0


@pytest.mark.parametrize("case", ["other_key", "longer", "shorter", "garbage", "tiny"])
def test_commit_rejects_a_header_that_does_not_match_the_handle(case):
    t = tier()
    a, b = CHAIN.keys(2)
    obj = make_obj(b if case == "other_key" else a, 1)
    size = {"longer": len(obj) + 8, "shorter": len(obj) - 8, "tiny": 100}.get(case, len(obj))
    h = t.put_start_sync(a, size)
    n = min(size, len(obj))
    h.buffer[:n] = obj[:n]
    if case == "garbage":
        h.buffer[4:8] = b"\xff\xff\xff\xff"
    assert t.put_commit_sync(h) is False
    assert t.stats().bytes_used == 0 and not t.contains_sync(a) and not t.contains_sync(b)


def test_put_of_a_stored_key_keeps_the_stored_copy():
    t = tier()
    (a,) = CHAIN.keys(1)
    assert put(t, a) == 0
    obj = make_obj(a, 1)
    h = t.put_start_sync(a, len(obj))
    assert h is not None and h.token.offset == P
    h.buffer[:] = obj
    assert t.put_commit_sync(h)
    assert t.slots() == [(a, 0, len(obj), SlotState.LIVE)]
    assert t.stats().puts == 1 and t.stats().bytes_used == P


def test_async_protocol_through_put_bytes():
    async def story():
        async with tier() as t:
            a, b = CHAIN.keys(2)
            obj = make_obj(a, 2)
            assert await put_bytes(t, a, memoryview(obj)) is PutResult.STORED
            assert await put_bytes(t, a, memoryview(obj)) is PutResult.EXISTS
            assert await t.lookup([a, b]) == 1 and await t.size_of(a) == len(obj)
            out = np.zeros(len(obj), np.uint8)
            assert await t.read_into(a, out) == len(obj) and np.array_equal(out, obj)
            h = await t.put_start(b, len(make_obj(b, 1)), parent=a)
            await t.put_write(h, 0, make_obj(b, 1))
            assert await t.put_commit(h) and await t.delete(b)
        with pytest.raises(TierUnavailableError):
            await t.put_start(b, P)

    asyncio.run(story())


# --- per-object overhead ----------------------------------------------------------------


def test_index_overhead_per_object_is_small():
    per_object = host_index_overhead_bytes(5_000)
    print(f"host index overhead: {per_object:.0f} bytes/object")
    assert per_object < 300


# --- randomised concurrent simulation -----------------------------------------------------


class Model:
    """What must hold, kept by the test threads: pins and leases they know they hold."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.lock = threading.Lock()  # guards pins, leases, violations (never held across tier calls)
        self.pins: dict = {}
        self.leases: dict[int, tuple] = {}  # lease id -> (key, expires_at)
        self.deletes: dict = {}  # key -> [started, finished]: a lease granted across one may be dropped
        self.violations: list[str] = []

    def protected(self, key) -> bool:
        now = self.clock()
        return self.pins.get(key, 0) > 0 or any(k == key and now < exp for k, exp in self.leases.values())

    def on_evict(self, key, view) -> None:
        with self.lock:
            if self.protected(key):
                self.violations.append(
                    f"evicted protected {key!r}: pins {self.pins.get(key)}, "
                    f"leases {[v for v in self.leases.values() if v[0] == key]}"
                )
            if not np.array_equal(np.frombuffer(view, np.uint8), OBJS[key]):
                self.violations.append(f"evicted {key!r} with wrong bytes")


class SimClock(FakeClock):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self.now += 0.001


SIM_KEYS = CHAIN.keys(12, seed=99)
OBJS = {k: make_obj(k, 1 + i * 7 % 3) for i, k in enumerate(SIM_KEYS)}
PARENT = {k: (SIM_KEYS[i - 1] if i else None) for i, k in enumerate(SIM_KEYS)}


class Worker:
    def __init__(self, t: HostTier, model: Model, seed: int) -> None:
        self.t, self.m, self.rng = t, model, random.Random(seed)
        self.views: list = []  # (key, view) acquired
        self.lease_ids: list[int] = []
        self.out = np.zeros(4 * P, np.uint8)

    def run(self, ops: int) -> None:
        try:
            self._run(ops)
        except Exception as err:  # a thread's exception must fail the test, not just warn
            self.m.violations.append(f"worker raised {err!r}")

    def _run(self, ops: int) -> None:
        actions = (
            [self.put] * 6
            + [self.read] * 5
            + [self.acquire, self.unpin, self.lease, self.unlease, self.lookup] * 2
            + [self.delete]
        )
        for _ in range(ops):
            self.m.clock.tick()
            self.rng.choice(actions)(self.rng.choice(SIM_KEYS))
        while self.views:
            self.unpin(None)
        while self.lease_ids:
            self.unlease(None)

    def put(self, key) -> None:
        obj, mode = OBJS[key], self.rng.choice(["ok"] * 7 + ["abort", "corrupt"])
        h = self.t.put_start_sync(key, len(obj), PARENT[key])
        if h is None:
            return
        h.buffer[:] = obj
        if mode == "corrupt":
            h.buffer[0] ^= 0xFF
        published = self.t.put_commit_sync(h, ok=mode != "abort")
        if mode != "ok" and published:
            self.m.violations.append(f"{mode} put of {key!r} was published")

    def read(self, key) -> None:
        n = self.t.read_into_sync(key, self.out)
        if n is not None and not np.array_equal(self.out[:n], OBJS[key]):
            self.m.violations.append(f"read of {key!r} returned wrong bytes")

    def acquire(self, key) -> None:
        view = self.t.acquire(key)
        if view is not None:
            with self.m.lock:
                self.m.pins[key] = self.m.pins.get(key, 0) + 1
            self.views.append((key, view))

    def unpin(self, _key) -> None:
        if not self.views:
            return
        key, view = self.views.pop(self.rng.randrange(len(self.views)))
        if not np.array_equal(np.frombuffer(view, np.uint8), OBJS[key]):
            self.m.violations.append(f"pinned {key!r} was overwritten")
        with self.m.lock:
            self.m.pins[key] -= 1
        self.t.release(key)

    def lease(self, key) -> None:
        with self.m.lock:
            started, finished = self.m.deletes.setdefault(key, [0, 0])
        lease = self.t.lease(key, ttl=self.rng.choice([0.002, 0.02, 1.0]))
        if lease is not None:
            with self.m.lock:
                valid = started == finished == self.m.deletes[key][0]
                self.m.leases[lease.lease_id] = (key, lease.expires_at if valid else float("-inf"))
            self.lease_ids.append(lease.lease_id)

    def unlease(self, _key) -> None:
        if not self.lease_ids:
            return
        lease_id = self.lease_ids.pop(self.rng.randrange(len(self.lease_ids)))
        if self.rng.random() < 0.3 and self.renew(lease_id):
            self.lease_ids.append(lease_id)
            return
        with self.m.lock:
            del self.m.leases[lease_id]
        self.t.release_lease(lease_id)

    def renew(self, lease_id: int) -> bool:
        with self.m.lock:  # may shorten the lease: lower the model's expiry before the tier's
            key, exp = self.m.leases[lease_id]
            self.m.leases[lease_id] = (key, min(exp, self.m.clock() + 0.01))
        try:
            self.t.renew_lease(lease_id, ttl=0.01)
            return True
        except LeaseError:
            return False

    def lookup(self, key) -> None:
        i = SIM_KEYS.index(key)
        n = self.t.lookup_sync(SIM_KEYS[i:])
        assert 0 <= n <= len(SIM_KEYS) - i

    def delete(self, key) -> None:
        with self.m.lock:  # void the model's leases first: delete drops them
            self.m.deletes.setdefault(key, [0, 0])[0] += 1
            for lid, (k, _) in list(self.m.leases.items()):
                if k == key:
                    self.m.leases[lid] = (k, float("-inf"))
        self.t.delete_sync(key)
        with self.m.lock:
            self.m.deletes[key][1] += 1


def check_slots(t: HostTier) -> None:
    slots = sorted(t.slots(), key=lambda s: s[1])
    for (_, off, size, _), (_, nxt, _, _) in zip(slots, slots[1:]):
        assert off + t.allocator.aligned(size) <= nxt, "overlapping slots"


@pytest.mark.parametrize("seed, shared", [(1, False), (2, False), (3, False), (4, True)])
def test_concurrent_simulation_against_a_dict_model(seed, shared):
    clock = SimClock()
    model = Model(clock)
    t = tier(16, clock=clock, on_evict=model.on_evict, shared=shared)
    workers = [Worker(t, model, seed * 100 + i) for i in range(4)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=w.run, args=(1500,)) for w in workers]
        for th in threads:
            th.start()
        for _ in range(50):
            check_slots(t)
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert model.violations == []
    check_slots(t)
    s = t.stats()
    assert (s.extra["refs_held"], s.extra["doomed"], s.extra["pending"]) == (0, 0, 0)
    assert s.evictions > 0 and s.puts > 0 and s.put_failures > 0
    slots = t.slots()
    assert all(state is SlotState.LIVE for *_, state in slots)
    assert s.bytes_used == sum(t.allocator.aligned(size) for _, _, size, _ in slots)
    assert s.bytes_used + sum(n for _, n in t.allocator.holes()) == t.allocator.capacity
    for key, _, size, _ in slots:
        out = np.zeros(size, np.uint8)
        assert t.read_into_sync(key, out) == size and np.array_equal(out, OBJS[key])
    t.close()
