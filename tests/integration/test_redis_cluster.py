"""The Redis tier on a real 3-node Redis Cluster: parts spread over the nodes, a 512-key
present() in one round trip per node, a byte budget kept by two writers (index keys in one
slot), and one node killed: objects with any key on it are
misses (no exception, nothing deleted, no wrong bytes), every other object still hits."""

from __future__ import annotations

import asyncio

import numpy as np
from redis.crc import key_slot

from kvstore.keys import ObjectKey
from tests.kits import chain as kv
from tests.kits.redis_tier import open_redis_tier
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier
from tiers.redis_manifest import data_keys, manifest_key, unpack

PART = 16 * 1024  # every tier here names this part size: 4-part objects spread over 3 nodes
SIZE = 3 * PART + 100  # 4 parts
NS = kv.namespace("redis-cluster")


def keys_of(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def make_object(key: ObjectKey, size: int = SIZE) -> np.ndarray:
    return kv.make_object(key, size)


def slot_owners(cluster) -> dict[int, int]:
    """slot -> index of the node serving it, from CLUSTER SLOTS of a live node."""
    ports = {n.port: i for i, n in enumerate(cluster.nodes)}
    node = next(n for n in cluster.nodes if n.running)
    with node.client() as c:
        ranges = c.execute_command("CLUSTER SLOTS")
    return {slot: ports[int(r[2][1])] for r in ranges for slot in range(int(r[0]), int(r[1]) + 1)}


def object_nodes(cluster, owners: dict[int, int], key: ObjectKey) -> set[int]:
    """The nodes holding ``key``'s manifest or any of its data (its inline value or parts)."""
    with cluster.client() as c:
        manifest = unpack(c.get(manifest_key("kvstore:", key)))
    names = [manifest_key("kvstore:", key), *data_keys("kvstore:", key, manifest)]
    return {owners[key_slot(n.encode())] for n in names}


async def read_back(tier: RedisTier, key: ObjectKey, size: int = SIZE) -> np.ndarray | None:
    out = np.empty(size, np.uint8)
    n = await tier.read_into(key, memoryview(out))
    return None if n is None else out


async def test_parts_spread_over_all_nodes_and_read_back(redis_cluster):
    tier = await open_redis_tier(redis_cluster, part_size=PART)
    keys = keys_of(12, 1)
    for key in keys:
        assert await put_bytes(tier, key, memoryview(make_object(key))) is PutResult.STORED
    owners = slot_owners(redis_cluster)
    spans = [object_nodes(redis_cluster, owners, key) for key in keys]
    assert set().union(*spans) == {0, 1, 2}
    assert sum(len(s) >= 2 for s in spans) >= 9  # one object's keys are not pinned to one slot
    for node in redis_cluster.nodes:
        with node.client() as c:
            assert c.dbsize() > 0
    for key in keys:
        got = await read_back(tier, key)
        assert got is not None and np.array_equal(got, make_object(key))
    assert tier.stats().hits == 12
    for key in keys:
        assert await tier.delete(key)
    assert await tier.lookup(keys) == 0
    await tier.aclose()


async def test_present_of_512_keys_is_one_round_trip_per_node(redis_cluster):
    tier = await open_redis_tier(redis_cluster, part_size=PART)
    keys = keys_of(512, 2)
    stored = {i for i in range(512) if i % 3 != 1}
    small = 300
    for i in sorted(stored):
        assert await put_bytes(tier, keys[i], memoryview(make_object(keys[i], small))) is PutResult.STORED
    trips = tier.stats().extra["round_trips"]
    flags = await tier.present(keys)
    assert flags == [i in stored for i in range(512)]
    assert tier.stats().extra["round_trips"] - trips == 3
    assert await tier.lookup(keys) == 1
    for i in stored:
        await tier.delete(keys[i])
    await tier.aclose()


async def test_killed_node_costs_misses_on_its_keys_only(redis_cluster_factory):
    cluster = redis_cluster_factory(appendonly=True)  # the victim's data survives its restart
    tier = await open_redis_tier(cluster, part_size=PART)
    keys = keys_of(30, 3)
    sizes = {key: (PART - 5, 2 * PART, SIZE)[i % 3] for i, key in enumerate(keys)}  # 1, 2, 4 parts
    for key in keys:
        assert await put_bytes(tier, key, memoryview(make_object(key, sizes[key]))) is PutResult.STORED
    owners = slot_owners(cluster)
    spans = {key: object_nodes(cluster, owners, key) for key in keys}
    victim = 1
    cluster.kill(victim)
    alive = [k for k in keys if victim not in spans[k]]
    dead = [k for k in keys if victim in spans[k]]
    assert alive and dead
    for _ in range(2):  # before and after the victim's breaker opened
        for key in keys:
            got = await read_back(tier, key, sizes[key])
            if key in alive:
                assert got is not None and np.array_equal(got, make_object(key, sizes[key]))
            else:
                assert got is None
    flags = await tier.present(keys)
    for key, flag in zip(keys, flags):
        on_victim = owners[key_slot(manifest_key("kvstore:", key).encode())] == victim
        assert flag is (not on_victim)
    s = tier.stats()
    assert s.hits == 2 * len(alive) and s.misses == 2 * len(dead)
    assert (s.corrupt, s.extra["lost"]) == (0, 0)  # unreachable is not lost: nothing deleted
    assert s.extra["breaker_opened"] >= 1 and s.extra["breaker_open"] == 1.0
    new = keys_of(16, 4)  # one part each: about half of them avoid the dead node
    results = [await put_bytes(tier, key, memoryview(make_object(key, PART - 5))) for key in new]
    assert PutResult.STORED in results  # puts whose keys avoid the dead node still work
    assert set(results) <= {PutResult.STORED, PutResult.FAILED, PutResult.NO_ROOM}
    await asyncio.to_thread(cluster.restart, victim)
    for _ in range(100):  # the node's breaker closes after a probe interval or two
        if tier.stats().extra["breaker_open"] == 0:
            break
        await asyncio.sleep(0.05)
    for key in keys:  # the victim's keys were never deleted: everything hits again
        got = await read_back(tier, key, sizes[key])
        assert got is not None and np.array_equal(got, make_object(key, sizes[key]))
    await tier.aclose()


async def test_resharding_moves_slots_and_reads_stay_whole(redis_cluster_factory):
    """Slots migrate between nodes under an open tier (``redis-cli --cluster reshard``): every
    object still reads back verified or is a counted miss; none is ever wrong."""
    import shutil
    import subprocess

    cluster = redis_cluster_factory()
    tier = await open_redis_tier(cluster, part_size=PART)
    keys = keys_of(40, 5)
    for key in keys:
        assert await put_bytes(tier, key, memoryview(make_object(key))) is PutResult.STORED
    before = slot_owners(cluster)
    with cluster.nodes[0].client() as c:
        ids = {
            int(addr.split(":")[1].split("@")[0]): info["node_id"]
            for addr, info in c.execute_command("CLUSTER NODES").items()
        }
    src, dst = ids[cluster.nodes[0].port], ids[cluster.nodes[1].port]
    run = await asyncio.to_thread(
        subprocess.run,
        [
            shutil.which("redis-cli"),
            "--cluster",
            "reshard",
            f"127.0.0.1:{cluster.nodes[0].port}",
            "--cluster-from",
            src,
            "--cluster-to",
            dst,
            "--cluster-slots",
            "3000",
            "--cluster-yes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    after = slot_owners(cluster)
    moved = [s for s in before if before[s] != after[s]]
    assert len(moved) == 3000 and all(after[s] == 1 for s in moved)
    hits = 0
    for key in keys:
        got = await read_back(tier, key)
        if got is not None:
            assert np.array_equal(got, make_object(key))
            hits += 1
    assert hits == len(keys)  # migrated keys move with their slots: nothing is lost
    assert (tier.stats().corrupt, tier.stats().extra["lost"]) == (0, 0)
    # MOVED on the bulk path refreshes the slot map; no read runs into redis-py closing its
    # connections under concurrent commands (which would open a breaker: misses for a while)
    assert tier.stats().extra["breaker_opened"] == 0
    owners = slot_owners(cluster)
    assert any(1 in object_nodes(cluster, owners, k) and 0 in object_nodes(cluster, before, k) for k in keys)
    await tier.aclose()


async def test_a_budget_holds_across_nodes_with_two_writers(redis_cluster):
    """``budget_bytes`` on a cluster (``tiers.redis_budget``): the index keys share one slot
    (the prefix's hash tag), the objects spread over the nodes; two writers of one prefix stay
    within the budget, counted from every node's keys; the sweep finds nothing to repair."""
    prefix, budget = "kvstore:bud:", 10 * (SIZE + 40)
    w1, w2 = [
        await open_redis_tier(redis_cluster, part_size=PART, key_prefix=prefix, budget_bytes=budget) for _ in range(2)
    ]
    keys = keys_of(40, seed=11)

    async def put_all(tier: RedisTier, mine: list[ObjectKey]) -> list[PutResult]:
        return [await put_bytes(tier, k, memoryview(make_object(k))) for k in mine]

    results = await asyncio.gather(put_all(w1, keys[0::2]), put_all(w2, keys[1::2]))
    assert all(r is PutResult.STORED for rs in results for r in rs)
    held, nodes = 0, set()
    for i, node in enumerate(redis_cluster.nodes):
        with node.client() as c:
            names = [n for n in c.scan_iter(match=prefix + "*") if b"{" not in n]
            held += sum(c.strlen(n) for n in names)
            nodes |= {i} if names else set()
    assert 0 < held <= budget and len(nodes) > 1
    assert (await w1.budget_usage())[1] == 10
    assert w1.stats().extra["budget_evicted"] + w2.stats().extra["budget_evicted"] == 30
    assert await w1.budget_sweep() == {"adopted": 0, "released": 0}
    plain = await open_redis_tier(redis_cluster, part_size=PART, key_prefix=prefix)  # counts nothing (a crash)
    strays = keys_of(6, seed=12)
    assert await put_all(plain, strays) == [PutResult.STORED] * 6
    assert await w1.budget_sweep() == {"adopted": 6, "released": 0}  # found on every node
    assert (await w1.budget_usage())[0] <= budget
    for t in (w1, w2, plain):
        await t.aclose()
