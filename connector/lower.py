"""The connector's tiers below host DRAM: opening them, and writing saved chunks down.

Runs in the engine's scheduler process, on the connector's I/O loop.

Tiers, fastest first: the SSD directory (``ssd_dir``), the host's store process
(``store_target``, ``kvstore.client.tier``) and Redis (``redis_url``, ``tiers.redis``).  An
unreachable store process or Redis at start is a ``TierUnavailableError`` unless
``lower_tiers_required`` is false; then the tier is left out (logged and counted) and the
engine runs without it.

Write policies (``write_policy``):

* ``write_through``: each committed chunk is copied to every lower tier right away (in the
  background; a reference keeps its host slot alive meanwhile).  Other engines see it at
  once.
* ``write_back``: committed chunks stay in host DRAM only, *dirty*: a dirty chunk holds a
  reference, so it is never evicted unwritten.  When dirty chunks exceed ``DIRTY_FRACTION``
  of the pool, the oldest are written down until half of that remains; each then becomes
  clean and evictable.  Everything dirty is written at shutdown.  Bursts of saves cost no
  lower-tier bandwidth while they fit, at the price of later visibility to other engines.

A failing lower tier costs a counted failure, never the chunk in host memory.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from connector.config import ConnectorConfig
from connector.ioloop import IOLoop
from kvstore.config import WritePolicy
from kvstore.errors import TierError
from kvstore.keys import ObjectKey
from tiers.base import PutResult, Tier, put_bytes
from tiers.host import HostTier

log = logging.getLogger("kvstore.connector")
DIRTY_FRACTION = 0.5  # write-back: at most this share of the host pool is unwritten


async def open_lower_tiers(cfg: ConnectorConfig, on_fail: Callable[[str, str], None]) -> list[Tier]:
    tiers: list[Tier] = []
    if cfg.ssd_dir is not None:
        from tiers.ssd import SSDTier

        tiers.append(await SSDTier.open(cfg.ssd_dir, cfg.ssd_capacity))
    for name, wanted, opener in (("remote", cfg.store_target, _open_remote), ("redis", cfg.redis_url, _open_redis)):
        if not wanted:
            continue
        try:
            tiers.append(await opener(cfg))
        except TierError as err:
            if cfg.lower_tiers_required:
                for tier in tiers:
                    await tier.aclose()
                raise
            on_fail(name, "open")
            log.warning("kvstore: %s tier left out (lower_tiers_required=false): %s", name, err)
    return tiers


async def _open_remote(cfg: ConnectorConfig) -> Tier:
    from kvstore.client.tier import RemoteTier

    return await RemoteTier.open(cfg.store_target, token=cfg.store_token or None,
                                 tls_ca=cfg.store_tls_ca, transport=cfg.store_transport)


async def _open_redis(cfg: ConnectorConfig) -> Tier:
    from tiers.redis import RedisTier
    from tiers.redis_config import RedisConfig

    return await RedisTier.open(RedisConfig.from_url(cfg.redis_url))


class WriteDown:
    """Copies committed host objects to the lower tiers under the configured policy."""

    def __init__(self, host: HostTier, lower: list[Tier], io: IOLoop, policy: WritePolicy,
                 on_bytes: Callable[[str, str, int], None], on_fail: Callable[[str, str], None]) -> None:
        self.host, self.lower, self.io, self.policy = host, lower, io, policy
        self._on_bytes, self._on_fail = on_bytes, on_fail
        self._lock = threading.Lock()  # guards _dirty, _dirty_bytes, _flushing
        self._dirty: OrderedDict[ObjectKey, tuple[memoryview, ObjectKey | None]] = OrderedDict()
        self._dirty_bytes = 0
        self._flushing = False
        self.limit = int(host.stats().capacity_bytes * DIRTY_FRACTION)
        self.written = 0  # objects stored in at least one lower tier

    @property
    def dirty_bytes(self) -> int:
        with self._lock:
            return self._dirty_bytes

    def committed(self, key: ObjectKey, parent: ObjectKey | None) -> None:
        """``key`` was just published in the host tier (scheduler thread)."""
        if not self.lower or self.policy is WritePolicy.HOST_ONLY:
            return
        view = self.host.acquire(key)  # the reference keeps the slot alive while it is copied
        if view is None:
            return
        if self.policy is WritePolicy.WRITE_THROUGH:
            self.io.spawn(self._write(key, view, parent))
            return
        with self._lock:
            if key in self._dirty:
                self.host.release(key)
                return
            self._dirty[key] = (view, parent)
            self._dirty_bytes += len(view)
            start = self._dirty_bytes > self.limit and not self._flushing
            self._flushing = self._flushing or start
        if start:
            self.io.spawn(self._flush(self.limit // 2))

    async def _flush(self, target: int) -> None:
        try:
            while True:
                with self._lock:
                    if self._dirty_bytes <= target or not self._dirty:
                        return
                    key, (view, parent) = self._dirty.popitem(last=False)
                    self._dirty_bytes -= len(view)
                await self._write(key, view, parent)
        finally:
            with self._lock:
                self._flushing = False

    async def _write(self, key: ObjectKey, view: memoryview, parent: ObjectKey | None) -> None:
        try:
            stored = False
            for tier in self.lower:
                try:
                    result = await put_bytes(tier, key, view, parent)
                except Exception as err:  # noqa: BLE001 - the object stays in host memory
                    self._on_fail(tier.name, f"write:{type(err).__name__}")
                    continue
                if result is PutResult.STORED:
                    stored = True
                    self._on_bytes(tier.name, "write", len(view))
                elif result in (PutResult.NO_ROOM, PutResult.FAILED):
                    down = tier.stats().extra.get("breaker_open", 0) == 1
                    self._on_fail(tier.name, f"write:{'unavailable' if down else result.value}")
            self.written += stored
        finally:
            self.host.release(key)

    def flush_all(self) -> None:
        """Write every dirty object down (shutdown); blocks until done."""
        if self.policy is WritePolicy.WRITE_BACK and self.lower:
            self.io.run(self._flush(0))
