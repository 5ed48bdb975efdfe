"""Remote tier: the store process (``kvstore serve``) behind the ``tiers.base.Tier`` contract.

Runs in the engine's processes, over one ``kvstore.client.store_client.StoreClient``.

* **Reads** land verified in the caller's buffer (``read_into``, over whichever data plane
  the client chose: ``kvstore.client.planes``), rekeyed to the caller's key; ``lookup`` is
  the store's contiguous prefix (one ``Lookup`` per 4096 keys).  A read is one round trip;
  a same-host one's lease is released later, in a batch
  (``kvstore.client.leases``; ``aclose`` sends what is queued).
  The store answers prefixes, so ``lookup`` is the cheap batch question (one round trip).
  ``sizes``/``present`` answer per key: one ``Lookup`` for the batch, then one per key
  after its first miss (at most ``PROBES`` at a time), so ask them about few keys.
* **Puts** are two-phase.  With shared memory ``put_start`` reserves a region of the
  server's segment and ``handle.buffer`` *is* that region (producers write in place);
  ``put_commit`` asks the server to verify and publish it.  Elsewhere (the TCP data
  channel, gRPC streams) ``handle.buffer`` is None: ``put_write`` keeps views of the
  caller's bytes (which must stay unchanged until ``put_commit``) and ``put_commit`` sends
  them (``StoreClient.put_parts``).  A key the store already holds gives a
  handle whose writes are dropped and whose commit answers True.  ``put`` does it all in
  two round trips for a complete object.
* **Failures.**  A transport failure (UNAVAILABLE, DEADLINE_EXCEEDED, connection errors)
  opens the circuit breaker (``tiers.breaker``): from then on every call answers a miss or
  a failed put at once, and a background probe (``Hello``, which also remaps a new
  segment after a restart) closes it when the store is back.  An answer the server gave
  (a refused put, a permission error) does not trip it: it is a miss / failed put, counted
  in ``stats().extra["errors"]``.  Buffers too small and objects above the store's limit
  raise ``ConfigError`` / ``CapacityError`` as in every tier.
* **Descriptions.**  A store only knows keys and bytes; for its KV events it must be told an
  object's tokens (``Describe``).  With a ``describer`` (the owner's: key → its
  ``kvstore.wire.kv.Description``, or None), each object put or read here is described to a
  store that publishes events, once per key (the last ``TOLD`` remembered), in the
  background: a read never waits for it.  Reads matter after a store restart: its SSD
  objects are announced again once an engine that knows their tokens reads them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.client.info import Reservation
from kvstore.client.store_client import StoreClient
from kvstore.errors import TierError, TierUnavailableError
from kvstore.keys import ObjectKey
from kvstore.wire.kv import Description
from tiers.base import PutHandle, PutResult, Removal, TierBase, TierStats
from tiers.breaker import CircuitBreaker

log = logging.getLogger("kvstore.remote")
T = TypeVar("T")
_DONE = (PutResult.STORED, PutResult.EXISTS)
PROBES = 16  # single-key Lookups in flight when ``sizes`` asks about keys after a miss
TOLD = 4096  # keys remembered as described (not described again)


@dataclass(slots=True)
class _StreamPut:
    """A put over streams: views of the caller's bytes, in order."""

    parts: list[memoryview] = field(default_factory=list)
    written: int = 0


class _Exists:
    """Token of a put whose key the store already holds: writes dropped, commit True."""


