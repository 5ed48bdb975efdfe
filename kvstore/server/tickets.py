"""Single-use tickets that open data-channel connections.  Server side, event loop only.

``OpenData`` (gRPC, bearer token checked there) mints a ticket: 32 random bytes bound to the
caller's ``Principal`` (tenant and permissions), valid for ``ttl_s``.  A new data-channel
connection presents it with its bearer token; ``redeem`` removes it on first sight, whatever
the outcome, so a ticket opens at most one connection and a replayed, forged or expired one
opens none (``UnauthenticatedError``).  The token presented must belong to the ticket's
tenant (``PermissionDeniedError`` otherwise): a stolen ticket alone opens nothing.  The
connection then acts for that tenant with the permissions both the ticket and the token have.

At most ``limit`` tickets are outstanding in all, and each tenant at most its own
``tickets`` quota (``tenants``: ``kvstore.server.tenants``; ``CapacityError`` beyond,
counted as the tenant's ``tickets`` refusal): a client minting without connecting cannot
grow the table, nor take another tenant's tickets.  A ticket is the tenant's until it is
redeemed or forgotten; ``sweep`` forgets expired ones (the server's reaper calls it, and
``mint`` before it refuses).  Time comes from ``clock`` (a fake one in tests).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import CapacityError
from kvstore.server.auth import PermissionDeniedError, Principal, UnauthenticatedError
from kvstore.server.tenants import Tenants
from kvstore.wire.data import TICKET_SIZE

DEFAULT_TTL_S = 10.0
DEFAULT_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class _Grant:
    principal: Principal
    expires_at: float


class TicketBook:
    """Outstanding data-channel tickets (see the module docstring)."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        limit: int = DEFAULT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
        tenants: Tenants | None = None,
    ) -> None:
        self.ttl_s, self.limit = ttl_s, limit
        self.tenants = tenants
        self._clock = clock
        self._grants: dict[bytes, _Grant] = {}
        self.minted = self.redeemed = self.refused = 0

    def __len__(self) -> int:
        return len(self._grants)

    def mint(self, who: Principal) -> bytes:
        if len(self._grants) >= self.limit:
            self.sweep()
            if len(self._grants) >= self.limit:
                raise CapacityError(f"{self.limit} data tickets are outstanding; connect with them first")
        if self.tenants is not None:
            try:
                self.tenants.take(who.tenant, "tickets")
            except CapacityError:
                if not self.sweep():
                    raise
                self.tenants.take(who.tenant, "tickets")
        ticket = secrets.token_bytes(TICKET_SIZE)
        self._grants[ticket] = _Grant(who, self._clock() + self.ttl_s)
        self.minted += 1
        return ticket

    def redeem(self, ticket: bytes, who: Principal) -> Principal:
        """The principal a connection presenting ``ticket`` with ``who``'s token acts as."""
        grant = self._grants.pop(ticket, None)
        if grant is not None:
            self._forget(grant)
        if grant is None or grant.expires_at <= self._clock():
            self.refused += 1
            raise UnauthenticatedError("unknown, used or expired data ticket (ask OpenData for one)")
        if grant.principal.tenant != who.tenant:
            self.refused += 1
            raise PermissionDeniedError(f"the data ticket belongs to another tenant than {who.tenant!r}")
        self.redeemed += 1
        return Principal(who.tenant, grant.principal.permissions & who.permissions)

    def sweep(self, now: float | None = None) -> int:
        """Forget expired tickets; how many."""
        now = self._clock() if now is None else now
        gone = [t for t, g in self._grants.items() if g.expires_at <= now]
        for t in gone:
            self._forget(self._grants.pop(t))
        return len(gone)

    def _forget(self, grant: _Grant) -> None:
        if self.tenants is not None:
            self.tenants.give(grant.principal.tenant, "tickets")


__all__ = ["DEFAULT_LIMIT", "DEFAULT_TTL_S", "TicketBook"]
