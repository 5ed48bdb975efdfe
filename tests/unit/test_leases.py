"""The store process's bookkeeping alone (``kvstore.server.leases``): ``PutTable`` and
``LeaseBook`` as plain tables over plain numbers for time (no tiers, no clock to fake)."""

import pytest

from kvstore.errors import LeaseError
from kvstore.server.leases import ExpiredPutError, LeaseBook, PutTable
from tests.kits.server_core import keys
from tiers.base import PutHandle

A, B, C = keys(3)


def handle(key=A) -> PutHandle:
    return PutHandle(key, 4096)


# --- PutTable -----------------------------------------------------------------------------------


def test_an_expired_reservation_of_a_session_is_fenced_until_its_commit_or_its_sessions_end():
    table = PutTable()
    by_commit = table.add("a", A, A, handle(), 10.0, session=7)
    by_end = table.add("a", B, B, handle(B), 10.0, session=7)
    other = table.add("a", C, C, handle(C), 10.0, session=8)
    no_session = table.add("a", C, C, handle(C), 10.0)
    assert table.claim_expired(now=10.0) == [no_session]  # freed at once: nobody maps its slot
    assert (len(table), table.fenced, table.of("a"), table.of("b")) == (3, 3, 3, 0)
    with pytest.raises(LeaseError):
        table.claim(by_commit.put_id, "b", now=11.0)  # another tenant's: unknown, still fenced
    with pytest.raises(ExpiredPutError) as info:
        table.claim(by_commit.put_id, "a", now=11.0)  # its commit: now it may be freed
    assert info.value.pending is by_commit and info.value.fenced
    assert table.claim_session(7) == [by_end]  # the session ended
    assert table.claim_session(7) == [] and table.fenced == 1
    assert table.claim_all() == [other] and len(table) == 0


def test_put_ids_are_odd_distinct_and_bound_to_their_reservation():
    table = PutTable()
    puts = [table.add("a", A, B, handle(), 10.0) for _ in range(200)]
    assert len({p.put_id for p in puts}) == 200 == len(table)
    assert all(p.put_id & 1 and 0 < p.put_id < 2**63 for p in puts)
    assert (puts[0].tenant, puts[0].client_key, puts[0].key) == ("a", A, B)


@pytest.mark.parametrize(
    "tenant,put_id,expires,why",
    [
        ("b", None, 10.0, "another tenant's id is unknown"),
        ("a", 12345, 10.0, "a made-up id is unknown"),
        ("a", None, None, "a stream's reservation has no PutCommit"),
    ],
)
def test_claim_refuses_without_taking_the_reservation(tenant, put_id, expires, why):
    table = PutTable()
    pending = table.add("a", A, A, handle(), expires)
    with pytest.raises(LeaseError) as info:
        table.claim(pending.put_id if put_id is None else put_id, tenant, now=0.0)
    assert not isinstance(info.value, ExpiredPutError), why
    assert len(table) == 1, why


def test_claim_hands_a_reservation_to_exactly_one_caller():
    table = PutTable()
    pending = table.add("a", A, A, handle(), 10.0)
    assert table.claim(pending.put_id, "a", now=9.999) is pending
    with pytest.raises(LeaseError):
        table.claim(pending.put_id, "a", now=9.999)
    assert table.claim_expired(now=100.0) == [] and table.forget(pending) is False


def test_claim_of_an_expired_reservation_removes_it_and_hands_it_back_in_the_error():
    table = PutTable()
    pending = table.add("a", A, A, handle(), 10.0)
    with pytest.raises(ExpiredPutError) as info:
        table.claim(pending.put_id, "a", now=10.0)  # expiry is inclusive
    assert info.value.pending is pending and len(table) == 0


def test_claim_expired_takes_only_put_starts_past_their_ttl():
    table = PutTable()
    early = table.add("a", A, A, handle(A), 5.0)
    late = table.add("a", B, B, handle(B), 15.0)
    stream = table.add("a", C, C, handle(C), None)
    assert table.claim_expired(now=4.9) == []
    assert table.claim_expired(now=5.0) == [early]
    assert table.claim_expired(now=1e9) == [late]
    assert len(table) == 1 and table.forget(stream) is True and len(table) == 0


def test_claim_all_leaves_the_streams_to_their_handlers():
    table = PutTable()
    starts = [table.add("a", k, k, handle(k), 5.0) for k in (A, B)]
    stream = table.add("b", C, C, handle(C), None)
    assert table.claim_all() == starts
    assert len(table) == 1 and table.forget(stream)


# --- LeaseBook --------------------------------------------------------------------------------


def test_a_lease_is_owned_by_the_tenant_it_was_granted_to():
    book = LeaseBook()
    book.grant(7, "a", 10.0, A)
    assert book.owned(7, "a") and not book.owned(7, "b") and not book.owned(8, "a")


def test_forget_returns_the_pinned_key_once():
    book = LeaseBook()
    book.grant(7, "a", 10.0, A)
    assert book.forget(7) == A
    assert book.forget(7) is None and len(book) == 0 and not book.owned(7, "a")


def test_sweep_forgets_leases_at_or_past_their_expiry_and_returns_their_pins():
    book = LeaseBook()
    book.grant(1, "a", 5.0, A)
    book.grant(2, "a", 6.0, B)
    book.grant(3, "b", 5.0, A)  # two leases may pin one object: two pins to drop
    assert book.sweep(4.999) == []
    assert sorted(book.sweep(5.0)) == [A, A]
    assert book.ids() == [2]


def test_a_renewal_moves_the_expiry_the_sweep_sees():
    book = LeaseBook()
    book.grant(1, "a", 5.0, A)
    book.renew(1, 9.0)
    assert book.sweep(8.0) == [] and book.sweep(9.0) == [A]