class RemoteTier(TierBase):
    """The store process as a tier (see the module docstring)."""

    # The store process verifies each object's MAC with its tenant's keys when it enters its
    # pool and seals what its clients commit (``kvstore.integrity``); a client over this
    # authenticated channel may hold no key (a read-only principal), so it does not re-check.
    verifies_macs = True

    def __init__(self, client: StoreClient, *, name: str = "remote", retry_s: float = 1.0) -> None:
        self.name = name
        self.client = client
        self.breaker = CircuitBreaker(f"store {client.target}", client.refresh, retry_s=retry_s)
        self._failed_reads = 0  # reads answered "miss" by the open breaker or a failure
        self._errors: dict[str, int] = {}
        self.describer: Callable[[ObjectKey], Description | None] | None = None
        self._told: OrderedDict[ObjectKey, None] = OrderedDict()  # on the loop only
        self._telling: set[asyncio.Task] = set()

    @classmethod
    async def open(
        cls, target: str, *, name: str = "remote", retry_s: float = 1.0, **client_options: Any
    ) -> RemoteTier:
        """Connect (``StoreClient.connect(target, **client_options)``); raises
        ``TierUnavailableError`` naming the target when the store cannot be reached."""
        return cls(await StoreClient.connect(target, **client_options), name=name, retry_s=retry_s)

    # --- the breaker around every call ---------------------------------------------------

    async def _guard(self, what: str, call: Callable[[], Awaitable[T]], fallback: T) -> T:
        """``call()``, or ``fallback`` when the breaker is open or the call fails."""
        if not self.breaker.allow():
            return fallback
        try:
            result = await call()
        except TierUnavailableError as err:
            self.breaker.failure(err)
            self._count_error(what, "unavailable")
            return fallback
        except TierError as err:  # the server answered: it is up
            self.breaker.success()
            if self._count_error(what, type(err).__name__) == 1:  # the first of each kind
                log.warning("kvstore: %s: %s (further ones are counted in stats)", self.name, err)
            return fallback
        self.breaker.success()
        return result

    def _count_error(self, what: str, why: str) -> int:
        key = f"{what}:{why}"
        n = self._errors[key] = self._errors.get(key, 0) + 1
        return n

    # --- lookups -------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        if not keys:
            return 0
        found = await self._guard("lookup", lambda: self.client.lookup(keys), None)
        return 0 if found is None else found.hits

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        """Per key (see the module docstring): the batch's contiguous hit in one round trip,
        then each key after the first miss on its own."""
        if not keys:
            return []
        found = await self._guard("lookup", lambda: self.client.lookup(keys), None)
        if found is None:
            return [None] * len(keys)
        out: list[int | None] = [*found.sizes, *[None] * (len(keys) - found.hits)]
        probes = asyncio.Semaphore(PROBES)

        async def probe(i: int) -> None:
            async with probes:
                out[i] = await self.size_of(keys[i])

        await asyncio.gather(*(probe(i) for i in range(found.hits + 1, len(keys))))
        return out

    async def contains(self, key: ObjectKey) -> bool:
        return await self.lookup([key]) == 1

    async def size_of(self, key: ObjectKey) -> int | None:
        found = await self._guard("lookup", lambda: self.client.lookup([key]), None)
        return found.sizes[0] if found is not None and found.hits else None

    # --- reads ---------------------------------------------------------------------------

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        sentinel: int | None = -1
        n = await self._guard("get", lambda: self.client.read_into(key, buf), sentinel)
        if n == sentinel:
            self._failed_reads += 1
            return None
        if n is not None:
            self._describe_later(key)
        return n

    def _describe_later(self, key: ObjectKey) -> None:
        """Describe ``key`` to the store in the background (module docstring)."""
        if self.describer is None or key in self._told or not self.client.publishes_events:
            return
        desc = self.describer(key)
        if desc is None:
            return
        self._told[key] = None
        if len(self._told) > TOLD:
            self._told.popitem(last=False)
        call = lambda: self.client.describe(key, desc.parent, desc.tokens.tolist(), desc.lora)  # noqa: E731
        task = asyncio.get_running_loop().create_task(self._guard("describe", call, False))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    # --- puts ----------------------------------------------------------------------------

    async def put(self, key: ObjectKey, obj: memoryview, parent: ObjectKey | None = None) -> PutResult:
        """Publish a complete object in one go (two round trips)."""
        parent_hash = None if parent is None else parent.chunk_hash
        return await self._guard("put", lambda: self.client.put(key, obj, parent_hash), PutResult.FAILED)

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if not self.client.uses_shm:
            if not self.breaker.allow():
                return None
            self.client.check_size(size)
            return PutHandle(key, size, parent, None, _StreamPut())
        parent_hash = None if parent is None else parent.chunk_hash
        failed: Reservation | PutResult = PutResult.FAILED
        res = await self._guard("put", lambda: self.client.reserve(key, size, parent_hash), failed)
        if isinstance(res, Reservation):
            return PutHandle(key, size, parent, res.buffer, res, res.offset)
        if res is PutResult.EXISTS:
            return PutHandle(key, size, parent, None, _Exists())
        return None

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        token = handle.token
        if isinstance(token, _Exists):
            return
        if offset < 0 or offset + len(view) > handle.size:
            raise TierError(f"put_write of {len(view)} bytes at {offset} overruns a {handle.size}-byte object")
        if handle.buffer is not None:
            handle.buffer[offset : offset + len(view)] = view
            return
        if not isinstance(token, _StreamPut):
            raise TypeError(f"put_write of {handle.key!r}: not a handle of this tier's ({token!r})")
        if offset != token.written:
            raise TierError(f"remote put_write at {offset}: streamed writes must be in order (next is {token.written})")
        token.parts.append(view)
        token.written += len(view)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        done = await self._commit(handle, ok)
        if done:
            self._stored(handle.key)
            self._describe_later(handle.key)
        return done

    async def _commit(self, handle: PutHandle, ok: bool) -> bool:
        token = handle.token
        if isinstance(token, _Exists):
            return ok
        if isinstance(token, Reservation):
            result = await self._guard("put", lambda: self.client.commit(token, ok), PutResult.FAILED)
            return result in _DONE
        if not isinstance(token, _StreamPut):
            raise TypeError(f"put_commit of {handle.key!r}: not a handle of this tier's ({token!r})")
        if not ok or token.written != handle.size:
            return False
        parent_hash = None if handle.parent is None else handle.parent.chunk_hash
        result = await self._guard(
            "put", lambda: self.client.put_parts(handle.key, token.parts, handle.size, parent_hash), PutResult.FAILED
        )
        token.parts.clear()
        return result in _DONE

    async def delete(self, key: ObjectKey) -> bool:
        deleted = await self._guard("delete", lambda: self.client.delete(key), False)
        if deleted:
            self._removed(key, Removal.DELETED)
        return deleted

    # --- stats and lifecycle -------------------------------------------------------------

    def stats(self) -> TierStats:
        c = self.client.counters
        extra: dict[str, float] = {
            **self.breaker.stats(),
            "lease_expired": c.lease_expired,
            "renewals": c.renewals,
            "releases_deferred": c.releases_deferred,
            "release_calls": c.release_calls,
            "put_exists": c.put_exists,
            "failed_reads": self._failed_reads,
            "shm": float(self.client.uses_shm),
            "tcp": float(self.client.uses_tcp),
        }
        extra.update({f"errors_{k}": v for k, v in self._errors.items()})
        extra["errors"] = sum(self._errors.values())
        return TierStats(
            self.name,
            hits=c.hits,
            misses=c.misses + self._failed_reads,
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            puts=c.puts,
            put_failures=c.put_failures,
            corrupt=c.corrupt,
            extra=extra,
        )

    async def aclose(self) -> None:
        if self._telling:
            await asyncio.wait(list(self._telling), timeout=self.client.timeout_s)
        await self.breaker.aclose()
        await self.client.close()


__all__ = ["RemoteTier"]
