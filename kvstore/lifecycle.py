"""Transfer lifecycle: states, the one table of legal transitions, tickets and leases.

Used on the worker side (load/save tickets) and by tiers and the server (leases).

A load ticket moves ``LOOKED_UP → READABLE → IN_BUFFER → ON_DEVICE → CONSUMABLE → RELEASED``;
a save ticket ``GATHER_ISSUED → SNAPSHOT_DONE → STORED → PERSISTED → RELEASED``.  Either may
turn ``FAILED`` or ``CANCELLED`` before it completes; such a ticket reaches ``RELEASED`` only
after it has drained, i.e. after every copy it started has signalled completion.  That
rule is what keeps cancelled and timed-out transfers from freeing memory under a copy.

Two different protections, never confused:
  * a ``Lease`` protects an *object in its tier* from eviction/overwrite for a TTL;
  * a buffer reference count (held by the tier, see ``tiers/host.py``) or an in-flight copy
    counted on the ticket protects *memory*.  A lease expiring never frees memory.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvstore.errors import LeaseError, LifecycleError

Clock = Callable[[], float]


class LoadState(Enum):
    LOOKED_UP = "looked_up"  # an index said the object exists in a tier
    READABLE = "readable"  # a lease on it is held
    IN_BUFFER = "in_buffer"  # bytes are in our staging buffer, checksum verified
    ON_DEVICE = "on_device"  # the copy into device memory completed (event)
    CONSUMABLE = "consumable"  # pages scattered into engine blocks; compute may read them
    RELEASED = "released"  # staging buffer and lease returned
    FAILED = "failed"
    CANCELLED = "cancelled"


class SaveState(Enum):
    GATHER_ISSUED = "gather_issued"  # device→host copy submitted
    SNAPSHOT_DONE = "snapshot_done"  # its event completed: engine may free/reuse the blocks
    STORED = "stored"  # complete in a tier, visible to lookups
    PERSISTED = "persisted"  # also written to a lower, durable tier
    RELEASED = "released"
    FAILED = "failed"
    CANCELLED = "cancelled"


_L, _S = LoadState, SaveState
_ABORT_L = {_L.FAILED, _L.CANCELLED}
_ABORT_S = {_S.FAILED, _S.CANCELLED}

# The one table of legal transitions.  Aborted tickets only leave via RELEASED (after drain).
TRANSITIONS: dict[Enum, frozenset[Enum]] = {
    _L.LOOKED_UP: frozenset({_L.READABLE, *_ABORT_L}),
    _L.READABLE: frozenset({_L.IN_BUFFER, *_ABORT_L}),
    _L.IN_BUFFER: frozenset({_L.ON_DEVICE, *_ABORT_L}),
    _L.ON_DEVICE: frozenset({_L.CONSUMABLE, *_ABORT_L}),
    _L.CONSUMABLE: frozenset({_L.RELEASED}),
    _L.FAILED: frozenset({_L.RELEASED}),
    _L.CANCELLED: frozenset({_L.RELEASED}),
    _L.RELEASED: frozenset(),
    _S.GATHER_ISSUED: frozenset({_S.SNAPSHOT_DONE, *_ABORT_S}),
    _S.SNAPSHOT_DONE: frozenset({_S.STORED, _S.RELEASED, *_ABORT_S}),
    _S.STORED: frozenset({_S.PERSISTED, _S.RELEASED}),
    _S.PERSISTED: frozenset({_S.PERSISTED, _S.RELEASED}),
    _S.FAILED: frozenset({_S.RELEASED}),
    _S.CANCELLED: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
}
ABORTED = frozenset(_ABORT_L | _ABORT_S)


def is_legal(src: Enum, dst: Enum) -> bool:
    return dst in TRANSITIONS[src]


class Ticket:
    """One transfer's progress.  Thread-safe: copy threads signal completions.

    ``begin_copy()``/``end_copy()`` count copies that may still touch the ticket's memory;
    ``release()`` refuses (returns False) while any is outstanding on an aborted ticket, and
    runs ``on_release`` exactly once when it succeeds.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        initial: Enum,
        label: str = "",
        clock: Clock = time.monotonic,
        on_release: Callable[[Ticket], None] | None = None,
    ) -> None:
        self.id = next(Ticket._ids)
        self.label = label
        self._clock = clock
        self._on_release = on_release
        self._lock = threading.Lock()  # guards state, history, _inflight, error
        self._state = initial
        self._inflight = 0
        self.error: str | None = None
        self.history: list[tuple[Enum, float]] = [(initial, clock())]

    @property
    def state(self) -> Enum:
        return self._state

    @property
    def inflight(self) -> int:
        return self._inflight

    def _transition(self, dst: Enum) -> None:
        """The only place a ticket's state changes.  Caller holds ``_lock``."""
        if not is_legal(self._state, dst):
            raise LifecycleError(f"ticket {self.id} {self.label}: illegal {self._state.name} -> {dst.name}")
        self._state = dst
        self.history.append((dst, self._clock()))

    def advance(self, dst: Enum) -> None:
        with self._lock:
            self._transition(dst)

    def begin_copy(self) -> None:
        with self._lock:
            if self._state in ABORTED or self._state.name == "RELEASED":
                raise LifecycleError(f"ticket {self.id}: no new copy after {self._state.name}")
            self._inflight += 1

    def end_copy(self) -> None:
        with self._lock:
            if self._inflight <= 0:
                raise RuntimeError(f"ticket {self.id}: end_copy without begin_copy")
            self._inflight -= 1

    def fail(self, reason: str) -> None:
        """Abort with a reason; idempotent for already-aborted tickets."""
        self._abort(_L.FAILED if isinstance(self._state, LoadState) else _S.FAILED, reason)

    def cancel(self, reason: str = "cancelled") -> None:
        self._abort(_L.CANCELLED if isinstance(self._state, LoadState) else _S.CANCELLED, reason)

    def _abort(self, dst: Enum, reason: str) -> None:
        with self._lock:
            if self._state in ABORTED:
                return
            self._transition(dst)
            self.error = reason

    @property
    def drained(self) -> bool:
        return self._inflight == 0

    def release(self) -> bool:
        """Move to RELEASED if nothing may still touch our memory; True when released."""
        with self._lock:
            if self._state.name == "RELEASED":
                return True
            if self._inflight:
                return False
            self._transition(type(self._state)["RELEASED"])
        if self._on_release is not None:
            self._on_release(self)
        return True

    def durations(self) -> dict[str, float]:
        """Seconds spent reaching each state from the previous one (stage latencies)."""
        return {s.name: t - prev for (_, prev), (s, t) in zip(self.history, self.history[1:])}


