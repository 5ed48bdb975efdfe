"""A host-less kvstore: the connector's lower tiers (SSD, store process, Redis) without a host
pool, each object written through to every tier and read from the fastest that holds it.

Runs in vLLM's scheduler process, on an event loop thread of its own: the tier manager
(``adapters.vllm_tier.manager``) hands it coroutines and never waits on them, except at
drain and close.

The tiers are the connector's (``connector.lower.lower_tier_specs``, opened by
``kvstore.store.registry.open_tiers``, ``lower_tiers_required`` honoured), and so is the
integrity of what it writes: objects are in the ``kvstore.codec`` format (checksummed), sealed
with the tenant's MAC key when the SSD directory or Redis is ours (``connector.lower.keys_of``),
encrypted on their way to those tiers with ``encrypt_at_rest``, and every object read back is
verified, decrypted and authenticated (``kvstore.store.promote.reveal``) before one byte of it
reaches vLLM's primary tier.  A forged object is a miss and is removed; a failing tier is a
counted miss (``counters``), never an exception into vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

from connector.config import ConnectorConfig
from connector.lower import keys_of, lower_tier_specs
from kvstore import codec, integrity
from kvstore.errors import ObjectFormatError, TierError
from kvstore.keys import ObjectKey
from kvstore.store.promote import reveal
from kvstore.store.registry import open_tiers
from tiers.base import PutResult, Tier, put_bytes

log = logging.getLogger("kvstore.vllm_tier")
T = TypeVar("T")
OPEN_TIMEOUT_S = 60.0


class LowerStore:
    """The lower tiers of ``cfg`` on a private event loop (module docstring)."""

    def __init__(self, cfg: ConnectorConfig, layout_id: str) -> None:
        self.layout_id = layout_id
        self.counters: Counter[str] = Counter()
        self.keys = keys_of(cfg)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-vllm-tier", daemon=True)
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

    def _failed(self, tier: Tier, op: str, err: BaseException) -> None:
        self.counters[f"{tier.name}:{op}:{type(err).__name__}"] += 1
        log.warning("kvstore vLLM tier: %s %s failed: %s", tier.name, op, err)

    async def present(self, key: ObjectKey) -> bool:
        """Whether some tier holds ``key`` (a failing tier holds nothing)."""
        for tier in self.tiers:
            try:
                if await tier.contains(key):
                    return True
            except TierError as err:
                self._failed(tier, "contains", err)
        return False

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
        when no tier holds a usable copy."""
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
            log.warning("kvstore vLLM tier: %s returned a damaged %r: %s", tier.name, key, err)
            return "forged"
        if header.geometry.payload_bytes != len(out) or header.geometry.layout_id != self.layout_id:
            return "wrong_size"
        out[:] = codec.payload_view(buf, header)
        return None

    async def _remove(self, tier: Tier, key: ObjectKey) -> None:
        try:
            await tier.delete(key)
        except TierError as err:
            self._failed(tier, "delete", err)

    async def _close_tiers(self) -> None:
        for tier in reversed(self.tiers):
            try:
                await tier.aclose()
            except Exception as err:  # noqa: BLE001 - closing the rest matters more
                log.warning("kvstore vLLM tier: closing %s failed: %s", tier.name, err)

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


__all__ = ["LowerStore"]
