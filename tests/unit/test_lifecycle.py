"""Transfer lifecycle (docs/architecture.md#completion-moments): one transition table,
drained cancellation, leases on a fake clock.

The story: a load walks LOOKED_UP → … → RELEASED and a save GATHER_ISSUED → … → RELEASED;
anything off the table raises.  A cancelled or failed ticket is released only after the
copies it started have finished, and a lease running out (which protects the object in its
tier) never stands in for that buffer protection.
"""

from __future__ import annotations

import pytest

from kvstore.errors import LeaseError, LifecycleError
from kvstore.lifecycle import TRANSITIONS, LeaseTable, LoadState, SaveState, Ticket, is_legal, load_ticket, save_ticket

L, S = LoadState, SaveState


class FakeClock:
    """Time moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ticket_at(path: list, **kw) -> Ticket:
    """A ticket driven along ``path`` (first element is its initial state)."""
    ticket = Ticket(path[0], **kw)
    for state in path[1:]:
        ticket.advance(state)
    return ticket


LOAD_PATH = [L.LOOKED_UP, L.READABLE, L.IN_BUFFER, L.ON_DEVICE, L.CONSUMABLE, L.RELEASED]
SAVE_PATH = [S.GATHER_ISSUED, S.SNAPSHOT_DONE, S.STORED, S.PERSISTED, S.RELEASED]


# ---- the table -----------------------------------------------------------------------------

LEGAL = [
    *zip(LOAD_PATH, LOAD_PATH[1:]),
    *((s, abort) for s in LOAD_PATH[:4] for abort in (L.FAILED, L.CANCELLED)),
    (L.FAILED, L.RELEASED),
    (L.CANCELLED, L.RELEASED),
    *zip(SAVE_PATH, SAVE_PATH[1:]),
    (S.PERSISTED, S.PERSISTED),  # persisted to one more tier
    (S.SNAPSHOT_DONE, S.RELEASED),
    (S.STORED, S.RELEASED),
    *((s, abort) for s in SAVE_PATH[:2] for abort in (S.FAILED, S.CANCELLED)),
    (S.FAILED, S.RELEASED),
    (S.CANCELLED, S.RELEASED),
]

ILLEGAL = [
    (L.LOOKED_UP, L.IN_BUFFER),
    (L.LOOKED_UP, L.ON_DEVICE),
    (L.LOOKED_UP, L.CONSUMABLE),
    (L.LOOKED_UP, L.RELEASED),
    (L.READABLE, L.ON_DEVICE),
    (L.IN_BUFFER, L.CONSUMABLE),
    (L.IN_BUFFER, L.READABLE),
    (L.ON_DEVICE, L.IN_BUFFER),
    (L.CONSUMABLE, L.ON_DEVICE),
    (L.CONSUMABLE, L.FAILED),
    (L.CONSUMABLE, L.CANCELLED),
    (L.READABLE, L.READABLE),
    (L.FAILED, L.CANCELLED),
    (L.CANCELLED, L.FAILED),
    (L.FAILED, L.READABLE),
    (L.CANCELLED, L.CONSUMABLE),
    *((L.RELEASED, s) for s in LoadState),
    (S.GATHER_ISSUED, S.STORED),
    (S.GATHER_ISSUED, S.RELEASED),
    (S.SNAPSHOT_DONE, S.PERSISTED),
    (S.STORED, S.FAILED),
    (S.STORED, S.CANCELLED),
    (S.PERSISTED, S.FAILED),
    (S.PERSISTED, S.STORED),
    (S.FAILED, S.STORED),
    (S.CANCELLED, S.SNAPSHOT_DONE),
    *((S.RELEASED, s) for s in SaveState),
]


def test_the_table_has_every_state_and_never_mixes_load_and_save():
    assert set(TRANSITIONS) == set(LoadState) | set(SaveState)
    for src, dsts in TRANSITIONS.items():
        assert all(type(dst) is type(src) for dst in dsts)
    assert TRANSITIONS[L.RELEASED] == frozenset() == TRANSITIONS[S.RELEASED]


def test_the_tables_of_cases_agree_with_each_other():
    assert not set(LEGAL) & set(ILLEGAL)


@pytest.mark.parametrize("src, dst", LEGAL, ids=lambda s: s.name)
def test_legal_transitions_pass(src, dst):
    assert is_legal(src, dst)
    ticket = Ticket(src)
    ticket.advance(dst)
    assert ticket.state is dst


@pytest.mark.parametrize("src, dst", ILLEGAL, ids=lambda s: s.name)
def test_illegal_transitions_raise_and_leave_the_ticket_unchanged(src, dst):
    assert not is_legal(src, dst)
    ticket = Ticket(src)
    with pytest.raises(LifecycleError):
        ticket.advance(dst)
    assert ticket.state is src and len(ticket.history) == 1


@pytest.mark.parametrize("src, dst", [(L.LOOKED_UP, S.SNAPSHOT_DONE), (S.STORED, L.RELEASED)])
def test_load_and_save_states_never_cross(src, dst):
    with pytest.raises(LifecycleError):
        Ticket(src).advance(dst)


def test_a_load_walks_the_whole_path_and_releases_once():
    released = []
    ticket = load_ticket("req-1/chunk-0", on_release=released.append)
    for state in LOAD_PATH[1:-1]:
        ticket.advance(state)
    assert ticket.release() is True
    assert ticket.state is L.RELEASED and released == [ticket]
    assert ticket.release() is True and released == [ticket]  # idempotent, no second callback


def test_a_save_walks_gather_snapshot_stored_persisted_released():
    released = []
    ticket = save_ticket("req-1/chunk-0", on_release=released.append)
    assert ticket.state is S.GATHER_ISSUED
    for state in SAVE_PATH[1:-1]:
        ticket.advance(state)
    ticket.advance(S.PERSISTED)  # a second, lower tier
    assert ticket.release() and ticket.state is S.RELEASED and released == [ticket]


def test_a_stored_save_cannot_fail_any_more():
    ticket = ticket_at(SAVE_PATH[:3])
    with pytest.raises(LifecycleError):
        ticket.fail("redis down")
    with pytest.raises(LifecycleError):
        ticket.advance(S.FAILED)
    assert ticket.state is S.STORED and ticket.error is None


@pytest.mark.parametrize(
    "path", [LOAD_PATH[:1], LOAD_PATH[:3], SAVE_PATH[:1]], ids=["looked_up", "in_buffer", "gather_issued"]
)
def test_releasing_an_unfinished_ticket_raises(path):
    ticket = ticket_at(path)
    with pytest.raises(LifecycleError):
        ticket.release()
    assert ticket.state is path[-1]


def test_fail_and_cancel_record_a_reason_and_are_idempotent():
    ticket = ticket_at(LOAD_PATH[:3])
    ticket.fail("checksum mismatch")
    ticket.cancel("request aborted")  # already aborted: no change
    assert ticket.state is L.FAILED and ticket.error == "checksum mismatch"
    assert [s for s, _ in ticket.history] == [*LOAD_PATH[:3], L.FAILED]


def test_a_released_ticket_cannot_be_failed_or_cancelled():
    ticket = ticket_at(LOAD_PATH)
    for abort in (ticket.fail, ticket.cancel):
        with pytest.raises(LifecycleError):
            abort("late")
    assert ticket.state is L.RELEASED


# ---- cancellation drains before release ---------------------------------------------------


def test_a_cancelled_ticket_is_released_only_after_its_copy_ends():
    released = []
    ticket = ticket_at(LOAD_PATH[:3], on_release=released.append)
    ticket.begin_copy()  # host→device copy in flight, reading our staging buffer
    ticket.cancel("request aborted")
    assert ticket.state is L.CANCELLED and not ticket.drained and ticket.inflight == 1
    assert ticket.release() is False
    assert ticket.release() is False
    assert released == [] and ticket.state is L.CANCELLED
    with pytest.raises(LifecycleError):
        ticket.begin_copy()  # no new copy after cancel
    assert ticket.inflight == 1
    ticket.end_copy()
    assert ticket.drained
    assert ticket.release() is True
    assert ticket.state is L.RELEASED and released == [ticket]
    assert ticket.release() is True and released == [ticket]


def test_several_copies_must_all_end_before_release():
    released = []
    ticket = ticket_at(LOAD_PATH[:4], on_release=released.append)
    ticket.begin_copy()
    ticket.begin_copy()
    ticket.fail("device error")
    ticket.end_copy()
    assert ticket.release() is False and released == []
    ticket.end_copy()
    assert ticket.release() is True and released == [ticket]


def test_a_consumable_ticket_with_a_copy_in_flight_is_not_released_either():
    ticket = ticket_at(LOAD_PATH[:5])
    ticket.begin_copy()
    assert ticket.release() is False and ticket.state is L.CONSUMABLE
    ticket.end_copy()
    assert ticket.release() is True


def test_end_copy_without_begin_copy_is_a_broken_invariant():
    ticket = load_ticket()
    with pytest.raises(RuntimeError):
        ticket.end_copy()


def test_no_copy_begins_on_a_released_ticket():
    ticket = ticket_at(LOAD_PATH)
    with pytest.raises(LifecycleError):
        ticket.begin_copy()


# ---- timestamps ----------------------------------------------------------------------------


def test_each_transition_is_timestamped_on_the_clock():
    clock = FakeClock(1000.0)
    ticket = load_ticket("t", clock=clock)
    steps = [(L.READABLE, 0.5), (L.IN_BUFFER, 2.0), (L.ON_DEVICE, 0.25), (L.CONSUMABLE, 1.0)]
    for state, seconds in steps:
        clock.advance(seconds)
        ticket.advance(state)
    clock.advance(4.0)
    ticket.release()
    assert ticket.history == [
        (L.LOOKED_UP, 1000.0),
        (L.READABLE, 1000.5),
        (L.IN_BUFFER, 1002.5),
        (L.ON_DEVICE, 1002.75),
        (L.CONSUMABLE, 1003.75),
        (L.RELEASED, 1007.75),
    ]
    assert ticket.durations() == {
        "READABLE": 0.5,
        "IN_BUFFER": 2.0,
        "ON_DEVICE": 0.25,
        "CONSUMABLE": 1.0,
        "RELEASED": 4.0,
    }


def test_an_aborted_ticket_times_its_drain():
    clock = FakeClock(0.0)
    ticket = ticket_at(LOAD_PATH[:2], clock=clock)
    ticket.begin_copy()
    clock.advance(3.0)
    ticket.cancel()
    clock.advance(2.0)
    assert ticket.release() is False  # a refused release leaves no timestamp
    clock.advance(5.0)
    ticket.end_copy()
    ticket.release()
    assert ticket.durations() == {"READABLE": 0.0, "CANCELLED": 3.0, "RELEASED": 7.0}
    assert [t for _, t in ticket.history] == [0.0, 0.0, 3.0, 10.0]


# ---- leases --------------------------------------------------------------------------------

KEY_A, KEY_B = b"object-a", b"object-b"


def test_grant_check_release():
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    lease = leases.grant(KEY_A, ttl=10.0)
    assert lease.expires_at == 1010.0 and lease.key == KEY_A
    assert leases.check(lease.lease_id) is lease
    assert leases.held(KEY_A) and not leases.held(KEY_B) and len(leases) == 1
    assert leases.release_lease(lease.lease_id) is True
    assert lease.released and not lease.valid(clock())
    assert not leases.held(KEY_A) and len(leases) == 0
    assert leases.release_lease(lease.lease_id) is False
    with pytest.raises(LeaseError):
        leases.check(lease.lease_id)
    assert leases.expired_total == 0


def test_a_lease_expires_exactly_at_its_ttl():
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    lease = leases.grant(KEY_A, ttl=5.0)
    clock.advance(4.999)
    assert leases.check(lease.lease_id) is lease and leases.held(KEY_A)
    clock.advance(0.001)
    assert not lease.valid(clock())
    with pytest.raises(LeaseError):
        leases.check(lease.lease_id)
    assert not leases.held(KEY_A) and len(leases) == 0
    assert leases.expired_total == 1
    assert leases.sweep() == 0 and leases.expired_total == 1  # counted once
    assert leases.release_lease(lease.lease_id) is False


def test_renew_extends_from_now():
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    lease = leases.grant(KEY_A, ttl=5.0)
    clock.advance(4.0)
    assert leases.renew(lease.lease_id, ttl=5.0).expires_at == 1009.0
    clock.advance(4.0)  # past the original expiry (1005)
    assert leases.check(lease.lease_id) is lease and leases.held(KEY_A)
    assert leases.expired_total == 0
    clock.advance(1.0)
    assert not leases.held(KEY_A) and leases.expired_total == 1
    with pytest.raises(LeaseError):
        leases.renew(lease.lease_id, ttl=5.0)  # too late: an expired lease stays expired


def test_the_expiry_heap_is_bounded_by_live_leases_however_often_they_are_renewed():
    """200,000 renewals of one lease once left 200,000 heap entries (issue 12)."""
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    lease = leases.grant(KEY_A, ttl=5.0)
    for _ in range(200_000):
        leases.renew(lease.lease_id, ttl=5.0)
    assert leases.heap_size <= 2 * len(leases) + 64
    granted = [leases.grant(KEY_B, ttl=1.0) for _ in range(1000)]
    for g in granted:
        leases.release_lease(g.lease_id)
    leases.grant(KEY_B, ttl=1.0)
    assert leases.heap_size <= 2 * len(leases) + 64
    clock.advance(2.0)
    assert leases.held(KEY_A) and not leases.held(KEY_B)  # expiries still right after compaction
    clock.advance(4.0)
    assert not leases.held(KEY_A) and len(leases) == 0


def test_renew_can_shorten_a_lease():
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    lease = leases.grant(KEY_A, ttl=100.0)
    leases.renew(lease.lease_id, ttl=2.0)
    clock.advance(2.0)
    assert not leases.held(KEY_A) and leases.expired_total == 1
    clock.advance(200.0)
    assert leases.sweep() == 0 and leases.expired_total == 1  # the stale entry is not recounted


def test_per_key_counts_keep_an_object_held_until_its_last_lease_goes():
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    short = leases.grant(KEY_A, ttl=1.0)
    long = leases.grant(KEY_A, ttl=10.0)
    other = leases.grant(KEY_B, ttl=10.0)
    assert len({short.lease_id, long.lease_id, other.lease_id}) == 3
    clock.advance(1.0)
    assert leases.held(KEY_A) and leases.expired_total == 1
    leases.release_lease(long.lease_id)
    assert not leases.held(KEY_A) and leases.held(KEY_B)
    leases.drop_all(KEY_B)
    assert not leases.held(KEY_B) and len(leases) == 0


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_a_non_positive_ttl_is_refused(ttl):
    leases = LeaseTable(clock=FakeClock())
    with pytest.raises(LeaseError):
        leases.grant(KEY_A, ttl)
    lease = leases.grant(KEY_A, 1.0)
    with pytest.raises(LeaseError):
        leases.renew(lease.lease_id, ttl)
    assert lease.expires_at == 1001.0


def test_unknown_lease_ids_are_lease_errors():
    leases = LeaseTable(clock=FakeClock())
    with pytest.raises(LeaseError):
        leases.check(42)
    with pytest.raises(LeaseError):
        leases.renew(42, 1.0)


def test_a_ticket_whose_lease_expired_mid_copy_fails_but_keeps_its_buffer_until_the_copy_ends():
    """The ticket's side of the rule: the lease (checked at completion) runs out under a slow
    copy, so the ticket fails, but its buffer is released only when the copy ends.  The
    host tier's side (an expired lease never frees a slot a reader still references) is
    ``tests/unit/test_host_tier.py::test_expired_lease_does_not_free_a_referenced_buffer``."""
    clock = FakeClock()
    leases = LeaseTable(clock=clock)
    freed = []
    ticket = load_ticket("req-7/chunk-3", clock=clock, on_release=freed.append)
    lease = leases.grant(b"ns.hash.r0", ttl=2.0)
    ticket.advance(L.READABLE)
    ticket.begin_copy()  # tier → staging buffer read in flight
    clock.advance(5.0)  # the copy is slow; the lease runs out underneath it
    with pytest.raises(LeaseError):
        leases.check(lease.lease_id)  # the re-check at completion fails ...
    ticket.fail("lease expired")
    assert ticket.release() is False  # ... but the buffer is still being written
    assert freed == [] and ticket.inflight == 1
    clock.advance(1.0)
    ticket.end_copy()
    assert ticket.release() is True and freed == [ticket]
    assert ticket.durations() == {"READABLE": 0.0, "FAILED": 5.0, "RELEASED": 1.0}
