"""The host pool as the engine connector sees it: the narrow surface of the store core's
shared-memory host tier that a scheduler needs to promise loads and drop objects (pin a
published object's slot, release it, read a header in place, delete, clear), never the
tier's put, lease or eviction machinery.  ``TieredStore.pool`` provides it."""

from __future__ import annotations

from typing import Protocol

from kvstore.keys import ObjectKey
from tiers.base import Removal
from tiers.host import HostTier


class HostPool(Protocol):
    """A host pool readers in other processes map (``shm_path``, ``size`` bytes)."""

    @property
    def name(self) -> str: ...

    @property
    def shm_path(self) -> str | None: ...

    @property
    def size(self) -> int: ...

    @property
    def buffer(self) -> memoryview | None: ...

    def pin(self, key: ObjectKey) -> tuple[int, int] | None:
        """``(offset, size)`` of a published object, held until ``release(key)``; None on a miss."""

    def release(self, key: ObjectKey) -> None: ...

    def delete(self, key: ObjectKey, reason: Removal = Removal.DELETED) -> bool:
        """Remove from lookup now; the slot is freed once unreferenced."""

    def clear(self, reason: Removal = Removal.DELETED) -> int:
        """Remove every published object; returns how many."""


class SharedHostPool:
    """``HostPool`` over a ``HostTier`` (its one shared pool)."""

    def __init__(self, host: HostTier) -> None:
        self._host = host

    @property
    def name(self) -> str:
        return self._host.name

    @property
    def shm_path(self) -> str | None:
        return self._host.shm_path

    @property
    def size(self) -> int:
        array = self._host.array
        if array is None:
            raise LookupError(f"host pool {self._host.name}: closed")
        return array.size

    @property
    def buffer(self) -> memoryview | None:
        return self._host.buffer

    def pin(self, key: ObjectKey) -> tuple[int, int] | None:
        return self._host.pin(key)

    def release(self, key: ObjectKey) -> None:
        self._host.release(key)

    def delete(self, key: ObjectKey, reason: Removal = Removal.DELETED) -> bool:
        return self._host.delete_sync(key, reason)

    def clear(self, reason: Removal = Removal.DELETED) -> int:
        return self._host.clear_sync(reason)


__all__ = ["HostPool", "SharedHostPool"]
