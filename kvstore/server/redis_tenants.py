"""The store process's Redis tier when tenants share one Redis: one connection (and Redis ACL
user), key prefix and byte budget per tenant.  Server side, on the store's event loop.

The operator writes ``--redis`` with ``{tenant}`` placeholders, e.g.::

    redis://kvstore-{tenant}@redis:6379/0?password_file=/etc/kvstore/redis-{tenant}.password&key_prefix=kvstore:{tenant}:

(the users, password files and prefixes ``kvstore redis-acl`` makes).  ``tenant_configs``
substitutes each tenant's name and gives it ``budget_bytes`` = its ``redis_bytes`` from the
tokens file (``kvstore.server.tenants``; else the URL's own ``budget_bytes``, if any).  The
key prefix must contain ``{tenant}``: each tenant's objects and budget accounting are its
own.  ``TenantRedis`` routes every key to its tenant's ``tiers.redis.RedisTier`` by the key's
tenant mark, so a tenant's objects are only ever written, read or deleted over that
tenant's connection: a bug in the store cannot write under another tenant's prefix with it
(Redis refuses: NOPERM).  A key of no configured tenant is a miss and is never stored.
A put refused by the tenant's budget counts ``redis_bytes`` in the tenant's refusals.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from kvstore.errors import CapacityError, ConfigError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle, Residency, Tier, TierBase, TierStats

if TYPE_CHECKING:  # redis-py is imported only when a --redis URL names {tenant}
    from tiers.redis import RedisTier
    from tiers.redis_config import RedisConfig

TENANT = "{tenant}"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # what kvstore redis-acl accepts


def tenant_configs(url: str, budgets: Mapping[str, int | None]) -> dict[str, RedisConfig]:
    """Each tenant's config: ``url`` with its name, and its budget (see the module docstring)."""
    from tiers.redis_config import RedisConfig

    if not budgets:
        raise ConfigError("--redis names {tenant} but the store has no tenants (a tokens file's tenants)")
    out: dict[str, RedisConfig] = {}
    for tenant, budget in sorted(budgets.items()):
        if not _NAME.match(tenant):
            raise ConfigError(f"tenant {tenant!r} cannot be put in the --redis URL: 1-64 of [A-Za-z0-9_.-]")
        options = {} if budget is None else {"budget_bytes": budget}
        out[tenant] = RedisConfig.from_url(url.replace(TENANT, tenant), **options)
    prefixes = {cfg.key_prefix for cfg in out.values()}
    if len(prefixes) != len(out):
        raise ConfigError(
            "--redis names {tenant} but its key_prefix does not: every tenant needs its own "
            "prefix (e.g. key_prefix=kvstore:{tenant}:)"
        )
    return out


def redis_specs(url: str | None, limits: Mapping[str, Any]) -> list[tuple[str | None, dict]]:
    """The store's Redis spec for ``kvstore.store.registry`` (none when ``url`` names
    ``{tenant}``: ``open_tenant_redis`` opens those, their configs checked here first).  A
    ``redis_bytes`` quota without a ``{tenant}`` URL is a ``ConfigError``."""
    if url and TENANT in url:
        tenant_configs(url, budgets_of(limits))
        return []
    asked = sorted(n for n, lim in limits.items() if lim.redis_bytes is not None)
    if asked:
        raise ConfigError(
            f"tenants {', '.join(asked)} have redis_bytes but --redis does not name "
            "{tenant} (one key prefix and budget per tenant; docs/redis-tenants.md)"
        )
    return [(url, {})]


async def open_tenant_redis(url: str | None, tenants: Any) -> list[Tier]:
    """``[TenantRedis]`` when ``url`` names ``{tenant}`` (every tenant connected, or none),
    else ``[]``.  ``tenants``: ``kvstore.server.tenants.Tenants``."""
    if not (url and TENANT in url):
        return []
    from tiers.redis import RedisTier

    tiers: dict[str, RedisTier] = {}
    try:
        for tenant, cfg in tenant_configs(url, budgets_of(tenants.limits)).items():
            tiers[tenant] = await RedisTier.open(cfg)
    except BaseException:
        for tier in tiers.values():
            with suppress(Exception):
                await tier.aclose()
        raise
    return [TenantRedis(tiers, tenants.tenant_of, tenants.refuse)]


