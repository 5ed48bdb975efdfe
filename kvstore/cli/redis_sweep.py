"""``kvstore redis-sweep URL``: repair one key prefix's Redis budget index after a writer
crashed (``tiers.redis_budget``: manifests nobody counted are adopted, stale reservations
released).  Runs on any host that reaches the Redis, as the prefix's own user; prints one
JSON line: what it repaired and the prefix's usage after."""

from __future__ import annotations

import asyncio
import json


def register(sub) -> None:
    p = sub.add_parser("redis-sweep", help="repair a Redis key prefix's budget index after a crashed writer")
    p.add_argument(
        "url",
        help="the tier's URL with key_prefix, budget_bytes and credentials (password_file=...), as its writers use it",
    )
    p.set_defaults(func=_run)


async def sweep(url: str) -> dict[str, int]:
    """Sweep the prefix of ``url``; the repairs and the usage after."""
    from tiers.redis import RedisTier  # lazily: redis-py only for this command
    from tiers.redis_config import RedisConfig

    async with await RedisTier.open(RedisConfig.from_url(url)) as tier:
        repaired = await tier.budget_sweep()
        used, objects = await tier.budget_usage()
    return {**repaired, "used_bytes": used, "objects": objects, "budget_bytes": tier.cfg.budget_bytes}


def _run(args) -> int:
    print(json.dumps(asyncio.run(sweep(args.url))))
    return 0


__all__ = ["sweep"]
