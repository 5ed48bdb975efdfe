"""A byte budget per key prefix (a tenant) on a shared Redis, kept by the writers themselves
(mixed into ``tiers.redis.RedisTier``; runs on the event loop that owns the tier).

Why: a shared Redis must run with ``maxmemory-policy noeviction`` (Redis's own eviction
cannot be partitioned by tenant: one tenant's writes would empty another's objects), so
each tenant's writers keep it within ``budget_bytes`` by evicting only its own objects.

The accounting lives in Redis, so it holds across every writer (store processes and
connectors on several hosts) of one prefix.  Three keys per prefix, all under one hash tag
(the prefix itself, which may not contain braces), so a Redis Cluster keeps them in one
slot and the scripts below run there::

    {prefix}{{prefix}}b:idx     sorted set: object key -> last use (a logical clock)
    {prefix}{{prefix}}b:held    hash: object key -> "charge:unix seconds of its reservation"
    {prefix}{{prefix}}b:used    the sum of the charges; {prefix}{{prefix}}b:clock the clock

An object's charge is its size plus its manifest (``MANIFEST_SIZE``).  ``put_start``
*reserves* the charge before any byte is written (``RESERVE``, one Lua script: atomic with
respect to every other writer): when the prefix would exceed its budget it takes least
recently used objects out of the index first and returns them, and the writer then deletes
them (manifest first, so readers stop seeing them, then their data).  An object larger than
the whole budget is refused (``CapacityError``, counted as ``budget_refused``) without
evicting anything.  A put that is not published gives its reservation back (``RELEASE``); a
published one confirms it (``RESERVE`` again: a no-op touch, or a new reservation when
another writer evicted the object meanwhile).  A read that hits refreshes the object's last
use (``TOUCH``, one small script; the Redis tier has no chain notion, its manifests name no
parent, so victims are chosen least recently used first only).

Crashes: the object keys live in other cluster slots than the index, so no script can
cover both.  A writer dying between ``RESERVE`` and its write leaves an index entry with no
manifest (the budget over-counts: safe); one dying between ``RESERVE`` and deleting its
victims leaves objects nobody counts (the prefix may be over budget).  ``budget_sweep``
repairs both: manifests missing from the index are adopted (reserved, evicting as needed),
and entries without a manifest older than ``orphan_ttl_s`` (after which a put's data has
expired by itself) are released.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from redis import exceptions as rx

from kvstore.errors import CapacityError
from kvstore.keys import ObjectKey
from tiers.base import Removal, TierStats
from tiers.redis_manifest import MANIFEST_SIZE, Manifest, parse
from tiers.redis_nodes import Down

if TYPE_CHECKING:
    from tiers.redis_config import RedisConfig

RESERVE = """
local budget, charge = tonumber(ARGV[1]), tonumber(ARGV[3])
local now = redis.call('INCR', KEYS[4])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[1], now, ARGV[2])
  return {1}
end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if charge > budget then return {-1, used} end
local out = {0}
while used + charge > budget do
  local lru = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #lru == 0 then used = 0 break end
  local held = redis.call('HGET', KEYS[2], lru[1]) or '0'
  used = used - tonumber(string.match(held, '^%d+'))
  redis.call('ZREM', KEYS[1], lru[1])
  redis.call('HDEL', KEYS[2], lru[1])
  out[#out + 1] = lru[1]
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3] .. ':' .. t[1])
redis.call('SET', KEYS[3], used + charge)
return out
"""

RELEASE = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return 0 end
if ARGV[2] ~= '' and tonumber(string.match(held, ':(%d+)$')) > tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[3], -tonumber(string.match(held, '^%d+')))
return 1
"""

