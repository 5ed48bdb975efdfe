"""The store core as the framework adapters use it: the connector's lower tiers (an SSD
directory, the store process, Redis) without a host pool, on a private event loop, each
object written through to every tier and read from the fastest that holds a usable copy.

Runs in the framework's process (vLLM's scheduler for ``adapters.vllm_tier``, LMCache's
server for ``adapters.lmcache_l2``): the adapter hands this store coroutines from its own
threads and never waits on them, except at start, drain and close.  This module imports no
framework, so each adapter's framework loads only what it needs.

The tiers are the connector's (``connector.lower.lower_tier_specs``, opened by
``kvstore.store.registry.open_tiers``, ``lower_tiers_required`` honoured), and so is the
integrity of what is written: objects are in the ``kvstore.codec`` format (checksummed, the
key in the header), sealed with the tenant's MAC key where the SSD directory or Redis is ours
(``connector.lower.keys_of``) and encrypted there with ``encrypt_at_rest``; every object read
back is verified, decrypted and authenticated (``kvstore.store.promote.reveal``) before one
byte of it reaches the framework's buffer.  A forged object is a miss and is removed; a
failing tier is a counted miss (``counters``), never an exception into the framework.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from connector.config import ConnectorConfig
from connector.lower import keys_of, lower_tier_specs
from kvstore import codec, integrity
from kvstore.errors import ObjectFormatError, TierError
from kvstore.keys import ObjectKey
from kvstore.store.promote import reveal
from kvstore.store.registry import open_tiers
from tiers.base import PutResult, Tier, put_bytes

T = TypeVar("T")
Item = TypeVar("Item")
OPEN_TIMEOUT_S = 60.0
PARALLEL = 16  # objects in flight at once, all jobs together (``LowerStore.each``)


class LowerStore:
    """The lower tiers of ``cfg`` on a private event loop (module docstring).  Its objects
    carry ``layout_id``; ``name`` names it in logs and its loop thread.  ``counters``:
    ``<tier>:write:<result>``, ``<tier>:read``, ``<tier>:<refusal>``, ``<tier>:<op>:<error>``
    and ``<tier>:open`` for a tier left out at start."""

    def __init__(self, cfg: ConnectorConfig, layout_id: str, name: str) -> None:
        self.layout_id = layout_id
        self.name = name
        self.counters: Counter[str] = Counter()
        self.keys = keys_of(cfg)
        self._log = logging.getLogger(f"kvstore.{name}")
        self._gate: asyncio.Semaphore | None = None  # made on the loop (``each``)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kvstore-{name}", daemon=True)
        self._thread.start()
        try:
            self.tiers: list[Tier] = self.call(
                open_tiers(
                    lower_tier_specs(cfg),
                    required=cfg.lower_tiers_required,
                    on_left_out=lambda kind, _err: self.counters.update([f"{kind}:open"]),
                ),
                OPEN_TIMEOUT_S,
            )
        except BaseException:
            self._stop()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the store's loop; its future (never waited on by the caller)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the store's loop and wait for it (start, drain and close only)."""
        return self.submit(coro).result(timeout)

    async def each(self, items: Sequence[Item], fn: Callable[[Item], Awaitable[T]]) -> list[T | BaseException]:
        """``fn`` of every item, at most ``PARALLEL`` in flight across every job of this store
        (the SSD's reads and writes run on threads, the store process and Redis pipeline their
        requests; one bound for all jobs, so many jobs at once never open more calls than a
        store process takes on one connection); the results in the items' order, an item
        that raised as its exception (the caller's to count).  Runs on the store's loop."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(PARALLEL)
        gate = self._gate

        async def one(item: Item) -> T:
            async with gate:
                return await fn(item)

        return list(await asyncio.gather(*(one(item) for item in items), return_exceptions=True))

    def _failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.counters[f"{tier.name}:{op}:{type(err).__name__}"] += 1
        self._log.warning("kvstore %s: %s %s failed: %s", self.name, tier.name, op, err)

    async def present(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Per key, whether some tier holds it (one batch question per tier for the keys
        the faster tiers lack; a failing tier holds nothing)."""
        found = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(found) if not hit]
            if not todo:
                break
            try:
                answers = await tier.present([keys[i] for i in todo])
            except TierError as err:
                self._failed(tier, "lookup", err)
                continue
            for i, hit in zip(todo, answers, strict=True):
                found[i] = hit
        return found

    async def contains(self, key: ObjectKey) -> bool:
        """Whether some tier holds ``key``."""
        return (await self.present([key]))[0]

    async def write(self, key: ObjectKey, payload: memoryview) -> list[str]:
        """Encode ``payload`` as the object of ``key``, seal it, and write it through to every
        tier; the names of the tiers that hold it now (empty: none does)."""
        geometry = codec.ObjectGeometry(1, 1, len(payload), dtype="uint8", layout_id=self.layout_id)
        plain = memoryview(bytearray(codec.object_size(geometry)))
        codec.encode_into(plain, key, geometry, payload)
        ring = None if self.keys is None else self.keys(key)
        at_rest = None
        if ring is not None:
            integrity.seal(plain, ring)
            at_rest = integrity.encrypt(plain, ring) if ring.encrypt else None
        held: list[str] = []
        for tier in self.tiers:
            obj = plain if at_rest is None or getattr(tier, "verifies_macs", False) else at_rest
            try:
                result = await put_bytes(tier, key, obj)
            except TierError as err:
                self._failed(tier, "write", err)
                continue
            self.counters[f"{tier.name}:write:{result.value}"] += 1
            if result in (PutResult.STORED, PutResult.EXISTS):
                held.append(tier.name)
        return held

    async def read(self, key: ObjectKey, out: memoryview) -> bool:
        """The payload of ``key``'s object, verified, in ``out`` (exactly its size); False
        when no tier holds a usable copy of that size."""
        buf = memoryview(bytearray(codec.HEADER_SIZE + len(out) + codec.AEAD_OVERHEAD))
        for tier in self.tiers:
            try:
                n = await tier.read_into(key, buf)
            except TierError as err:
                self._failed(tier, "read", err)
                continue
            if n is None:
                continue
            refused = self._refused(tier, key, buf, n, out)
            if refused is None:
                self.counters[f"{tier.name}:read"] += 1
                return True
            self.counters[f"{tier.name}:{refused}"] += 1
            if refused == "forged":
                await self._remove(tier, key)
        return False

    def _refused(self, tier: Tier, key: ObjectKey, buf: memoryview, n: int, out: memoryview) -> str | None:
        """None, with the payload copied into ``out``, when the object read is genuine and of
        ``out``'s size; else why not (``forged``: removed by the caller)."""
        size, forged = reveal(self.keys, tier, key, buf, n)
        if size is None:
            return "forged" if forged is not None else "encrypted"
        try:
            header = codec.verify(buf[:size], key, size)
        except ObjectFormatError as err:
            self._log.warning("kvstore %s: %s returned a damaged %r: %s", self.name, tier.name, key, err)
            return "forged"
        if header.geometry.payload_bytes != len(out) or header.geometry.layout_id != self.layout_id:
            return "wrong_size"
        out[:] = codec.payload_view(buf, header)
        return None

    async def delete(self, key: ObjectKey) -> bool:
        """Remove ``key`` from every tier; whether some tier held it."""
        removed = [await self._remove(tier, key) for tier in self.tiers]
        return any(removed)

    async def _remove(self, tier: Tier, key: ObjectKey) -> bool:
        try:
            return await tier.delete(key)
        except TierError as err:
            self._failed(tier, "delete", err)
            return False

    async def _close_tiers(self) -> None:
        for tier in reversed(self.tiers):
            try:
                await tier.aclose()
            except Exception as err:  # noqa: BLE001 - closing the rest matters more
                self._log.warning("kvstore %s: closing %s failed: %s", self.name, tier.name, err)

    def close(self, timeout: float = 30.0) -> None:
        """Close every tier, then stop the loop thread.  Idempotent."""
        if not self._thread.is_alive():
            return
        try:
            self.call(self._close_tiers(), timeout)
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


__all__ = ["PARALLEL", "LowerStore"]
