"""What the store process remembers between calls: puts in flight and leases (server side).

Pure bookkeeping, no I/O and no tier calls: ``server_store.ServerStore`` owns one of each and
acts on what they return.  Both are used from the server's one event loop only (no locks).

* ``PutTable``: reservations handed out by ``PutStart`` (and the slots ``PutStream`` handlers
  are filling).  Ids are random 63-bit numbers, bound to the tenant that made them: another
  tenant's id is "unknown", exactly like a made-up one.  A ``PutStart`` reservation expires
  after its TTL (the reaper aborts it); a stream's reservation has no TTL, its handler owns it
  and frees it on every exit path.  ``claim`` hands a reservation to exactly one caller
  (commit, abort or reaper), so a slot is never freed twice.
* ``LeaseBook``: which tenant holds which host-tier lease on which object until when.  The
  host tier is the authority on validity; the book adds ownership (a tenant cannot release
  or renew another tenant's lease), remembers the object each lease *pins* (the store holds
  one buffer reference per lease, so its slot is neither freed nor reused while the lease
  lasts, even if the object is deleted), and hands the reaper the leases nobody released:
  ``forget`` and ``sweep`` return the pinned keys, and the store drops those references.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from kvstore.errors import LeaseError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle


@dataclass(slots=True)
class PendingPut:
    """One reservation in the host pool, not yet published."""

    put_id: int
    tenant: str
    client_key: ObjectKey      # the key the client put in its header
    key: ObjectKey             # the tenant-scoped key it is published under
    handle: PutHandle
    expires_at: float | None   # None: owned by a PutStream handler, never reaped

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class PutTable:
    """Puts in flight by id (see the module docstring)."""

    def __init__(self) -> None:
        self._puts: dict[int, PendingPut] = {}

    def __len__(self) -> int:
        return len(self._puts)

    def add(self, tenant: str, client_key: ObjectKey, key: ObjectKey, handle: PutHandle,
            expires_at: float | None) -> PendingPut:
        put_id = secrets.randbits(63) | 1
        while put_id in self._puts:
            put_id = secrets.randbits(63) | 1
        pending = self._puts[put_id] = PendingPut(put_id, tenant, client_key, key, handle, expires_at)
        return pending

    def claim(self, put_id: int, tenant: str, now: float) -> PendingPut:
        """Remove and return the tenant's live reservation; ``LeaseError`` when it is unknown,
        another tenant's or owned by a stream.  An expired one is removed *and* refused: the
        caller must abort it (``claim_expired`` semantics), so it is returned in the error."""
        pending = self._puts.get(put_id)
        if pending is None or pending.tenant != tenant or pending.expires_at is None:
            raise LeaseError(f"put {put_id} is unknown, already committed or aborted")
        del self._puts[put_id]
        if pending.expired(now):
            raise ExpiredPutError(pending)
        return pending

    def forget(self, pending: PendingPut) -> bool:
        """Forget a stream's reservation (its handler frees the slot); False if gone."""
        return self._puts.pop(pending.put_id, None) is not None

    def claim_expired(self, now: float) -> list[PendingPut]:
        """Remove and return every expired ``PutStart`` reservation (the reaper aborts them)."""
        gone = [p for p in self._puts.values() if p.expired(now)]
        for pending in gone:
            del self._puts[pending.put_id]
        return gone

    def claim_all(self) -> list[PendingPut]:
        """Remove and return every reservation without a handler (shutdown aborts them)."""
        gone = [p for p in self._puts.values() if p.expires_at is not None]
        for pending in gone:
            del self._puts[pending.put_id]
        return gone


class ExpiredPutError(LeaseError):
    """A put id that existed but whose reservation timed out before its commit."""

    def __init__(self, pending: PendingPut) -> None:
        super().__init__(f"put {pending.put_id} expired before its commit (its space is released)")
        self.pending = pending


@dataclass(slots=True)
class _Held:
    tenant: str
    expires_at: float
    key: ObjectKey     # the object whose slot this lease pins


class LeaseBook:
    """Owner, expiry and pinned object of each host-tier lease handed to a client."""

    def __init__(self) -> None:
        self._leases: dict[int, _Held] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, lease_id: int, tenant: str, expires_at: float, key: ObjectKey) -> None:
        self._leases[lease_id] = _Held(tenant, expires_at, key)

    def owned(self, lease_id: int, tenant: str) -> bool:
        held = self._leases.get(lease_id)
        return held is not None and held.tenant == tenant

    def renew(self, lease_id: int, expires_at: float) -> None:
        self._leases[lease_id].expires_at = expires_at

    def forget(self, lease_id: int) -> ObjectKey | None:
        """Drop a lease; the key whose pin the caller must now release (None if unknown)."""
        held = self._leases.pop(lease_id, None)
        return None if held is None else held.key

    def sweep(self, now: float) -> list[ObjectKey]:
        """Forget leases past their expiry; the keys whose pins the caller must release."""
        gone = [lid for lid, held in self._leases.items() if held.expires_at <= now]
        return [self._leases.pop(lid).key for lid in gone]

    def ids(self) -> list[int]:
        return list(self._leases)


__all__ = ["ExpiredPutError", "LeaseBook", "PendingPut", "PutTable"]
