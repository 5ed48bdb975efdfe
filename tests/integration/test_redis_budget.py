"""Per-tenant byte budgets on a shared Redis kept by our writers (``tiers.redis_budget``),
against a real ``redis-server`` with ``maxmemory-policy noeviction`` and one ACL user per
tenant (``kvstore redis-acl``'s commands):

* tenant b writing far beyond its budget evicts only its own objects, least recently used
  first (a read refreshes recency), and never one of a's; b's bytes, read straight from Redis
  (STRLEN of every key under its prefix), stay within its budget, also with two writers;
* an object larger than the whole budget is refused with a ``CapacityError`` naming
  ``budget_bytes``, counted, and evicts nothing;
* ``budget_sweep`` (and ``kvstore redis-sweep``) repairs what a crashed writer leaves: a
  reservation with no object, and an object nobody counted.

Cost: about 5 s.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kvstore.cli.redis_acl import acl_commands
from kvstore.errors import CapacityError
from tests.kits import chain as kv
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier
from tiers.redis_budget import budget_keys
from tiers.redis_config import RedisConfig
from tiers.redis_manifest import MANIFEST_SIZE

PART = 64 << 10
OBJ = 40 << 10
BUDGET = 400 << 10  # room for 9 objects of OBJ (+ manifest)
NS_A, NS_B = kv.namespace("tenant-a"), kv.namespace("tenant-b")


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    """One noeviction redis-server with users kvstore-a and kvstore-b."""
    from kvstore.testing.redis_proc import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("budget"), maxmemory="64mb", maxmemory_policy="noeviction")
    server.start()
    admin = server.client()
    for tenant in "ab":
        for command in acl_commands(tenant, "kvstore:", password=f"pw-{tenant}-0123456789abcdef")[0]:
            admin.execute_command(*command)
    yield server
    server.stop()


async def tier(server, tenant: str, **options: object) -> RedisTier:
    url = f"redis://kvstore-{tenant}:pw-{tenant}-0123456789abcdef@{server.host}:{server.port}/0"
    return await RedisTier.open(
        RedisConfig.from_url(url, key_prefix=f"kvstore:{tenant}:", part_size=PART, budget_bytes=BUDGET, **options)
    )


def bytes_under(server, prefix: str) -> int:
    """What the prefix's objects hold in Redis, read directly (not our counters)."""
    admin = server.client()
    skip = set(budget_keys(prefix).values())
    return sum(admin.strlen(n) for n in admin.scan_iter(match=prefix + "*") if n.decode() not in skip)


def wipe(server, prefix: str) -> None:
    """Start a test with the prefix empty (the server is shared by the module)."""
    admin = server.client()
    for name in list(admin.scan_iter(match=prefix + "*")):
        admin.delete(name)


async def put_all(t: RedisTier, keys) -> list[PutResult]:
    return [await put_bytes(t, k, kv.make_object(k, OBJ)) for k in keys]


async def test_a_tenant_beyond_its_budget_evicts_only_its_own_least_recently_used(shared_redis):
    a, b = await tier(shared_redis, "a"), await tier(shared_redis, "b")
    mine = kv.keys_of(NS_A, 8, seed=1)
    assert await put_all(a, mine) == [PutResult.STORED] * 8
    theirs = kv.keys_of(NS_B, 60, seed=2)  # 2.4 MiB into a 400 KiB budget
    assert await put_all(b, theirs[:9]) == [PutResult.STORED] * 9  # b's budget is full
    buf = bytearray(OBJ)
    assert await b.read_into(theirs[0], buf) == OBJ  # refreshes theirs[0]
    assert await put_all(b, theirs[9:10]) == [PutResult.STORED]
    assert await b.sizes(theirs[:2]) == [OBJ, None]  # the least recently used went, not the read one
    assert await put_all(b, theirs[10:]) == [PutResult.STORED] * 50
    assert b.stats().extra["budget_evicted"] >= 50
    assert 0 < bytes_under(shared_redis, "kvstore:b:") <= BUDGET
    used, count = await b.budget_usage()
    assert used <= BUDGET and count == 9
    assert await b.sizes(theirs[-9:]) == [OBJ] * 9  # the newest nine stayed
    assert await b.sizes(theirs[:3]) == [None, None, None]
    assert await a.lookup(mine) == 8 and a.stats().extra["budget_evicted"] == 0
    a2 = await tier(shared_redis, "a")  # a fresh connection (a restarted writer)
    for k in mine:
        assert await a2.read_into(k, buf) == OBJ and bytes(buf) == kv.make_object(k, OBJ).tobytes()
    for t in (a, a2, b):
        await t.aclose()


