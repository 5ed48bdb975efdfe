"""One object's copy down to the lower tiers: what ``kvstore.store.writedown`` copies, the
check before it, its encryption at rest and one tier's put.

Store core, on the core's event loop (the store process, or a connector's embedded store);
large objects are hashed and encrypted on a worker thread.

* ``Item``: an object waiting for or under its copy (a view of its host slot, held under a
  host reference, and its parent key).
* ``intact``: whether the object still holds its key and checksum (the store process checks
  before copying, since its clients may write their pool).
* ``Sealer.encrypted``: the encrypted copy for the lower tiers when the object's tenant
  encrypts at rest (docs/integrity.md), in a reused scratch buffer.
* ``put_one``: the copy to one tier; a failing tier is a ``FAILED`` result, never an error.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvstore import codec, integrity
from kvstore.errors import ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.store.observer import StoreCounters
from tiers.base import PutResult, Tier, put_bytes

log = logging.getLogger("kvstore.store")


@dataclass(slots=True)
class Item:
    view: memoryview  # the host slot, under a reference
    parent: ObjectKey | None


class Sealer:
    """Encryption at rest of the copies of one write-down (its ``keys`` and lower tiers)."""

    def __init__(self, keys, lower: list[Tier], counters: StoreCounters) -> None:
        self.keys, self.lower, self._counters = keys, lower, counters

    async def encrypted(self, key: ObjectKey, item: Item, scratch: bytearray) -> tuple[Item | None, bytearray]:
        """The encrypted copy of the object for the lower tiers (None: its tenant does not
        encrypt, or every lower tier verifies MACs itself), and the scratch buffer it is in
        (``scratch``, or a larger one replacing it)."""
        view = item.view
        ring = None if self.keys is None else self.keys(key)
        if ring is None or not ring.encrypt or all(getattr(t, "verifies_macs", False) for t in self.lower):
            return None, scratch
        need = len(view) + codec.AEAD_OVERHEAD
        if len(scratch) < need:
            scratch = bytearray(need)
        if len(view) > 1 << 20:
            out = await asyncio.to_thread(integrity.encrypt, view, ring, scratch)
        else:
            out = integrity.encrypt(view, ring, scratch)
        self._counters.encrypted += 1
        return Item(out, item.parent), scratch


async def put_one(tier: Tier, key: ObjectKey, item: Item) -> tuple[PutResult, Exception | None]:
    """``item`` into ``tier``: its result, and the error of a tier that raised."""
    try:
        return await put_bytes(tier, key, item.view, item.parent), None
    except Exception as err:  # noqa: BLE001 - a failing lower tier never fails the object
        log.warning("write-down of %r to %s failed: %s", key, tier.name, err)
        return PutResult.FAILED, err


async def intact(key: ObjectKey, view: memoryview) -> bool:
    """Whether the object holds ``key`` and its checksum (large ones hashed off the loop;
    the view is under the copy's host reference, so it stays valid)."""
    check = lambda: codec.verify(view, expected_key=key, length=len(view))  # noqa: E731
    try:
        if len(view) > 1 << 20:
            await asyncio.to_thread(check)
        else:
            check()
    except ObjectFormatError:
        return False
    return True


__all__ = ["Item", "Sealer", "intact", "put_one"]