def load_ticket(label: str = "", **kw) -> Ticket:
    return Ticket(LoadState.LOOKED_UP, label, **kw)


def save_ticket(label: str = "", **kw) -> Ticket:
    return Ticket(SaveState.GATHER_ISSUED, label, **kw)


@dataclass(slots=True)
class Lease:
    """A time-limited promise that an object stays put in its tier."""

    lease_id: int
    key: bytes
    expires_at: float
    released: bool = False

    def valid(self, now: float) -> bool:
        return not self.released and now < self.expires_at


@dataclass
class LeaseTable:
    """Leases by id, with per-key counts.  Not thread-safe: its owner locks around it.

    Expiries sit in a heap whose stale entries (renewed or released leases) are skipped by
    ``sweep`` and compacted away once they outnumber the live leases, so the heap stays
    within ``2 * len(self) + 64`` entries however often leases are renewed."""

    clock: Clock = time.monotonic
    _leases: dict[int, Lease] = field(default_factory=dict)
    _per_key: dict[bytes, int] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _expiry: list[tuple[float, int]] = field(default_factory=list)  # heap; stale entries skipped
    expired_total: int = 0

    def grant(self, key: bytes, ttl: float) -> Lease:
        if ttl <= 0:
            raise LeaseError(f"lease TTL must be positive, got {ttl}")
        lease = Lease(next(self._ids), key, self.clock() + ttl)
        self._leases[lease.lease_id] = lease
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self._push(lease)
        return lease

    def renew(self, lease_id: int, ttl: float) -> Lease:
        lease = self.check(lease_id)
        if ttl <= 0:
            raise LeaseError(f"lease TTL must be positive, got {ttl}")
        lease.expires_at = self.clock() + ttl
        self._push(lease)
        return lease

    def _push(self, lease: Lease) -> None:
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        if len(self._expiry) > 2 * len(self._leases) + 64:
            self._expiry = [(held.expires_at, lid) for lid, held in self._leases.items()]
            heapq.heapify(self._expiry)

    @property
    def heap_size(self) -> int:
        """Entries in the expiry heap (bounded by the live leases; see the class docstring)."""
        return len(self._expiry)

    def check(self, lease_id: int) -> Lease:
        """The lease if still valid (re-check at completion); LeaseError otherwise."""
        self.sweep()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError(f"lease {lease_id} is unknown, released or expired")
        return lease

    def release_lease(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        lease.released = True
        self._drop_key(lease.key)
        return True

    def held(self, key: bytes) -> bool:
        self.sweep()
        return self._per_key.get(key, 0) > 0

    def sweep(self) -> int:
        """Forget expired leases; returns how many expired now."""
        now, n = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lid = heapq.heappop(self._expiry)
            lease = self._leases.get(lid)
            if lease is not None and lease.expires_at <= now:
                del self._leases[lid]
                self._drop_key(lease.key)
                n += 1
        self.expired_total += n
        return n

    def drop_all(self, key: bytes) -> None:
        for lid in [lid for lid, lease in self._leases.items() if lease.key == key]:
            self.release_lease(lid)

    def __len__(self) -> int:
        return len(self._leases)

    def _drop_key(self, key: bytes) -> None:
        n = self._per_key.get(key, 0) - 1
        if n > 0:
            self._per_key[key] = n
        else:
            self._per_key.pop(key, None)
