"""Session hints (``kv_transfer_params``: ``session``, ``continues``, ``pin``,
``resume_in_s``; ``connector.epoch.PARAMS_SCHEMA``) applied to the engine's host DRAM.
Scheduler side: ``finished`` runs on the scheduler thread, a resume prefetch on the I/O
thread.

Each session is remembered by the keys of its last finished request (a chain: its prefix
included), at most ``SESSIONS`` sessions, least recently finished dropped first.  At the end
of a request with a hint:

* ``continues: false`` ends the session: its keys that no other remembered session holds are
  ``Hint.RELEASED`` in the host pool (they go before everything else); shared ones (a system
  prompt) keep their place.
* ``pin: true`` pins the session's keys (``Hint.PINNED``: they go after everything else,
  bounded by the pool, ``tiers.retention.Hints``) until a request of it says ``pin: false``
  or ``continues: false``; keys another pinned session holds stay pinned.
* ``resume_in_s``: shortly before then (``RESUME_LEAD`` of it, at least ``RESUME_MIN_LEAD_S``)
  the session's keys missing from host DRAM are promoted from the lower tiers, in chain
  order, stopping at the first one no tier holds.  One resume prefetch runs at a time and a
  newer one of the same session replaces an older one; a request that looks up meanwhile
  shares its promotions (the core's single flight), so it never waits behind it.

A hint only moves bytes between tiers: what a lookup returns is what the tiers hold, hinted
or not.  Hints reach the engine's own host pool only (not the store process's pool).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence

from connector.epoch import SessionHint
from connector.ioloop import IOLoop
from kvstore.keys import ObjectKey
from kvstore.store.tiered import TieredStore
from tiers.retention import Hint

log = logging.getLogger("kvstore.connector")
SESSIONS = 4096  # sessions remembered (least recently finished dropped first)
RESUME_LEAD = 0.25  # a resume prefetch starts this share of resume_in_s early...
RESUME_MIN_LEAD_S = 0.5  # ...and at least this many seconds early


class Sessions:
    """The sessions the engine's requests named, and what their hints did (module docstring)."""

    def __init__(self, store: TieredStore, io: IOLoop) -> None:
        self.store, self.io = store, io
        self.keys: OrderedDict[str, tuple[ObjectKey, ...]] = OrderedDict()  # session -> last request's keys
        self.pinned: set[str] = set()
        self._holders: Counter[ObjectKey] = Counter()  # sessions remembering each key
        self._pinners: Counter[ObjectKey] = Counter()  # pinned sessions holding each key
        self._resume: dict[str, concurrent.futures.Future] = {}
        self.counts: Counter[str] = Counter()  # hints applied: released, pinned, unpinned, resumes, promoted
        self._lock = asyncio.Lock()  # one resume prefetch at a time (bound to the I/O loop on first use)

    def finished(self, hint: SessionHint, keys: Sequence[ObjectKey]) -> None:
        """A request of ``hint.session`` ended; ``keys``: its chunk keys (its chain)."""
        name, keys = hint.session, tuple(keys)
        was_pinned = name in self.pinned
        self._forget(name)
        if not hint.continues:
            self._hint([k for k in keys if not self._holders[k]], Hint.RELEASED, "released")
            self._cancel_resume(name)
            return
        self._remember(name, keys, pinned=hint.pin is True or (was_pinned and hint.pin is None))
        if name in self.pinned:
            self._hint(keys, Hint.PINNED, "pinned")
        elif was_pinned:  # pin: false
            self._hint([k for k in keys if not self._pinners[k]], Hint.NONE, "unpinned")
        if hint.resume_in_s is not None:
            self._schedule_resume(name, keys, hint.resume_in_s)

    # --- bookkeeping -----------------------------------------------------------------------------

    def _remember(self, name: str, keys: tuple[ObjectKey, ...], pinned: bool) -> None:
        self.keys[name] = keys
        self._holders.update(keys)
        if pinned:
            self.pinned.add(name)
            self._pinners.update(keys)
        while len(self.keys) > SESSIONS:
            oldest = next(iter(self.keys))
            self._forget(oldest)
            self._cancel_resume(oldest)

    def _forget(self, name: str) -> None:
        keys = self.keys.pop(name, ())
        self._holders.subtract(keys)
        if name in self.pinned:
            self.pinned.discard(name)
            self._pinners.subtract(keys)
        for k in keys:
            if self._holders[k] <= 0:
                del self._holders[k]
            if k in self._pinners and self._pinners[k] <= 0:
                del self._pinners[k]

    def _hint(self, keys: Sequence[ObjectKey], hint: Hint, what: str) -> None:
        if keys:
            self.store.host.hint_sync(keys, hint)
            self.counts[what] += len(keys)

    # --- resume prefetch (I/O thread) ----------------------------------------------------------

    def _schedule_resume(self, name: str, keys: tuple[ObjectKey, ...], resume_in_s: float) -> None:
        if not self.store.lower:
            return
        self._cancel_resume(name)
        delay = max(0.0, resume_in_s - max(RESUME_LEAD * resume_in_s, RESUME_MIN_LEAD_S))
        self._resume[name] = self.io.later(self._resume_later(name, keys, delay))
        self.counts["resumes"] += 1

    def _cancel_resume(self, name: str) -> None:
        fut = self._resume.pop(name, None)
        if fut is not None:
            fut.cancel()

    async def _resume_later(self, name: str, keys: tuple[ObjectKey, ...], delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._lock:
            for key in keys:
                if self.keys.get(name) != keys:  # the session moved on, or ended
                    return
                tier = await self.store.promote(key)
                if tier is None:
                    return  # the chain breaks here: nothing past it can hit
                if tier != self.store.host.name:
                    self.counts["promoted"] += 1
        self._resume.pop(name, None)

    def close(self) -> None:
        for name in list(self._resume):
            self._cancel_resume(name)


__all__ = ["RESUME_LEAD", "RESUME_MIN_LEAD_S", "SESSIONS", "Sessions"]