TOUCH = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[1])
end
return 0
"""


def budget_keys(prefix: str) -> dict[str, str]:
    """The accounting keys of ``prefix`` (one hash tag: one cluster slot)."""
    base = f"{prefix}{{{prefix}}}b:"
    return {name: base + name for name in ("idx", "held", "used", "clock")}


class RedisBudget:
    """Needs from its host class (``RedisTier``): ``cfg``, ``_client``, ``_node``, ``_allow``,
    ``_call``, ``_manifest``, ``_drop``, ``_removed``, ``_stats``, ``_budget_counts`` (a dict)."""

    if TYPE_CHECKING:  # what the host class provides, declared for the type checker only
        cfg: RedisConfig
        _stats: TierStats
        _budget_counts: dict[str, int]
        _client: Any

        def _node(self, key: str) -> str: ...
        def _allow(self, node: str) -> bool: ...
        async def _call(self, node: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any: ...
        async def _manifest(self, key: ObjectKey) -> tuple[bytes, Manifest] | None: ...
        async def _drop(self, key: ObjectKey, raw: bytes, manifest: Manifest | None, release: bool = True) -> None: ...
        async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]: ...
        def _removed(self, key: ObjectKey, reason: Removal) -> None: ...

    def _bkeys(self) -> dict[str, str]:
        return budget_keys(self.cfg.key_prefix)

    async def _script(self, script: str, keys: list[str], *args: Any) -> Any:
        """Run one budget script on the node of the budget keys (``Down``/error replies raise)."""
        node = self._node(keys[0])
        if not self._allow(node):
            raise Down(node)
        return await self._call(node, self._client.eval, script, len(keys), *keys, *args)

    async def _reserve(self, key: ObjectKey, size: int) -> bool | None:
        """Reserve ``key``'s charge, evicting this prefix's LRU objects as needed.  True: a
        new reservation (ours to give back), False: the key was already counted, None: the
        budget is unreachable.  ``CapacityError`` (counted) when it can never fit."""
        k = self._bkeys()
        charge = size + MANIFEST_SIZE
        try:
            reply = await self._script(
                RESERVE, [k["idx"], k["held"], k["used"], k["clock"]], self.cfg.budget_bytes, key.printable(), charge
            )
        except (Down, rx.RedisError):
            return None
        if reply[0] == -1:
            self._budget_counts["budget_refused"] += 1
            raise CapacityError(
                f"object of {size} bytes (+{MANIFEST_SIZE} manifest) exceeds budget_bytes "
                f"{self.cfg.budget_bytes} of key prefix {self.cfg.key_prefix!r} on "
                f"{self.cfg.redacted_url}; nothing was evicted"
            )
        await self._evict([v.decode() if isinstance(v, bytes) else str(v) for v in reply[1:]])
        return reply[0] == 0

    async def _evict(self, members: list[str]) -> None:
        """Delete objects the budget took out of the index (manifest first, then data)."""
        for member in members:
            key = ObjectKey.parse(member)
            found = await self._manifest(key)
            self._budget_counts["budget_evicted"] += 1
            self._stats.evictions += 1
            if found is not None:
                await self._drop(key, *found, release=False)
                self._removed(key, Removal.EVICTED)

    async def _release(self, key: ObjectKey, older_than_s: int | None = None) -> bool:
        """Give ``key``'s reservation back (when made before ``older_than_s``, if given)."""
        k = self._bkeys()
        with suppress(Down, rx.RedisError):
            return bool(
                await self._script(
                    RELEASE,
                    [k["idx"], k["held"], k["used"]],
                    key.printable(),
                    "" if older_than_s is None else older_than_s,
                )
            )
        return False

    async def _touch(self, key: ObjectKey) -> None:
        """Refresh ``key``'s last use (a read hit)."""
        k = self._bkeys()
        with suppress(Down, rx.RedisError):
            await self._script(TOUCH, [k["idx"], k["clock"]], key.printable())

    async def budget_usage(self) -> tuple[int, int]:
        """(bytes counted, objects counted) of this prefix, as the index in Redis says."""
        k = self._bkeys()
        node = self._node(k["used"])
        used = await self._call(node, self._client.get, k["used"])
        count = await self._call(node, self._client.zcard, k["idx"])
        return int(used or 0), int(count)

    async def budget_sweep(self) -> dict[str, int]:
        """Repair the index after crashed writers (see the module docstring): ``adopted``
        manifests nobody counted, ``released`` stale entries with no manifest."""
        k = self._bkeys()
        node = self._node(k["held"])
        held = await self._call(node, self._client.hgetall, k["held"])
        counted = {m.decode() for m in held}
        adopted = released = 0
        mprefix = f"{self.cfg.key_prefix}m:"  # tiers.redis_manifest.manifest_key
        async for name in self._client.scan_iter(match=mprefix + "*", count=1000):
            member = name.decode()[len(mprefix) :]
            if member in counted:
                continue
            raw = await self._client.get(name)
            manifest = parse(raw) if isinstance(raw, bytes) else None
            if manifest is not None:
                with suppress(CapacityError):
                    adopted += bool(await self._reserve(ObjectKey.parse(member), manifest.size))
        now = int((await self._call(node, self._client.time))[0])
        stale = now - int(self.cfg.orphan_ttl_s)
        members = [ObjectKey.parse(m) for m in sorted(counted)]
        for key, size in zip(members, await self.sizes(members)):
            if size is None:
                released += await self._release(key, older_than_s=stale)
        return {"adopted": adopted, "released": released}


__all__ = ["RESERVE", "RELEASE", "TOUCH", "RedisBudget", "budget_keys"]
