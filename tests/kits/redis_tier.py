"""The one way tests open the Redis tier (``tiers.redis.RedisTier``), test side: against a real
redis-server or Redis Cluster that the conftest fixtures start (``redis_server``,
``redis_factory``, ``redis_cluster``, ``redis_cluster_factory``: kvstore.testing.redis_proc
and .redis_cluster).  The tier runs in the test's event loop; the test closes it.

    tier = await open_redis_tier(redis_server)                      # the defaults below
    tier = await open_redis_tier(server.url_with_auth, max_inflight_parts=1)

``where`` is a URL or anything with a ``url`` (a server or a cluster).  What a test does not
name takes ``TIER_DEFAULTS``, then ``RedisConfig``'s own defaults:

* ``part_size`` = ``PART`` (64 KiB): objects of a few parts stay a few hundred KiB, so a test
  covers the parts layout (and the inline one below ``PART``) without moving megabytes;
* ``retry_s`` = 0.2: a breaker opened by a killed or stopped server probes again soon, so a
  test waiting for it to close waits a fraction of a second;
* ``op_timeout_s`` = 1.0: a frozen server (SIGSTOP) costs a test one second per operation,
  not ``RedisConfig``'s 2 s, and is still far above a command's time on a loaded machine.

Any ``RedisConfig`` field may be given as a keyword (``part_size="16KiB"``, ``ttl_s=0.4``,
``key_prefix=``, ``tls_ca=`` ...) and overrides these defaults for that tier only.
"""

from __future__ import annotations

from typing import Final, Protocol

from tiers.redis import RedisTier
from tiers.redis_config import RedisConfig

KiB = 1024
PART: Final = 64 * KiB
TIER_DEFAULTS: Final[dict[str, object]] = {"part_size": PART, "retry_s": 0.2, "op_timeout_s": 1.0}


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


async def open_redis_tier(where: str | HasUrl, **overrides: object) -> RedisTier:
    """A RedisTier on ``where`` with ``TIER_DEFAULTS`` updated by ``overrides``."""
    url = where if isinstance(where, str) else where.url
    return await RedisTier.open(RedisConfig.from_url(url, **{**TIER_DEFAULTS, **overrides}))
