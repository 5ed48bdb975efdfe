"""Connections not yet authenticated, bounded per peer and in all.  Server side; any thread.

The data channel (``kvstore.server.dataserver``) and the shared-memory gate
(``kvstore.server.shmgate``) accept a connection before they know whose it is: it must send
its hello (ticket and token) within ``hello_timeout``.  Until then it holds one of its peer's
``per_peer`` slots and one of ``total``; a connection beyond either is closed at once and
counted (``refusals``: ``per_peer`` or ``total``).  The global connection slots of the channel
(its ``MAX_CONNECTIONS`` / ``MAX_SESSIONS``) are taken only once the hello is accepted, so
strangers holding connections open cannot take them from the tenants.

A peer is what the caller can tell apart: the source address of a TCP connection, the
(uid, pid) of a Unix one (``SO_PEERCRED``: the gate serves only its own uid, so the uid alone
would put every local client in one bucket).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable


class PreAuth:
    """Slots of connections awaiting their hello (see the module docstring)."""

    def __init__(self, per_peer: int, total: int) -> None:
        if per_peer <= 0 or total <= 0:
            raise ValueError(f"per_peer and total must be positive, got {per_peer}, {total}")
        self.per_peer, self.total = per_peer, total
        # _lock guards _held, _sum and refusals.
        self._lock = threading.Lock()
        self._held: Counter[Hashable] = Counter()
        self._sum = 0
        self.refusals: Counter[str] = Counter()

    def enter(self, peer: Hashable) -> str | None:
        """Take a slot for ``peer``; None when taken, else the reason it was refused (counted)."""
        with self._lock:
            reason = "total" if self._sum >= self.total else "per_peer" if self._held[peer] >= self.per_peer else None
            if reason is not None:
                self.refusals[reason] += 1
                return reason
            self._held[peer] += 1
            self._sum += 1
            return None

    def leave(self, peer: Hashable) -> None:
        with self._lock:
            if self._held[peer] <= 0:
                raise RuntimeError(f"peer {peer!r} leaves a pre-authentication slot it does not hold")
            self._held[peer] -= 1
            if not self._held[peer]:
                del self._held[peer]
            self._sum -= 1

    def held(self, peer: Hashable | None = None) -> int:
        with self._lock:
            return self._sum if peer is None else self._held[peer]


__all__ = ["PreAuth"]
