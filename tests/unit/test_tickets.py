"""Data-channel tickets alone (``kvstore.server.tickets``) on a fake clock: single use, bound
to a tenant, short-lived, bounded in number."""

import pytest

from kvstore.errors import CapacityError
from kvstore.server.auth import Permission, PermissionDeniedError, Principal, UnauthenticatedError
from kvstore.server.tickets import TicketBook

R, W, S = Permission.READ, Permission.WRITE, Permission.SHM
A = Principal("a", frozenset({R, W, S}))
A_READ = Principal("a", frozenset({R}))
B = Principal("b", frozenset({R, W}))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(ttl=10.0, limit=4):
    clock = Clock()
    return TicketBook(ttl, limit, clock), clock


def test_a_ticket_opens_one_connection_for_its_tenant():
    tickets, _ = book()
    t = tickets.mint(A)
    assert len(t) == 32 and len(tickets) == 1
    assert tickets.redeem(t, A) == A
    with pytest.raises(UnauthenticatedError, match="unknown, used or expired"):
        tickets.redeem(t, A)  # reused
    assert (tickets.minted, tickets.redeemed, tickets.refused, len(tickets)) == (1, 1, 1, 0)


def test_forged_and_expired_tickets_open_nothing():
    tickets, clock = book(ttl=10.0)
    real = tickets.mint(A)
    with pytest.raises(UnauthenticatedError):
        tickets.redeem(bytes(32), A)  # forged
    clock.now += 10.0  # exactly at expiry: expired
    with pytest.raises(UnauthenticatedError):
        tickets.redeem(real, A)
    assert len(tickets) == 0


def test_another_tenants_token_burns_the_ticket():
    tickets, _ = book()
    t = tickets.mint(A)
    with pytest.raises(PermissionDeniedError, match="another tenant"):
        tickets.redeem(t, B)
    with pytest.raises(UnauthenticatedError):
        tickets.redeem(t, A)  # gone: a stolen ticket is spent


def test_the_connection_gets_what_both_ticket_and_token_allow():
    tickets, _ = book()
    assert tickets.redeem(tickets.mint(A), A_READ).permissions == frozenset({R})
    assert tickets.redeem(tickets.mint(A_READ), A).permissions == frozenset({R})


def test_outstanding_tickets_are_bounded_and_swept():
    tickets, clock = book(ttl=10.0, limit=4)
    first = [tickets.mint(A) for _ in range(4)]
    with pytest.raises(CapacityError, match="4 data tickets"):
        tickets.mint(A)
    clock.now += 5.0
    tickets.redeem(first[0], A)
    later = tickets.mint(A)  # room again
    clock.now += 5.0  # the first batch expires, not the later one
    assert tickets.sweep() == 3 and len(tickets) == 1
    assert tickets.redeem(later, A) == A


def test_each_tenant_mints_within_its_own_budget():
    from kvstore.server.tenants import Limits, Tenants

    clock = Clock()
    tenants = Tenants({"a": Limits(tickets=2), "b": Limits(tickets=3)}, {}, None)
    tickets = TicketBook(10.0, 100, clock, tenants=tenants)
    a = [tickets.mint(A), tickets.mint(A)]
    with pytest.raises(CapacityError):
        tickets.mint(A)  # a's budget, not the table's
    assert tenants.refused["a", "tickets"] == 1
    for _ in range(3):
        tickets.mint(B)  # b's own budget is untouched
    tickets.redeem(a[0], A)  # a redeemed ticket is given back
    tickets.mint(A)
    clock.now += 10.0  # expired ones too, when a mint needs them
    tickets.mint(B)
    assert tenants.usage["b", "tickets"] == 1 and tenants.usage["a", "tickets"] == 0
