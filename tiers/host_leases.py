"""Leases of the host DRAM tier (``tiers.host``): ``HostLeases``, mixed into ``HostTier``,
offers ``lease``, ``renew_lease``, ``release_lease`` and ``check_lease``.  A lease protects a
stored object from eviction for a TTL (a use of it, told to the retention policy); it frees
nothing when it expires, and a delete drops the object's leases.  The table itself is
``kvstore.lifecycle.LeaseTable``; the eviction plan (``tiers.host_slots``) skips leased objects.

Runs wherever a host tier does; thread-safe: every method takes the tier's ``_lock``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvstore.keys import ObjectKey
from kvstore.lifecycle import Lease, LeaseTable

if TYPE_CHECKING:
    from tiers.host_slots import Entry


class HostLeases:
    """The lease calls of ``HostTier`` (mixed into it).  Needs its ``_lock``, ``_index`` and
    ``_leases``, and ``SlotOps._touch``."""

    # What the host class provides (declared for the type checker; set by ``HostTier``).
    _lock: threading.Lock
    _index: dict[ObjectKey, Entry]
    _leases: LeaseTable

    if TYPE_CHECKING:

        def _touch(self, key: ObjectKey, entry: Entry, use: bool = True) -> None: ...

    def lease(self, key: ObjectKey, ttl: float) -> Lease | None:
        """Protect a stored object from eviction for ``ttl`` seconds; None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._touch(key, entry)
            return self._leases.grant(key, ttl)

    def renew_lease(self, lease_id: int, ttl: float) -> Lease:
        with self._lock:
            return self._leases.renew(lease_id, ttl)

    def release_lease(self, lease_id: int) -> bool:
        with self._lock:
            return self._leases.release_lease(lease_id)

    def check_lease(self, lease_id: int) -> Lease:
        """The lease if still valid; ``LeaseError`` if unknown, released, expired or deleted."""
        with self._lock:
            return self._leases.check(lease_id)


__all__ = ["HostLeases"]
