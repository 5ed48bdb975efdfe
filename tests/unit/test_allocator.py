"""SlotAllocator: first fit, alignment, coalescing, double frees (pure bookkeeping)."""

import random

import pytest

from kvstore.errors import ConfigError
from tiers.allocator import SlotAllocator

P = 4096


def test_first_fit_hands_out_lowest_offsets_in_order():
    a = SlotAllocator(16 * P)
    assert [a.alloc(n * P) for n in (1, 2, 1, 4)] == [0, P, 3 * P, 4 * P]
    assert a.used_bytes == 8 * P
    assert a.free_bytes == 8 * P
    assert a.holes() == [(8 * P, 8 * P)]


def test_sizes_round_up_to_alignment_and_remember_requested_size():
    a = SlotAllocator(16 * P)
    assert a.alloc(1) == 0
    assert a.alloc(P + 1) == P
    assert a.alloc(P) == 3 * P
    assert a.used_bytes == 4 * P
    assert (a.size_of(0), a.size_of(P), a.size_of(2 * P)) == (1, P + 1, 0)


@pytest.mark.parametrize(
    "capacity, alignment, usable",
    [
        (16 * P, P, 16 * P),
        (16 * P + 100, P, 16 * P),
        (1000, 256, 768),
        (7, 1, 7),
    ],
)
def test_capacity_is_rounded_down_to_alignment(capacity, alignment, usable):
    a = SlotAllocator(capacity, alignment)
    assert a.capacity == usable
    assert a.alloc(usable) == 0
    assert a.alloc(1) is None


@pytest.mark.parametrize("capacity, alignment", [(0, P), (-P, P), (P - 1, P), (P, 0)])
def test_bad_configuration_is_a_config_error(capacity, alignment):
    with pytest.raises(ConfigError):
        SlotAllocator(capacity, alignment)


def test_zero_size_allocation_is_rejected():
    with pytest.raises(ConfigError):
        SlotAllocator(4 * P).alloc(0)


def test_first_fit_skips_holes_that_are_too_small():
    a = SlotAllocator(16 * P)
    offs = [a.alloc(P) for _ in range(8)]
    a.free(offs[1])  # 1-page hole at P
    a.free(offs[4])
    a.free(offs[5])  # 2-page hole at 4P
    assert a.alloc(2 * P) == 4 * P
    assert a.alloc(P) == P
    assert a.alloc(9 * P) is None
    assert a.alloc(8 * P) == 8 * P
    assert a.free_bytes == 0 and a.holes() == []


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2), (2, 0, 1), (1, 2, 0)])
def test_free_coalesces_with_both_neighbours_in_any_order(order):
    a = SlotAllocator(4 * P)
    offs = [a.alloc(P) for _ in range(4)]
    for i in order:
        a.free(offs[i])
    assert a.holes() == [(0, 3 * P)]
    assert a.largest_free() == 3 * P
    assert a.alloc(3 * P) == 0


def test_free_returns_length_of_the_coalesced_hole():
    a = SlotAllocator(8 * P)
    offs = [a.alloc(P) for _ in range(8)]
    assert a.free(offs[2]) == P
    assert a.free(offs[4]) == P
    assert a.free(offs[3]) == 3 * P
    assert a.holes() == [(2 * P, 3 * P)]


@pytest.mark.parametrize("offset", [0, P, 100, -P, 64 * P])
def test_double_free_or_unknown_offset_raises(offset):
    a = SlotAllocator(16 * P)
    a.alloc(P)
    if offset == 0:
        a.free(0)
    with pytest.raises(RuntimeError):
        a.free(offset)


def test_largest_free_tracks_fragmentation():
    a = SlotAllocator(8 * P)
    offs = [a.alloc(P) for _ in range(8)]
    assert a.largest_free() == 0
    for i in (0, 2, 3, 6):
        a.free(offs[i])
    assert a.largest_free() == 2 * P
    assert a.holes() == [(0, P), (2 * P, 2 * P), (6 * P, P)]


def test_random_alloc_free_matches_a_page_map_model():
    rng = random.Random(1234)
    a = SlotAllocator(64 * P)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randint(1, 6 * P)
            off = a.alloc(size)
            pages = -(-size // P)
            if off is not None:
                live[off] = pages * P
        _check_against_model(a, live)


def _check_against_model(a: SlotAllocator, live: dict[int, int]) -> None:
    used = [False] * (a.capacity // P)
    for off, length in live.items():
        for page in range(off // P, (off + length) // P):
            assert not used[page], "overlapping slots"
            used[page] = True
    holes = a.holes()
    for (s1, l1), (s2, _) in zip(holes, holes[1:]):
        assert s1 + l1 < s2, "adjacent holes were not coalesced"
    for off, length in holes:
        assert not any(used[off // P : (off + length) // P])
    assert a.used_bytes == sum(live.values())
    assert a.used_bytes + sum(n for _, n in holes) == a.capacity


def test_shrink_keeps_the_slot_and_frees_whole_units_past_its_new_end():
    P = 4096
    a = SlotAllocator(8 * P)
    off = a.alloc(3 * P + 28)
    a.shrink(off, 3 * P + 10)  # same units: only the size changes
    assert a.size_of(off) == 3 * P + 10 and a.used_bytes == 4 * P
    a.shrink(off, 3 * P)  # a unit freed, merged with the hole after it
    assert a.used_bytes == 3 * P and a.holes() == [(3 * P, 5 * P)]
    with pytest.raises(RuntimeError, match="shrink"):
        a.shrink(off, 3 * P + 1)
    assert a.free(off) == 8 * P
