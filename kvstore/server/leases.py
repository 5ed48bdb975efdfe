"""What the store process remembers between calls: puts in flight and leases (server side).

Pure bookkeeping, no I/O and no tier calls: ``server_store.ServerStore`` owns one of each and
acts on what they return.  Both are used from the server's one event loop only (no locks).

* ``PutTable``: reservations handed out by ``PutStart`` (and the slots ``PutStream`` handlers
  are filling).  Ids are random 63-bit numbers, bound to the tenant that made them: another
  tenant's id is "unknown", exactly like a made-up one.  A ``PutStart`` reservation expires
  after its TTL; a stream's reservation has no TTL, its handler owns it and frees it on
  every exit path.  ``claim`` hands a reservation to exactly one caller (commit, abort,
  reaper, session end), so a slot is never freed twice.
* **Fencing.**  A ``PutStart`` reservation belongs to a shared-memory *session* (the client's
  mapping of its pool).  When it expires, its client may still be copying into the slot,
  so the reaper does not free it: it is *fenced* (kept reserved, invisible, still counted)
  until its ``PutCommit`` arrives (an honest client commits or aborts after its copy, and
  learns then that it expired) or its session ends (the client unmapped, or died).  A late
  copy therefore never lands on a slot given to someone else.  A reservation made without a
  session (in-process callers) is freed at expiry, as before.
* ``LeaseBook``: which tenant holds which host-tier lease on which object until when.  The
  host tier is the authority on validity; the book adds ownership (a tenant cannot release
  or renew another tenant's lease), remembers the object each lease *pins* (the store holds
  one buffer reference per lease, so its slot is neither freed nor reused while the lease
  lasts, even if the object is deleted), and hands the reaper the leases nobody released:
  ``forget`` and ``sweep`` return the pinned keys, and the store drops those references.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import LeaseError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle


@dataclass(slots=True)
class PendingPut:
    """One reservation in the host pool, not yet published."""

    put_id: int
    tenant: str
    client_key: ObjectKey  # the key the client put in its header
    key: ObjectKey  # the tenant-scoped key it is published under
    handle: PutHandle
    expires_at: float | None  # None: owned by a PutStream handler, never reaped
    session: int | None = None  # the shared-memory session whose mapping may write the slot

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class PutTable:
    """Puts in flight by id (see the module docstring)."""

    def __init__(self) -> None:
        self._puts: dict[int, PendingPut] = {}
        self._fenced: dict[int, PendingPut] = {}  # expired, slot kept until commit or session end

    def __len__(self) -> int:
        return len(self._puts) + len(self._fenced)

    @property
    def fenced(self) -> int:
        return len(self._fenced)

    def of(self, tenant: str) -> int:
        """Reservations of one tenant (live, streamed and fenced)."""
        return sum(p.tenant == tenant for p in (*self._puts.values(), *self._fenced.values()))

    def add(
        self,
        tenant: str,
        client_key: ObjectKey,
        key: ObjectKey,
        handle: PutHandle,
        expires_at: float | None,
        session: int | None = None,
    ) -> PendingPut:
        put_id = secrets.randbits(63) | 1
        while put_id in self._puts or put_id in self._fenced:
            put_id = secrets.randbits(63) | 1
        pending = PendingPut(put_id, tenant, client_key, key, handle, expires_at, session)
        self._puts[put_id] = pending
        return pending

    def claim(self, put_id: int, tenant: str, now: float) -> PendingPut:
        """Remove and return the tenant's live reservation; ``LeaseError`` when it is unknown,
        another tenant's or owned by a stream.  An expired one is removed *and* refused: the
        caller must abort it (``claim_expired`` semantics), so it is returned in the error."""
        fenced = self._fenced.get(put_id)
        if fenced is not None and fenced.tenant == tenant:
            del self._fenced[put_id]
            raise ExpiredPutError(fenced, fenced=True)
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
        """Remove and return every expired ``PutStart`` reservation the reaper may free now
        (those without a session); expired ones of a session are fenced instead."""
        gone = []
        for pending in [p for p in self._puts.values() if p.expired(now)]:
            del self._puts[pending.put_id]
            if pending.session is None:
                gone.append(pending)
            else:
                self._fenced[pending.put_id] = pending
        return gone

    def claim_session(self, session: int) -> list[PendingPut]:
        """Remove and return every reservation of a session that ended (live or fenced)."""
        gone = [p for p in (*self._puts.values(), *self._fenced.values()) if p.session == session]
        for pending in gone:
            self._puts.pop(pending.put_id, None)
            self._fenced.pop(pending.put_id, None)
        return gone

    def claim_all(self) -> list[PendingPut]:
        """Remove and return every reservation without a handler (shutdown aborts them)."""
        gone = [p for p in self._puts.values() if p.expires_at is not None] + list(self._fenced.values())
        for pending in gone:
            self._puts.pop(pending.put_id, None)
        self._fenced.clear()
        return gone


class ExpiredPutError(LeaseError):
    """A put id that existed but whose reservation timed out before its commit."""

    def __init__(self, pending: PendingPut, fenced: bool = False) -> None:
        super().__init__(f"put {pending.put_id} expired before its commit (its space is released)")
        self.pending = pending
        self.fenced = fenced  # already counted as expired by the reaper


@dataclass(slots=True)
class _Held:
    tenant: str
    expires_at: float
    key: ObjectKey  # the object whose slot this lease pins


class LeaseBook:
    """Owner, expiry and pinned object of each host-tier lease handed to a client;
    ``on_drop(tenant)`` hears of every lease that leaves (its tenant's quota count)."""

    def __init__(self, on_drop: Callable[[str], None] | None = None) -> None:
        self._leases: dict[int, _Held] = {}
        self._on_drop = on_drop

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
        return None if held is None else self._dropped(held)

    def sweep(self, now: float) -> list[ObjectKey]:
        """Forget leases past their expiry; the keys whose pins the caller must release."""
        gone = [lid for lid, held in self._leases.items() if held.expires_at <= now]
        return [self._dropped(self._leases.pop(lid)) for lid in gone]

    def _dropped(self, held: _Held) -> ObjectKey:
        if self._on_drop is not None:
            self._on_drop(held.tenant)
        return held.key

    def ids(self) -> list[int]:
        return list(self._leases)


__all__ = ["ExpiredPutError", "LeaseBook", "PendingPut", "PutTable"]
