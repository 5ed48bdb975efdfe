"""The write side of the store process: reservations, verified commits, write-through.

Server side, one event loop.  Keys arriving here are already tenant-scoped by the servicer;
``client_key`` is the key the client wrote into the object's header.

* ``reserve`` answers EXISTS when any tier holds the scoped key, NO_ROOM when the host pool
  has nothing evictable (both final), else reserves a PENDING slot (invisible, never
  evicted) and registers it in the ``PutTable``: with a TTL for ``PutStart`` (the reaper
  aborts it when the client never commits), without one for a ``PutStream`` handler, which
  owns its slot and frees it on every exit path.
* ``finish`` verifies the whole object (``codec.verify`` against ``client_key`` and the
  reserved size: header, key, payload checksum), rewrites the header to the scoped key
  (``codec.rekey``) and publishes it.  A bad object raises ``ObjectFormatError`` after the
  slot is freed.  Exactly one of ``finish``/``abort`` resolves each reservation.
* After a publish the object is copied to every lower tier in the background, under a host
  reference (it cannot be evicted or freed while copied).  Lower-tier failures (disk full,
  Redis down) are counted per tier and never fail the put: the object is in host memory.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kvstore import codec
from kvstore.config import WritePolicy
from kvstore.errors import CapacityError, ConfigError, KVStoreError, ObjectFormatError, TierError
from kvstore.keys import ObjectKey
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import ServerMetrics
from kvstore.server.leases import ExpiredPutError, PendingPut, PutTable
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier

log = logging.getLogger("kvstore.server.servicer")
_VERIFY_INLINE = 1 << 20  # smaller objects are hashed on the loop (a thread hop costs more)
_WRITE_SLOTS = 2          # concurrent write-throughs (the disk is the bottleneck anyway)


class PutPath:
    """Puts into the host pool of the store process (see the module docstring)."""

    def __init__(self, host: HostTier, lower: Sequence[Tier], cfg: ServerConfig,
                 metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.lower = list(lower)
        self.cfg = cfg
        self.metrics = metrics
        self.table = PutTable()
        self._clock = clock
        self._writes: dict[ObjectKey, asyncio.Task] = {}  # write-throughs in flight, by key
        self._write_slots = asyncio.Semaphore(_WRITE_SLOTS)

    # --- reserve ------------------------------------------------------------------------

    def check_size(self, size: int) -> None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self.cfg.max_object_bytes:
            raise CapacityError(f"object size {size} exceeds max_object_bytes {self.cfg.max_object_bytes}")

    async def reserve(self, tenant: str, client_key: ObjectKey, key: ObjectKey, size: int,
                      parent: ObjectKey | None, streamed: bool) -> PutResult | PendingPut:
        """A final outcome (EXISTS, NO_ROOM) or a reservation to fill and then finish."""
        self.check_size(size)
        if await self._exists(key):
            return PutResult.EXISTS
        handle = self.host.put_start_sync(key, size, parent)  # CapacityError: never fits
        if handle is None:
            return PutResult.NO_ROOM
        expires = None if streamed else self._clock() + self.cfg.put_ttl_s
        return self.table.add(tenant, client_key, key, handle, expires)

    async def _exists(self, key: ObjectKey) -> bool:
        if self.host.contains_sync(key):
            return True
        for tier in self.lower:
            try:
                if await tier.contains(key):
                    return True
            except TierError as err:
                self._tier_failed(tier, "contains", err)
        return False

    # --- commit / abort -----------------------------------------------------------------

    def claim(self, put_id: int, tenant: str) -> PendingPut:
        """The tenant's live ``PutStart`` reservation; ``LeaseError`` otherwise (an expired
        one is aborted on the way)."""
        try:
            return self.table.claim(put_id, tenant, self._clock())
        except ExpiredPutError as err:
            self.abort(err.pending)
            self.metrics.counters.puts_reaped += 1
            raise

    def abort(self, pending: PendingPut) -> None:
        """Free an unpublished reservation (idempotent per reservation via the table)."""
        self.table.release(pending)
        self.host.put_commit_sync(pending.handle, False)

    async def finish(self, pending: PendingPut, path: str) -> PutResult:
        """Verify, rekey and publish the reservation's bytes (see the module docstring)."""
        self.table.release(pending)
        handle = pending.handle
        c = self.metrics.counters
        with self.metrics.timer("put_commit"):
            try:
                await _verify(handle.buffer, pending.client_key, handle.size)
                codec.rekey(handle.buffer, pending.key)
            except BaseException as err:
                self.host.put_commit_sync(handle, False)
                if isinstance(err, ObjectFormatError):
                    c.fail("bad_object")
                raise
            existed = self.host.contains_sync(pending.key)
            published = self.host.put_commit_sync(handle, True)
        outcome = PutResult.EXISTS if existed else PutResult.STORED if published else PutResult.FAILED
        c.bump(c.puts, (path, outcome.value))
        if outcome is PutResult.STORED:
            c.bump(c.bytes, ("host", "write"), handle.size)
            self._write_through(pending.key, handle.parent)
        return outcome

    def count_final(self, path: str, outcome: PutResult) -> None:
        c = self.metrics.counters
        c.bump(c.puts, (path, outcome.value))

    # --- background write-through -------------------------------------------------------

    def _write_through(self, key: ObjectKey, parent: ObjectKey | None) -> None:
        if self.cfg.write_policy is not WritePolicy.WRITE_THROUGH or not self.lower:
            return
        view = self.host.acquire(key)  # a reference: neither evicted nor freed while copied
        if view is None:
            return
        task = asyncio.get_running_loop().create_task(self._copy_down(key, view, parent))
        self._writes[key] = task
        task.add_done_callback(lambda t, k=key: self._writes.pop(k, None) if self._writes.get(k) is t else None)

    async def _copy_down(self, key: ObjectKey, view: memoryview, parent: ObjectKey | None) -> None:
        c = self.metrics.counters
        try:
            async with self._write_slots:
                with self.metrics.timer("write_through"):
                    for tier in self.lower:
                        result = await self._put_one(tier, key, view, parent)
                        c.bump(c.write_through, (tier.name, result.value))
                        if result is PutResult.STORED:
                            c.bump(c.bytes, (tier.name, "write"), len(view))
                        elif result in (PutResult.FAILED, PutResult.NO_ROOM):
                            c.fail(f"write_through_{tier.name}_{result.value}")
        finally:
            self.host.release(key)

    async def _put_one(self, tier: Tier, key: ObjectKey, view: memoryview,
                       parent: ObjectKey | None) -> PutResult:
        try:
            return await put_bytes(tier, key, view, parent)
        except (KVStoreError, OSError) as err:
            log.warning("write-through of %r to %s failed: %s", key, tier.name, err)
            return PutResult.FAILED

    async def settle_key(self, key: ObjectKey) -> None:
        """Stop a write-through of ``key`` (before a delete, so it cannot resurrect it)."""
        task = self._writes.get(key)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    # --- reaper and shutdown ------------------------------------------------------------

    def reap(self) -> int:
        """Abort ``PutStart`` reservations past their TTL; how many."""
        gone = self.table.claim_expired(self._clock())
        for pending in gone:
            self.host.put_commit_sync(pending.handle, False)
        self.metrics.counters.puts_reaped += len(gone)
        return len(gone)

    async def aclose(self, timeout: float) -> None:
        """Abort uncommitted reservations and let write-throughs finish (``timeout`` s)."""
        for pending in self.table.claim_all():
            self.host.put_commit_sync(pending.handle, False)
        tasks = list(self._writes.values())
        if tasks:
            _done, late = await asyncio.wait(tasks, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                log.warning("shutdown: %d write-throughs cancelled after %.1f s", len(late), timeout)
                await asyncio.wait(late)

    def _tier_failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.metrics.counters.fail(f"{tier.name}_{op}_error")
        log.warning("%s %s failed: %s", tier.name, op, err)


async def _verify(buf: memoryview, client_key: ObjectKey, size: int) -> None:
    """``codec.verify`` of a reserved slot; large objects are hashed in a worker thread
    (awaited to the end even when the caller is cancelled: it reads the slot)."""
    if size <= _VERIFY_INLINE:
        codec.verify(buf, expected_key=client_key, length=size)
        return
    task = asyncio.ensure_future(asyncio.to_thread(codec.verify, buf, client_key, size))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()
        raise


__all__ = ["PutPath"]
