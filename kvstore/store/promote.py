"""Promotion: bringing an object from a lower tier into a host slot, once per key.

Runs on the core's event loop (``kvstore.store.tiered``).

* The first lower tier that knows the object's size is read, verified by that tier, straight
  into a reserved host slot (``put_start_sync``: invisible until committed); the slot is
  published only when the whole object arrived, with its parent (from the header) so host
  eviction still drops chain tails first.  A read that fails tries the next tier.
* **Single flight.**  Concurrent callers for one key share one promotion task (each waits
  for it under ``asyncio.shield``: a cancelled caller does not cancel the others).  When the
  last caller waiting for it is cancelled, the promotion is cancelled too: a read nobody
  waits for only takes bandwidth from the reads someone does (a congested link).  Tiers
  are cancel-safe: a cancelled read never touches the slot after it returns, so the
  reservation is released only then.
* **Authenticated.**  With ``keys`` (a function of the key: that tenant's ``Keyring``, or
  None), an object read from a tier that does not verify MACs itself (every tier but the
  store process's, ``verifies_macs``) must carry a MAC that verifies under its tenant's
  keys before its slot is published; a forged one is a counted miss (``counters.forged``,
  ``StoreObserver.forged``) and is deleted from that tier, unless a second read of it
  verifies (the first read's bytes changed while read: a miss, counted ``forged_reread``,
  and the object is kept).
* **Encrypted objects** (``kvstore.integrity``: encryption at rest) are decrypted in place,
  in the reserved slot, before anything else sees them (``reveal``), and the slot shrinks to
  the plaintext object; a tag that does not verify is refused like a forged MAC.  The
  decryption runs on the loop, like the MAC check (about 0.3 ms for a 2 MiB object here).
  A tier may also answer with an object shorter than the size it reported (the store
  process reports the encrypted size of what it holds on SSD): the slot shrinks to it.
* **Errors are misses.**  A ``TierError`` from a tier (down, disk error) is counted
  (``StoreCounters.tier_errors``, ``StoreObserver.tier_failed``) and the next tier is tried;
  no room in the host pool is a counted miss.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence

from kvstore import codec, integrity
from kvstore.errors import CapacityError, CorruptHeaderError, ObjectFormatError, TierError
from kvstore.keys import ROOT, ObjectKey
from kvstore.store.observer import StoreCounters, StoreObserver
from tiers.base import Tier
from tiers.host import HostTier

log = logging.getLogger("kvstore.store")


class Promoter:
    """Single-flight promotions into ``host`` from ``lower`` (see the module docstring)."""

    def __init__(
        self, host: HostTier, lower: Sequence[Tier], counters: StoreCounters, observer: StoreObserver, keys=None
    ) -> None:
        self.host, self.lower = host, list(lower)
        self.keys = keys
        self._counters, self._observer = counters, observer
        self._running: dict[ObjectKey, asyncio.Task] = {}  # on the loop only
        self._waiters: dict[ObjectKey, int] = {}  # callers awaiting each (on the loop only)

    async def promote(self, key: ObjectKey) -> str | None:
        """Make ``key`` resident in the host pool; the name of the tier it came from ("host"
        when it already was), or None (a miss everywhere, or no room)."""
        if self.host.contains_sync(key):
            return self.host.name
        task = self._running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._promote(key))
            self._running[key] = task
            task.add_done_callback(functools.partial(self._forget, key))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters[key] == 1 and not task.done():
                # Nobody waits for it any more (a prefetch given up): stop using the tier for it.
                # The tiers stop touching the slot before the cancellation returns, and the
                # reservation is then released (``_read``'s ``finally``).
                task.cancel()
            raise
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]

    def _forget(self, key: ObjectKey, task: asyncio.Task) -> None:
        if self._running.get(key) is task:
            del self._running[key]

    async def settle(self, key: ObjectKey) -> None:
        """Wait for a promotion of ``key`` in flight (before a delete: it cannot resurrect it)."""
        task = self._running.get(key)
        if task is not None:
            await asyncio.wait([task])

    async def drain(self, timeout: float | None = None) -> None:
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=timeout)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def _promote(self, key: ObjectKey) -> str | None:
        for tier in self.lower:
            try:
                size = await tier.size_of(key)
            except TierError as err:
                self._failed(tier, err)
                continue
            if size is None:
                continue
            try:
                handle = self.host.put_start_sync(key, size)
            except CapacityError:
                handle = None
            if handle is None:
                self._counters.promote_no_room += 1
                self._observer.promote_no_room()
                return None
            if await self._read(tier, key, handle, size):
                return tier.name
        return None

    async def _read(self, tier: Tier, key: ObjectKey, handle, size: int) -> bool:
        """Read ``key`` from ``tier`` into the reserved slot; publish it when whole."""
        t0, n, forged = time.perf_counter(), None, None
        try:
            n = await tier.read_into(key, handle.buffer)
            if n is not None and 0 < n <= size:
                n, forged = reveal(self.keys, tier, key, handle.buffer, n, self._counters)
                if n is not None and n < size:
                    self.host.put_shrink_sync(handle, n)
                handle.parent = _parent(key, handle.buffer)
        except TierError as err:
            self._failed(tier, err)
        finally:
            ok = n is not None and n == handle.size
            published = self.host.put_commit_sync(handle, ok)
        if forged is not None:
            await self.refuse(tier, key, forged)
        if n is None or not (published and ok):
            return False
        seconds = time.perf_counter() - t0
        c = self._counters
        c.promotions += 1
        c.add("gets", tier.name)
        c.add("bytes_read", tier.name, n)
        c.add("read_seconds", tier.name, seconds)
        self._observer.promoted(tier, n, seconds)
        return True

    async def refuse(self, tier: Tier, key: ObjectKey, err: BaseException) -> None:
        """A forged object from ``tier``: counted, and deleted there (a failing delete is
        counted as a tier error).  It is read and checked once more first: when that copy
        verifies, the bytes first read were not the tier's (changed while read), so the read
        stays a miss but the object is kept (``counters.forged_reread``, logged)."""
        if await self._rereads_clean(tier, key):
            self._counters.add("forged_reread", tier.name)
            log.warning("%s: %r failed its check (%s) but a second read verifies: kept", tier.name, key, err)
            return
        self._counters.add("forged", tier.name)
        self._observer.forged(tier, err)
        try:
            await tier.delete(key)
        except TierError as derr:
            self._counters.add("tier_errors", f"{tier.name}:delete")
            self._observer.tier_failed(tier, "delete", derr)

    async def _rereads_clean(self, tier: Tier, key: ObjectKey) -> bool:
        """Whether a fresh read of ``key`` from ``tier`` passes ``reveal`` on its own."""
        try:
            size = await tier.size_of(key)
            if not size:
                return False
            buf = memoryview(bytearray(size))
            n = await tier.read_into(key, buf)
            if n is None or not 0 < n <= size:
                return False
            n, forged = reveal(self.keys, tier, key, buf, n)
            return n is not None and forged is None  # the tier checked the key and checksum
        except (TierError, ObjectFormatError):
            return False

    def _failed(self, tier: Tier, err: TierError) -> None:
        self._counters.add("tier_errors", f"{tier.name}:promote")
        self._observer.tier_failed(tier, "promote", err)


def reveal(
    keys, tier: Tier, key: ObjectKey, buf: memoryview, n: int, counters: StoreCounters | None = None
) -> tuple[int | None, BaseException | None]:
    """The object of ``n`` bytes that ``tier`` read into ``buf``, made usable: decrypted in
    place when encrypted, then ``authenticate``d.  ``(its length now, None)``; ``(None, why
    it is refused)`` for a tag or MAC that does not verify (the caller removes it); ``(None,
    None)`` for an encrypted object where no keys are held (a core built without ``keys``:
    a miss, counted as ``tier_errors["<tier>:encrypted"]``, and the object is left alone)."""
    obj = buf[:n]
    try:
        if not codec.decode_header(obj).encrypted:
            forged = authenticate(keys, tier, key, obj)
            return (n, None) if forged is None else (None, forged)
        ring = None if keys is None else keys(key)
        if ring is None:
            if counters is not None:
                counters.add("tier_errors", f"{tier.name}:encrypted")
            return None, None
        n = integrity.decrypt_in_place(obj, ring).total_len
    except ObjectFormatError as err:
        return None, err
    if counters is not None:
        counters.decrypted += 1
    return n, None


def authenticate(keys, tier: Tier, key: ObjectKey, obj: memoryview) -> BaseException | None:
    """None when ``obj`` (read from ``tier``) passes its tenant's MAC or needs none; else why
    it is refused.  Objects of a tier that verifies MACs itself pass."""
    if keys is None or getattr(tier, "verifies_macs", False):
        return None
    try:
        ring = keys(key)
        if ring is None:
            return None
        integrity.check(obj, ring)
    except ObjectFormatError as err:
        return err
    return None


def _parent(key: ObjectKey, obj: memoryview) -> ObjectKey | None:
    """The parent chunk's key named in the object's header (None for a chain's first)."""
    try:
        parent = codec.decode_header(obj).parent
    except CorruptHeaderError:
        return None  # the commit's own header check refuses the object
    return None if parent == ROOT else ObjectKey(key.namespace, parent, key.tag)


__all__ = ["Promoter", "authenticate", "reveal"]