async def test_two_writers_of_one_tenant_together_stay_within_its_budget(shared_redis):
    wipe(shared_redis, "kvstore:b:")
    b1, b2 = await tier(shared_redis, "b"), await tier(shared_redis, "b")
    keys = kv.keys_of(NS_B, 80, seed=3)
    results = await asyncio.gather(put_all(b1, keys[0::2]), put_all(b2, keys[1::2]))
    assert all(r is PutResult.STORED for rs in results for r in rs)
    assert b1.stats().extra["budget_evicted"] > 0 and b2.stats().extra["budget_evicted"] > 0
    assert 0 < bytes_under(shared_redis, "kvstore:b:") <= BUDGET
    used, _ = await b1.budget_usage()
    assert used <= BUDGET
    for t in (b1, b2):
        await t.aclose()


async def test_an_object_larger_than_the_budget_is_refused_and_evicts_nothing(shared_redis):
    wipe(shared_redis, "kvstore:b:")
    b = await tier(shared_redis, "b")
    keys = kv.keys_of(NS_B, 3, seed=4)
    assert await put_all(b, keys) == [PutResult.STORED] * 3
    big = kv.keys_of(NS_B, 1, seed=5)[0]
    with pytest.raises(CapacityError, match="budget_bytes 409600 of key prefix 'kvstore:b:'"):
        await put_bytes(b, big, kv.make_object(big, BUDGET))
    assert b.stats().extra["budget_refused"] == 1 and b.stats().extra["budget_evicted"] == 0
    assert await b.lookup(keys) == 3
    await b.aclose()


async def test_the_sweep_repairs_what_a_crashed_writer_leaves(shared_redis):
    wipe(shared_redis, "kvstore:b:")
    b = await tier(shared_redis, "b", orphan_ttl_s=0.5)  # reservations are stale at once
    plain = await RedisTier.open(
        RedisConfig.from_url(  # a writer that counts nothing
            f"redis://kvstore-b:pw-b-0123456789abcdef@{shared_redis.host}:{shared_redis.port}/0",
            key_prefix="kvstore:b:",
            part_size=PART,
        )
    )
    ghost, stray = kv.keys_of(NS_B, 2, seed=6)
    assert await b._reserve(ghost, OBJ) is True  # crashed before writing
    assert await put_bytes(plain, stray, kv.make_object(stray, OBJ)) is PutResult.STORED
    admin = shared_redis.client()
    held = budget_keys("kvstore:b:")["held"]
    assert admin.hexists(held, ghost.printable()) and not admin.hexists(held, stray.printable())
    assert await b.budget_sweep() == {"adopted": 1, "released": 1}
    assert not admin.hexists(held, ghost.printable()) and admin.hexists(held, stray.printable())
    used, count = await b.budget_usage()
    assert used <= BUDGET and int(admin.get(budget_keys("kvstore:b:")["used"])) == used
    assert await b.budget_sweep() == {"adopted": 0, "released": 0}
    assert await put_bytes(plain, ghost, kv.make_object(ghost, OBJ)) is PutResult.STORED
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "redis-sweep",  # as an operator runs it
            f"redis://kvstore-b:pw-b-0123456789abcdef@{shared_redis.host}:{shared_redis.port}/0"
            f"?key_prefix=kvstore:b:&budget_bytes={BUDGET}",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == {
        "adopted": 1,
        "released": 0,
        "used_bytes": used + OBJ + MANIFEST_SIZE,
        "objects": count + 1,
        "budget_bytes": BUDGET,
    }
    for t in (b, plain):
        await t.aclose()
