"""One pool of the host DRAM tier (``tiers.host``): its memory, its slot allocator, its
retention policy (``tiers.retention``) and counters, and the plan that says whether
evicting can make room at all.

A host tier has one pool, or (the store process) one per tenant.  Each pool is a buffer of
its own, so a mapping of one reaches only that pool's objects, and a put evicts only within
its own pool.  The memory, by ``Backing``:

* ``PRIVATE``: memory of this process (pinned with CUDA; ``allocate``);
* ``NAMED``: a /dev/shm file other processes map by name (the connector's scheduler and
  workers; ``host_shm.create_shared``);
* ``MEMFD``: an anonymous, resize-sealed memfd that other processes get only as a
  descriptor (the store process's tenant pools; ``host_shm.create_memfd``).

``fits_after_evicting`` is the planning step of every eviction: a put evicts only when
freeing every object it may evict would leave a hole it fits in, so a put that cannot fit
evicts nothing.  Bookkeeping only: ``HostTier`` guards every pool with its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import ConfigError
from tiers.allocator import SlotAllocator
from tiers.host_shm import MemfdPool, SharedPoolView, create_memfd, create_shared
from tiers.retention import Hints, RetentionPolicy, make_retention

if TYPE_CHECKING:
    from kvstore.keys import ObjectKey


class Backing(Enum):
    PRIVATE = "private"  # this process's memory
    NAMED = "named"  # a /dev/shm file, mapped by name
    MEMFD = "memfd"  # an anonymous memfd, handed out as a descriptor


class HostPool:
    """One buffer carved into slots (see the module docstring)."""

    def __init__(
        self,
        name: str,
        capacity: int,
        alignment: int,
        backing: Backing,
        pin: bool | None,
        reuse_window: float = 1.0,
        retention: RetentionPolicy = RetentionPolicy.REUSE,
    ) -> None:
        self.name = name
        self.alloc = SlotAllocator(capacity, alignment)
        self.shm: SharedPoolView | None = None
        if backing is Backing.NAMED:
            self.shm = create_shared(capacity, pin=pin)
        elif backing is Backing.MEMFD:
            self.shm = create_memfd(capacity, name)
        array: np.ndarray | None
        self.tensor: Any  # a torch view when pinned, else None
        if self.shm is not None:
            array, self.tensor = self.shm.array, self.shm.tensor
        else:
            array, self.tensor = allocate(capacity, pin)
        assert array is not None  # a fresh mapping is open
        self.array: np.ndarray | None = array
        self.buffer: memoryview | None = memoryview(array)  # None once released
        self.retention = make_retention(retention, reuse_window)  # its LIVE objects, in eviction order
        self.hints = Hints(capacity)  # session hints over that order
        self.evictions = 0
        self.pending = 0

    @property
    def path(self) -> str | None:
        """The /dev/shm file of a NAMED pool (None otherwise)."""
        return self.shm.path if self.shm is not None and not isinstance(self.shm, MemfdPool) else None

    @property
    def memfd(self) -> MemfdPool | None:
        return self.shm if isinstance(self.shm, MemfdPool) else None

    def stats(self) -> dict[str, int]:
        return {
            "objects": len(self.retention),
            "bytes_used": self.alloc.used_bytes,
            "capacity_bytes": self.alloc.capacity,
            "evictions": self.evictions,
            "pending": self.pending,
        }

    def forget(self, key: ObjectKey, *, evicted: bool) -> None:
        """``key`` left the pool (evicted, or deleted when not ``evicted``)."""
        self.retention.forget(key, evicted=evicted)
        self.hints.forget(key)

    def fits_after_evicting(self, size: int, victims: Iterable[int]) -> bool:
        """Whether a ``size``-byte slot would fit once the slots at offsets ``victims`` are
        freed (coalesced with the holes around them)."""
        need, size_of = self.alloc.aligned(size), self.alloc.size_of
        spans = sorted([*self.alloc.holes(), *((off, self.alloc.aligned(size_of(off))) for off in victims)])
        start = end = -1
        for off, length in spans:
            if off != end:
                start = off
            end = off + length
            if end - start >= need:
                return True
        return False

    def release(self) -> None:
        """Drop the memory (a shared pool is unlinked or its descriptor closed; mappings
        made by others stay valid)."""
        shm, self.shm = self.shm, None
        self.array = self.buffer = self.tensor = None
        if shm is not None:
            shm.close()


def make_pools(
    capacity: int,
    alignment: int,
    pin: bool | None,
    shared: bool,
    pools: Mapping[str, int] | None,
    pool_of: object,
    reuse_window: float,
    retention: RetentionPolicy = RetentionPolicy.REUSE,
) -> dict[str, HostPool]:
    """A host tier's pools: one (``""``, in /dev/shm when ``shared``) without ``pools``, else
    one memfd per name, their sizes summing to at most ``capacity`` (``pool_of`` required)."""
    if pools is None:
        backing = Backing.NAMED if shared else Backing.PRIVATE
        return {"": HostPool("", capacity, alignment, backing, pin, reuse_window, retention)}
    if not pools or pool_of is None:
        raise ConfigError("host tier pools need at least one pool and a pool_of function")
    if sum(pools.values()) > capacity:
        raise ConfigError(f"host tier pools hold {sum(pools.values())} bytes, more than its capacity of {capacity}")
    made: dict[str, HostPool] = {}
    try:
        for pool, size in pools.items():
            made[pool] = HostPool(
                pool, size, alignment, Backing.MEMFD, pin=False, reuse_window=reuse_window, retention=retention
            )
    except BaseException:
        for made_pool in made.values():
            made_pool.release()
        raise
    return made


def allocate(capacity: int, pin: bool | None) -> tuple[np.ndarray, object]:
    """The tier's one buffer: pinned (resident) with CUDA, else prefaulted numpy memory."""
    if pin is not False:
        import torch  # lazily: only the CUDA probe and the pinned path need it

        if torch.cuda.is_available():
            tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            return tensor.numpy(), tensor
        if pin:
            raise ConfigError("pin=True needs CUDA: pinned host memory is a CUDA-only path")
    array = np.empty(capacity, dtype=np.uint8)
    array.fill(0)  # fault every page in now, so later copies run at memcpy speed
    return array, None


__all__ = ["Backing", "HostPool", "allocate", "make_pools"]
