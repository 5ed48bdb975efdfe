"""In-process store-process core for unit stories: a real ``ServerStore`` over a small real
shared host pool (a /dev/shm file) and, where a story needs one, a real ``SSDTier`` in a
temporary directory, all on one fake clock.  No gRPC server, no subprocess.

Puts go the way the servicer sends them (``PutStart`` then ``PutCommit``): reserve under the
tenant-scoped key, write a sealed object made for the client's key into the slot, claim
and finish.  Observations go through the store's public API (``snapshot``, ``lookup``...)
and the tiers the test built itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.config import WritePolicy
from kvstore.keys import ObjectKey
from kvstore.server.config import ServerConfig
from kvstore.server.core import ServerStore
from kvstore.server.metrics import ServerMetrics
from tests.kits import chain as kv
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier

SLOT = 4096  # one host slot unit: an object of SLOT bytes takes exactly one
LEASE_TTL = 1.0
PUT_TTL = 2.0
NS = kv.namespace("server-core")


class FakeClock:
    """Monotonic seconds that move only when a story says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(
    clock: FakeClock, slots: int = 4, lower: Sequence[Tier] = (), policy: WritePolicy = WritePolicy.HOST_ONLY
) -> tuple[ServerStore, HostTier]:
    """A store over a ``slots``-slot shared pool; the caller ``aclose``s it."""
    host = HostTier(slots * SLOT, shared=True, pin=False, clock=clock)
    cfg = ServerConfig(host_capacity=slots * SLOT, lease_ttl=LEASE_TTL, put_ttl=PUT_TTL, write_policy=policy)
    return ServerStore(host, lower, cfg, ServerMetrics(), clock=clock), host


def scoped(key: ObjectKey, tenant: str = "a") -> ObjectKey:
    """The key the servicer stores a tenant's object under."""
    return ObjectKey(key.namespace.scoped(tenant), key.chunk_hash, key.tag)


def keys(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def sealed(key: ObjectKey, size: int = SLOT, seed: int = 0) -> np.ndarray:
    return kv.sealed(key, size, seed)


async def put(store: ServerStore, key: ObjectKey, size: int = SLOT, tenant: str = "a", seed: int = 0) -> PutResult:
    """``PutStart`` + write + ``PutCommit`` of the client key ``key``; the outcome."""
    pending = await store.puts.reserve(tenant, key, scoped(key, tenant), size, None, streamed=False)
    if isinstance(pending, PutResult):
        return pending
    pending.handle.buffer[:] = sealed(key, size, seed)
    return await store.puts.finish(store.puts.claim(pending.put_id, tenant), "shm")


async def put_lower(tier: Tier, key: ObjectKey, size: int = SLOT, tenant: str = "a", seed: int = 0) -> None:
    """Store the object straight in a lower tier, as a write-through would have left it."""
    obj = sealed(scoped(key, tenant), size, seed)
    assert await put_bytes(tier, scoped(key, tenant), memoryview(obj)) is PutResult.STORED


def gauges(store: ServerStore) -> dict[str, int]:
    """Leases held, puts in flight and the host pool's bytes, references and doomed slots
    (``snapshot`` reaps nothing, so a story sees exactly what ``reap`` changes)."""
    snap = store.snapshot()
    host = snap.tiers["host"]
    return {
        "leases": snap.leases_held,
        "puts": snap.puts_in_flight,
        "bytes": int(host["bytes_used"]),
        "refs": int(host["refs_held"]),
        "doomed": int(host["doomed"]),
        "objects": int(host["objects"]),
    }