def tenant_evictions(lower: Sequence[Tier]) -> dict[tuple[str, str], int]:
    """(tenant, tier) -> objects evicted within the tenant's own budget (``/metrics``)."""
    return {
        (tenant, tier.name): tier.stats().evictions
        for t in lower
        if isinstance(t, TenantRedis)
        for tenant, tier in t.tiers.items()
    }


class TenantRedis(TierBase):
    """One ``RedisTier`` per tenant behind the ``Tier`` interface (see the module docstring)."""

    name = "redis"

    def __init__(
        self,
        tiers: Mapping[str, RedisTier],
        tenant_of: Callable[[bytes], str | None],
        refuse: Callable[[str, str], None],
    ) -> None:
        self.tiers = dict(tiers)
        self._tenant_of = tenant_of
        self._refuse = refuse
        self._residency: Residency | None = None

    @property
    def residency(self) -> Residency | None:
        return self._residency

    @residency.setter
    def residency(self, listener: Residency | None) -> None:
        self._residency = listener
        for tier in self.tiers.values():
            tier.residency = listener

    def _tier(self, key: ObjectKey) -> RedisTier | None:
        tenant = self._tenant_of(bytes(key))
        return None if tenant is None else self.tiers.get(tenant)

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        out: list[int | None] = [None] * len(keys)
        groups: dict[int, tuple[RedisTier, list[int]]] = {}
        for i, key in enumerate(keys):
            tier = self._tier(key)
            if tier is not None:
                groups.setdefault(id(tier), (tier, []))[1].append(i)
        for tier, at in groups.values():
            for i, size in zip(at, await tier.sizes([keys[i] for i in at])):
                out[i] = size
        return out

    async def size_of(self, key: ObjectKey) -> int | None:
        return (await self.sizes([key]))[0]

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        tier = self._tier(key)
        return None if tier is None else await tier.read_into(key, buf)

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        tier = self._tier(key)
        if tier is None:
            return None
        try:
            return await tier.put_start(key, size, parent)
        except CapacityError:
            self._refuse(self._tenant_of(bytes(key)) or "", "redis_bytes")
            raise

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        await self._owner(handle).put_write(handle, offset, data)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        return await self._owner(handle).put_commit(handle, ok)

    def _owner(self, handle: PutHandle) -> RedisTier:
        tier = self._tier(handle.key)
        if tier is None:
            raise RuntimeError(f"put of {handle.key!r} is not in progress on the redis tier")
        return tier

    async def delete(self, key: ObjectKey) -> bool:
        tier = self._tier(key)
        return False if tier is None else await tier.delete(key)

    def stats(self) -> TierStats:
        """Every tenant's counters summed (``partition_stats``: one tenant's)."""
        total = TierStats(self.name)
        for tier in self.tiers.values():
            total = _add(total, tier.stats())
        return total

    def partition_stats(self, tenant: str) -> dict[str, object]:
        """One tenant's Redis counters (its part of ``kvstore stats``): hits, puts, evictions
        and refusals by its budget, and the budget itself as ``capacity_bytes``."""
        tier = self.tiers.get(tenant)
        if tier is None:
            return {}
        s = tier.stats()
        return {
            "capacity_bytes": tier.cfg.budget_bytes,
            "hits": s.hits,
            "misses": s.misses,
            "puts": s.puts,
            "put_failures": s.put_failures,
            "evictions": s.evictions,
            "budget_refused": s.extra.get("budget_refused", 0),
            "key_prefix": tier.cfg.key_prefix,
        }

    async def aclose(self) -> None:
        for tier in self.tiers.values():
            await tier.aclose()


def _add(a: TierStats, b: TierStats) -> TierStats:
    numbers = {
        f.name: getattr(a, f.name) + getattr(b, f.name)
        for f in dataclasses.fields(TierStats)
        if f.name not in ("name", "extra")
    }
    extra = dict(a.extra)
    for k, v in b.extra.items():
        extra[k] = extra.get(k, 0) + v
    return dataclasses.replace(a, **numbers, extra=extra)


def budgets_of(limits: Mapping[str, Any]) -> dict[str, int | None]:
    """Each tenant's ``redis_bytes`` (None: none given)."""
    return {name: lim.redis_bytes for name, lim in limits.items()}


__all__ = [
    "TENANT",
    "TenantRedis",
    "budgets_of",
    "open_tenant_redis",
    "redis_specs",
    "tenant_configs",
    "tenant_evictions",
]
