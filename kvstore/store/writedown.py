"""The one write-down path: copying objects published in the host pool to the lower tiers.

Copies run on the core's event loop (``kvstore.store.tiered``); ``offer`` may be called from
any thread (the connector's scheduler thread commits saves, the store process commits puts
on its loop).

Policies (``kvstore.config.WritePolicy``):

* ``WRITE_THROUGH``: each offered object is queued, then copied to every lower tier (fastest
  first) in the background, under a host reference: it cannot be evicted or freed while
  queued or copied.  Other engines see it as soon as its copy lands.
* ``WRITE_BACK``: an offered object becomes *dirty*: it keeps its host reference, so it is
  never evicted unwritten.  When dirty objects exceed ``dirty_limit`` bytes (a share of the
  pool), the oldest are written until half the limit remains; each then becomes clean (its
  reference dropped) and evictable.  ``flush`` writes everything dirty; ``aclose`` does too.
* ``HOST_ONLY``: nothing is written; the lower tiers are only read (and promoted from).

Bounds and backpressure:

* At most ``max_in_flight`` copies run at once (one object each, to every lower tier in
  order); no task exists for an object that is merely waiting.
* Write-through objects wait in a queue of at most ``queue_bytes`` (an object larger than
  that is still taken when the queue is empty).  Objects a free copy slot takes at once do
  not count, even before the loop has started them: a loop slow to run is no reason to drop.
  **An offer that finds the queue full is
  dropped**: its reference is released at once and it is counted (``write_down_dropped``,
  ``StoreObserver.write_down_dropped``).  The object stays in host memory only, so a drop is
  a future lower-tier miss, never wrong data.  ``offer`` never blocks: neither the engine's
  scheduler thread nor the store process's commits wait for a disk or a network.  An async
  producer on the loop that prefers to slow down (the embedded store's ``put``) calls
  ``submit(..., wait_s)`` instead: it waits up to ``wait_s`` for room, then is dropped.
* Write-back objects are not queued: they wait as dirty objects, bounded by the pool itself
  (a pool full of dirty objects answers NO_ROOM to new puts: write-back's backpressure).
* A lower tier that fails (raises, has no room, refuses) is counted per tier (``written``
  hook, ``StoreCounters.write_down``) and never fails the object: it is in host memory.
* ``verify=True`` (the store process, whose pools its clients may write) checks each object
  (header, key, payload checksum) right before copying it down; one that fails is not
  written anywhere and is counted (``write_down_corrupt``).  Lower tiers check the key and
  checksum again on every read, so bytes changed after this check are a miss there.

Encryption at rest (``kvstore.integrity``, docs/integrity.md): an object whose tenant's
keyring has ``encrypt`` on is encrypted once per copy (a worker thread above 1 MiB) into a
reused scratch buffer, and every lower tier gets that copy except the store process (it
encrypts per its own tenants).  An object that cannot be encrypted is written nowhere
(``write_down_corrupt``): a tenant that asked for encryption never gets plaintext on disk.

One copy's parts (the check, the encryption, one tier's put) are ``kvstore.store.copydown``.

``settle_key`` (before a delete) takes a key out of the queue or the dirty set and cancels
its copy in flight, so a late copy cannot bring a deleted object back.  ``aclose(timeout)``
refuses new offers, flushes, waits up to ``timeout`` s, then cancels what is left (counted in
``write_down_abandoned``) and releases its references.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from enum import Enum

from kvstore.config import WritePolicy
from kvstore.errors import ConfigError, ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.store.copydown import Item, Sealer, intact, put_one
from kvstore.store.observer import StoreCounters, StoreObserver
from tiers.base import PutResult, Tier
from tiers.host import HostTier

log = logging.getLogger("kvstore.store")


class Offer(Enum):
    QUEUED = "queued"  # write-through: waiting for a copy
    DIRTY = "dirty"  # write-back: held until flushed
    DROPPED = "dropped"  # the queue was full, or the write-down is closing: not written
    SKIPPED = "skipped"  # nothing to do: host only, no lower tier, not in the pool, or pending


class WriteDown:
    """Background copies from ``host`` to ``lower`` (see the module docstring)."""

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[Tier],
        policy: WritePolicy,
        counters: StoreCounters,
        observer: StoreObserver,
        *,
        max_in_flight: int = 2,
        queue_bytes: int | None = None,
        dirty_fraction: float = 0.5,
        verify: bool = False,
        keys=None,
    ) -> None:
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if not 0 < dirty_fraction <= 1:
            raise ConfigError(f"dirty_fraction must lie in (0, 1], got {dirty_fraction}")
        capacity = host.stats().capacity_bytes
        self.host, self.lower, self.policy = host, list(lower), policy
        self.max_in_flight = max_in_flight
        self.queue_bytes = capacity // 4 if queue_bytes is None else queue_bytes
        self.dirty_limit = int(capacity * dirty_fraction)
        self.written = 0  # objects stored in at least one lower tier
        self.verify = verify
        self.keys = keys
        self._scratch: list[bytearray] = []  # encryption buffers between copies (on the loop only)
        self._counters, self._observer = counters, observer
        self._sealer = Sealer(keys, self.lower, counters)
        # _lock guards _queue, _queued, _dirty, _dirty_bytes, _active, _flush_to and _closed
        # (offers come from other threads).  Never held across an await or a host call.
        self._lock = threading.Lock()
        self._queue: OrderedDict[ObjectKey, Item] = OrderedDict()  # write-through, oldest first
        self._queued = 0
        self._dirty: OrderedDict[ObjectKey, Item] = OrderedDict()  # write-back, oldest first
        self._dirty_bytes = 0
        self._active: dict[ObjectKey, asyncio.Task | None] = {}  # copies running
        self._flush_to: int | None = None  # write-back: flushing until dirty bytes <= this
        self._closed = False
        self._loop = _running_loop()  # built on a loop: copies run there (else see ``bind``)
        self._changed: asyncio.Event | None = None  # set on the loop when a copy ends

    @property
    def enabled(self) -> bool:
        return bool(self.lower) and self.policy is not WritePolicy.HOST_ONLY

    @property
    def in_flight(self) -> int:
        """Objects queued or being copied."""
        with self._lock:
            return len(self._queue) + len(self._active)

    @property
    def copying(self) -> int:
        """Copies running now (at most ``max_in_flight``)."""
        with self._lock:
            return len(self._active)

    @property
    def dirty_bytes(self) -> int:
        with self._lock:
            return self._dirty_bytes

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop copies run on (the one the lower tiers were opened on), for a write-down
        built outside it; else the first offer made on a loop binds it."""
        self._loop = loop

    # --- offers (any thread) ---------------------------------------------------------------

    def offer(self, key: ObjectKey, parent: ObjectKey | None) -> Offer:
        """``key`` was just published in the host pool: write it down per the policy."""
        if not self.enabled:
            return Offer.SKIPPED
        view = self.host.acquire(key, use=False)  # ours: not a reuse of the object
        if view is None:
            return Offer.SKIPPED
        with self._lock:
            outcome, wake = self._admit(key, Item(view, parent))
        if outcome in (Offer.DROPPED, Offer.SKIPPED):
            self.host.release(key)
        if outcome is Offer.DROPPED:
            self._counters.write_down_dropped += 1
            self._observer.write_down_dropped()
        if wake:
            self._wake()
        return outcome

    async def submit(self, key: ObjectKey, parent: ObjectKey | None, wait_s: float) -> Offer:
        """``offer`` from the loop, waiting up to ``wait_s`` for room in a full queue first."""
        loop = asyncio.get_running_loop()
        self._loop = self._loop or loop
        changed = self._changed = self._changed or asyncio.Event()
        deadline = loop.time() + wait_s
        while self._full_for(key) and (remaining := deadline - loop.time()) > 0:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                break
        return self.offer(key, parent)

    def _full_for(self, key: ObjectKey) -> bool:
        """Whether an offer of ``key`` now would find the write-through queue full."""
        size = self.host.size_of_sync(key)
        with self._lock:
            return (
                self.policy is WritePolicy.WRITE_THROUGH
                and size is not None
                and not self._closed
                and self._queue_full_for(size)
            )

    def _queue_full_for(self, size: int) -> bool:
        """Under ``_lock``: whether ``size`` more bytes would overflow the queue.  Queued
        objects that a free copy slot takes as soon as the loop runs are not waiting: an offer
        from another thread is judged as if the loop had already started them, so a busy loop
        does not turn into drops."""
        free = max(0, self.max_in_flight - len(self._active))
        if len(self._queue) < free:
            return False  # a copy starts for it at once
        starting = sum(len(item.view) for item in itertools.islice(self._queue.values(), free))
        waiting = self._queued - starting
        return len(self._queue) > free and waiting + size > self.queue_bytes

    def _admit(self, key: ObjectKey, item: Item) -> tuple[Offer, bool]:
        """Under ``_lock``: where the offered object goes, and whether a copy may start."""
        if self._closed:
            return Offer.DROPPED, False
        if key in self._queue or key in self._dirty or key in self._active:
            return Offer.SKIPPED, False
        size = len(item.view)
        if self.policy is WritePolicy.WRITE_BACK:
            self._dirty[key] = item
            self._dirty_bytes += size
            if self._dirty_bytes <= self.dirty_limit:
                return Offer.DIRTY, False
            target = self.dirty_limit // 2
            self._flush_to = target if self._flush_to is None else min(self._flush_to, target)
            return Offer.DIRTY, True
        if self._queue_full_for(size):
            return Offer.DROPPED, False
        self._queue[key] = item
        self._queued += size
        return Offer.QUEUED, True

    def _wake(self) -> None:
        loop = self._loop or _running_loop()
        if loop is None:
            raise RuntimeError("WriteDown.offer outside its event loop before bind()")
        self._loop = loop
        if _running_loop() is loop:
            self._pump()
            return
        try:
            loop.call_soon_threadsafe(self._pump)
        except RuntimeError:  # the loop is closed: aclose has released what was queued
            pass

    # --- copies (on the loop) ----------------------------------------------------------------

    def _pump(self) -> None:
        """Start copies while fewer than ``max_in_flight`` run."""
        starts = []
        with self._lock:
            while len(self._active) < self.max_in_flight and (nxt := self._next()) is not None:
                self._active[nxt[0]] = None
                starts.append(nxt)
        for key, item in starts:
            task = asyncio.get_running_loop().create_task(self._copy(key, item))
            task.add_done_callback(functools.partial(self._done, key))  # runs even if cancelled
            with self._lock:  # before it started
                self._active[key] = task

    def _next(self) -> tuple[ObjectKey, Item] | None:
        """Under ``_lock``: the next object to copy (the queue first, then a dirty flush)."""
        if self._queue:
            key, item = self._queue.popitem(last=False)
            self._queued -= len(item.view)
            return key, item
        if self._flush_to is not None:
            if self._dirty and self._dirty_bytes > self._flush_to:
                key, item = self._dirty.popitem(last=False)
                self._dirty_bytes -= len(item.view)
                return key, item
            self._flush_to = None
        return None

    async def _copy(self, key: ObjectKey, item: Item) -> None:
        t0, stored = time.perf_counter(), False
        if self.verify and not await intact(key, item.view):
            self._counters.write_down_corrupt += 1
            log.warning("write-down of %r refused: the object in the host pool is damaged", key)
            return
        scratch = self._scratch.pop() if self._scratch else bytearray()
        try:
            sealed, scratch = await self._sealer.encrypted(key, item, scratch)
        except (ConfigError, ObjectFormatError) as refused:
            self._counters.write_down_corrupt += 1
            log.warning("write-down of %r refused: cannot encrypt it (%s)", key, refused)
            self._scratch.append(scratch)
            return
        for tier in self.lower:
            at_rest = item if sealed is None or getattr(tier, "verifies_macs", False) else sealed
            result, err = await put_one(tier, key, at_rest)
            self._counters.add("write_down", f"{tier.name}:{result.value}")
            self._observer.written(tier, result, len(item.view), err)
            stored = stored or result is PutResult.STORED
        self._scratch.append(scratch)  # not on a cancellation: a tier's thread may still read it
        self.written += stored
        self._observer.write_down_done(time.perf_counter() - t0)

    def _done(self, key: ObjectKey, task: asyncio.Task) -> None:
        """A copy ended (done, failed or cancelled): release its slot, start the next."""
        self.host.release(key)
        with self._lock:
            self._active.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("write-down of %r failed", key, exc_info=task.exception())
        if self._changed is not None:
            self._changed.set()
        self._pump()

    # --- waiting, deletes, shutdown (on the loop) ----------------------------------------------

    def _busy(self) -> bool:
        with self._lock:
            flushing = self._flush_to is not None and self._dirty_bytes > self._flush_to
            return bool(self._queue or self._active or flushing)

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued, flushing or being copied; False on ``timeout``."""
        self._loop = self._loop or asyncio.get_running_loop()
        changed = self._changed = self._changed or asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                while self._busy():
                    changed.clear()
                    self._pump()
                    if self._busy():
                        await changed.wait()
        except TimeoutError:
            return False
        return True

    async def flush(self, timeout: float | None = None) -> bool:
        """Write every dirty object down (write-back), then ``drain``."""
        with self._lock:
            if self._dirty:
                self._flush_to = 0
        return await self.drain(timeout)

    async def settle_key(self, key: ObjectKey) -> None:
        """Stop any write-down of ``key`` (see the module docstring)."""
        with self._lock:
            item = self._queue.pop(key, None)
            if item is not None:
                self._queued -= len(item.view)
            elif (item := self._dirty.pop(key, None)) is not None:
                self._dirty_bytes -= len(item.view)
            task = self._active.get(key)
        if item is not None:
            self.host.release(key)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def aclose(self, timeout: float = 30.0) -> None:
        """Refuse new offers, flush and wait up to ``timeout`` s, then abandon the rest."""
        with self._lock:
            self._closed = True
        await self.flush(timeout)
        with self._lock:
            left = [*self._queue, *self._dirty]
            self._queue.clear()
            self._dirty.clear()
            self._queued = self._dirty_bytes = 0
            tasks = [task for task in self._active.values() if task is not None]
        for key in left:
            self.host.release(key)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if left or tasks:
            self._counters.write_down_abandoned += len(left) + len(tasks)
            log.warning("write-down: %d objects abandoned after %.1f s at close", len(left) + len(tasks), timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["Offer", "WriteDown"]
