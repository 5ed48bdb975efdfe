"""Session hints over the host tier's retention order (``tiers.retention.Hints``, through
``HostTier.hint_sync``): released objects go first, pinned ones last, pins stay within half
the pool, a hint on an object not yet published waits for it, and a hint never evicts what
is held.  Real ``HostTier``s on small pools; under 1 s."""

from test_host_tier import CHAIN, put, tier

from tiers.retention import Hint


def test_released_objects_go_before_older_ones_and_pinned_ones_after_newer_ones():
    t = tier(4)
    a, b, c, d, e, f = CHAIN.keys(6, seed=41)  # no parents: every one a tail
    for k in (a, b, c, d):
        put(t, k)
    t.hint_sync([d], Hint.RELEASED)  # the newest, released: first to go
    t.hint_sync([a], Hint.PINNED)  # the oldest, pinned: last to go
    put(t, e)
    assert [t.contains_sync(k) for k in (a, b, c, d, e)] == [True, True, True, False, True]
    put(t, f)  # then the policy's order, without the pinned a
    assert [t.contains_sync(k) for k in (a, b, c, e, f)] == [True, False, True, True, True]


def test_a_pin_undone_puts_the_object_back_in_the_policys_order():
    t = tier(3)
    a, b, c, d = CHAIN.keys(4, seed=42)
    for k in (a, b, c):
        put(t, k)
    t.hint_sync([a], Hint.PINNED)
    t.hint_sync([a], Hint.NONE)
    put(t, d)  # a is the least recently used again
    assert [t.contains_sync(k) for k in (a, b, c, d)] == [False, True, True, True]


def test_pins_stay_within_half_the_pool_the_oldest_pin_going_first():
    t = tier(4)
    a, b, c, d, e = CHAIN.keys(5, seed=43)
    for k in (a, b, c, d):
        put(t, k)
    t.hint_sync([a, b, c], Hint.PINNED)  # three pages pinned in a four-page pool: a loses its pin
    pool = t._pools[""]
    assert list(pool.hints.pinned) == [b, c] and pool.hints.pinned_bytes <= pool.hints.pin_limit
    put(t, e)
    assert [t.contains_sync(k) for k in (a, b, c, d, e)] == [False, True, True, True, True]


def test_a_hint_on_an_object_not_yet_published_applies_when_it_is():
    t = tier(3)
    a, b, c, d = CHAIN.keys(4, seed=44)
    t.hint_sync([c], Hint.RELEASED)  # c is still being saved
    for k in (a, b, c):
        put(t, k)
    put(t, d)
    assert [t.contains_sync(k) for k in (a, b, c, d)] == [True, True, False, True]


def test_a_released_object_that_is_held_is_not_evicted_and_deletes_forget_hints():
    t = tier(2)
    a, b, c = CHAIN.keys(3, seed=45)
    put(t, a)
    put(t, b)
    t.hint_sync([a, b], Hint.RELEASED)
    assert t.acquire(a) is not None  # a reader holds a
    put(t, c)  # b goes: a is released but held
    assert [t.contains_sync(k) for k in (a, b, c)] == [True, False, True]
    t.release(a)
    assert t.delete_sync(a)
    pool = t._pools[""]
    assert a not in pool.hints.released and b not in pool.hints.released
