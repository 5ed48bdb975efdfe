"""The write side of the store process: reservations and verified commits.

Server side, one event loop.  Keys arriving here are already tenant-scoped by the servicer;
``client_key`` is the key the client wrote into the object's header.

* ``reserve`` answers EXISTS when any tier holds the scoped key (``TieredStore.contains``: a
  failing tier holds nothing), NO_ROOM when the tenant's host pool cannot make room (both
  final), else reserves a PENDING slot (invisible, never evicted) and registers it in the
  ``PutTable``: with a TTL and its shared-memory session for ``PutStart`` (counted against
  the tenant's ``reservations`` quota until resolved; an expired one is fenced until its
  commit or its session's end, ``kvstore.server.leases``), without one for a stream's
  handler, which owns its slot and frees it on every exit path.
* ``finish`` verifies the whole object (``codec.verify`` against ``client_key`` and the
  reserved size: header, key, payload checksum), rewrites the header to the scoped key
  (``codec.rekey``), seals it with its tenant's MAC (``TieredStore.seal``,
  ``kvstore.integrity``: the client was authenticated by its token) and publishes it.  A bad object raises
  ``ObjectFormatError`` after the slot is freed.  Exactly one of ``finish``/``abort`` resolves each reservation.
* After a publish the object goes to the core's write-down (``TieredStore.written``,
  ``kvstore.store.writedown``): copied to every lower tier in the background under a host
  reference, at most two at a time, dropped and counted when its queue is full.  Lower-tier
  failures (disk full, Redis down) are counted per tier and never fail the put: the object
  is in host memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvstore import codec
from kvstore.errors import CapacityError, ConfigError, ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.server.config import ServerConfig
from kvstore.server.leases import ExpiredPutError, PendingPut, PutTable
from kvstore.server.metrics import ServerMetrics
from kvstore.server.tenants import Tenants
from kvstore.store.tiered import TieredStore
from tiers.base import PutResult

log = logging.getLogger("kvstore.server.servicer")
_VERIFY_INLINE = 1 << 20  # smaller objects are hashed on the loop (a thread hop costs more)


class PutPath:
    """Puts into the host pool of the store process (see the module docstring)."""

    def __init__(
        self,
        core: TieredStore,
        cfg: ServerConfig,
        metrics: ServerMetrics,
        tenants: Tenants,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core, self.host = core, core.host
        self.cfg, self.metrics = cfg, metrics
        self.tenants = tenants
        self.table = PutTable()
        self._clock = clock

    # --- reserve ------------------------------------------------------------------------

    def check_size(self, size: int) -> None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self.cfg.max_object_bytes:
            raise CapacityError(f"object size {size} exceeds max_object_bytes {self.cfg.max_object_bytes}")

    async def reserve(
        self,
        tenant: str,
        client_key: ObjectKey,
        key: ObjectKey,
        size: int,
        parent: ObjectKey | None,
        streamed: bool,
        session: int | None = None,
    ) -> PutResult | PendingPut:
        """A final outcome (EXISTS, NO_ROOM) or a reservation to fill and then finish."""
        self.check_size(size)
        if await self.core.contains(key):
            return PutResult.EXISTS
        if not streamed:
            self.tenants.take(tenant, "reservations")  # CapacityError at the quota
        try:
            handle = self.host.put_start_sync(key, size, parent)  # CapacityError: never fits
        except BaseException as err:
            self._give(tenant, streamed)
            if isinstance(err, CapacityError):
                self.tenants.refuse(tenant, "host_bytes")  # larger than the tenant's pool
            raise
        if handle is None:
            self._give(tenant, streamed)
            self.tenants.refuse(tenant, "host_room")
            return PutResult.NO_ROOM
        expires = None if streamed else self._clock() + self.cfg.put_ttl_s
        return self.table.add(tenant, client_key, key, handle, expires, session)

    def _give(self, tenant: str, streamed: bool) -> None:
        if not streamed:
            self.tenants.give(tenant, "reservations")

    def _free(self, pending: PendingPut) -> None:
        """Free an unpublished reservation's slot (and its quota count)."""
        self.host.put_commit_sync(pending.handle, False)
        self._give(pending.tenant, pending.expires_at is None)

    # --- commit / abort -----------------------------------------------------------------

    def claim(self, put_id: int, tenant: str) -> PendingPut:
        """The tenant's live ``PutStart`` reservation; ``LeaseError`` otherwise (an expired
        one is aborted on the way)."""
        try:
            return self.table.claim(put_id, tenant, self._clock())
        except ExpiredPutError as err:
            self.abort(err.pending)
            self.metrics.counters.puts_reaped += not err.fenced
            raise

    def abort(self, pending: PendingPut) -> None:
        """Free an unpublished reservation (idempotent per reservation via the table)."""
        self.table.forget(pending)
        self._free(pending)

    async def finish(self, pending: PendingPut, path: str) -> PutResult:
        """Verify, rekey and publish the reservation's bytes (see the module docstring)."""
        self.table.forget(pending)
        self._give(pending.tenant, pending.expires_at is None)
        handle = pending.handle
        c = self.metrics.counters
        with self.metrics.timer("put_commit"):
            try:
                buf = handle.buffer
                if buf is None:  # the host tier hands out its slot
                    raise LookupError(f"reservation of {pending.key!r} without its slot")
                await _verify(buf, pending.client_key, handle.size)
                codec.rekey(buf, pending.key)
                await _off_loop(handle.size, self.core.seal, pending.key, buf[: handle.size])
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
            self.core.written(pending.key, handle.parent)
        return outcome

    def count_final(self, path: str, outcome: PutResult) -> None:
        c = self.metrics.counters
        c.bump(c.puts, (path, outcome.value))

    # --- write-down (the core's) -----------------------------------------------------------

    async def settle_key(self, key: ObjectKey) -> None:
        """Stop a write-through of ``key`` (before a delete, so it cannot resurrect it)."""
        await self.core.writer.settle_key(key)

    @property
    def writes_in_flight(self) -> int:
        return self.core.writer.in_flight

    # --- reaper and shutdown ------------------------------------------------------------

    def reap(self) -> int:
        """Abort ``PutStart`` reservations past their TTL (fencing those of a session); how
        many expired."""
        before = self.table.fenced
        gone = self.table.claim_expired(self._clock())
        for pending in gone:
            self._free(pending)
        expired = len(gone) + self.table.fenced - before
        self.metrics.counters.puts_reaped += expired
        return expired

    def end_session(self, session: int) -> int:
        """A shared-memory session ended: free its reservations, live or fenced; how many."""
        gone = self.table.claim_session(session)
        for pending in gone:
            self._free(pending)
        return len(gone)

    async def aclose(self, timeout: float) -> None:
        """Abort uncommitted reservations and let write-throughs finish (``timeout`` s)."""
        for pending in self.table.claim_all():
            self._free(pending)
        await self.core.writer.aclose(timeout)


async def _verify(buf: memoryview, client_key: ObjectKey, size: int) -> None:
    """``codec.verify`` of a reserved slot; large objects are hashed in a worker thread
    (awaited to the end even when the caller is cancelled: it reads the slot)."""
    await _off_loop(size, codec.verify, buf, client_key, size)


async def _off_loop(size: int, fn, *args) -> None:
    """``fn(*args)`` over a reserved slot of ``size`` bytes: inline when small, else in a
    worker thread awaited to the end even when the caller is cancelled."""
    if size <= _VERIFY_INLINE:
        fn(*args)
        return
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()
        raise


__all__ = ["PutPath"]
