"""SSD tier under tenants, against real files in tmp_path: modes 0600/0700, a rebuild that
never follows a symlink, and partitions (one per tenant) whose quotas are each tenant's
limit and guaranteed share."""

from __future__ import annotations

import os
import stat

import pytest
from test_ssd_tier import CHAIN, SIZE, kv_files, make_obj, store  # noqa: E402 - shared helpers

from kvstore.errors import CapacityError
from kvstore.keys import ObjectKey, tenant_mark
from tiers.base import PutResult, put_bytes
from tiers.ssd import SSDTier

MARKS = {tenant_mark(t): t for t in ("a", "b")}


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_objects_are_0600_in_0700_directories(tmp_path):
    tier = SSDTier(tmp_path / "ssd", 1 << 20)
    await store(tier, CHAIN.keys(3, seed=1))
    files = kv_files(tmp_path / "ssd")
    assert files and {mode(f) for f in files} == {0o600}
    assert {mode(f.parent) for f in files} == {0o700}
    assert mode(tmp_path / "ssd") == mode(tmp_path / "ssd" / "tmp") == 0o700
    assert mode(tmp_path / "ssd" / "LOCK") == 0o600
    await tier.aclose()


async def test_files_of_an_older_version_are_tightened_at_start(tmp_path):
    tier = SSDTier(tmp_path / "ssd", 1 << 20)
    await store(tier, CHAIN.keys(2, seed=2))
    await tier.aclose()
    for f in kv_files(tmp_path / "ssd"):
        os.chmod(f, 0o644)
        os.chmod(f.parent, 0o755)
    tier = SSDTier(tmp_path / "ssd", 1 << 20)
    assert tier.stats().objects == 2
    assert {mode(f) for f in kv_files(tmp_path / "ssd")} == {0o600}
    assert {mode(f.parent) for f in kv_files(tmp_path / "ssd")} == {0o700}
    await tier.aclose()


async def test_the_rebuild_never_follows_a_symlinked_tmp_or_shard(tmp_path):
    """The issue's attack: tmp/ made a symlink to a directory of precious files; the rebuild
    used to delete them.  Now the link goes and the target is untouched, the same for a
    symlinked shard and a symlinked object file."""
    precious = tmp_path / "precious"
    precious.mkdir()
    for name in ("a.txt", "b.kv"):
        (precious / name).write_text("keep me")
    root = tmp_path / "ssd"
    tier = SSDTier(root, 1 << 20)
    await store(tier, CHAIN.keys(1, seed=3))
    await tier.aclose()
    os.rmdir(root / "tmp")
    os.symlink(precious, root / "tmp")
    os.symlink(precious, root / "zz")  # a "shard" that is a link
    shard = kv_files(root)[0].parent
    os.symlink(precious / "b.kv", shard / ("x" * 8 + ".kv"))  # an "object" that is a link
    tier = SSDTier(root, 1 << 20)
    assert sorted(p.name for p in precious.iterdir()) == ["a.txt", "b.kv"]
    assert (precious / "b.kv").read_text() == "keep me"
    assert not (root / "tmp").is_symlink() and (root / "tmp").is_dir()
    assert not os.path.lexists(root / "zz") and not os.path.lexists(shard / ("x" * 8 + ".kv"))
    assert tier.stats().objects == 1
    await tier.aclose()


def scoped(tenant: str, n: int, seed: int) -> list[ObjectKey]:
    return CHAIN.scoped(tenant).keys(n, seed)


def partitioned(root, capacity: int, quotas: dict[str, int]) -> SSDTier:
    return SSDTier(root, capacity, partition=lambda key: MARKS.get(bytes(key[:8])), quotas=quotas)


async def put(tier: SSDTier, key: ObjectKey) -> PutResult:
    return await put_bytes(tier, key, memoryview(make_obj(key)))


async def test_a_tenants_flood_never_evicts_another_tenants_objects(tmp_path):
    tier = partitioned(tmp_path, 8 * SIZE, {"a": 4 * SIZE, "b": 4 * SIZE})
    mine = scoped("a", 4, seed=10)
    for key in mine:
        assert await put(tier, key) is PutResult.STORED
    for key in scoped("b", 30, seed=11):
        assert await put(tier, key) is PutResult.STORED  # b evicts only its own
    assert all([await tier.contains(k) for k in mine])
    assert tier.partition_stats("a") == {"objects": 4, "bytes_used": 4 * SIZE, "capacity_bytes": 4 * SIZE}
    assert tier.partition_stats("b")["bytes_used"] == 4 * SIZE
    await tier.aclose()


async def test_quota_limits_and_keys_of_no_tenant(tmp_path):
    tier = partitioned(tmp_path, 8 * SIZE, {"a": 2 * SIZE, "b": 6 * SIZE})
    big = scoped("a", 1, seed=12)[0]
    with pytest.raises(CapacityError, match="quota"):
        await tier.put_start(big, 3 * SIZE)
    assert await tier.put_start(scoped("zz", 1, seed=13)[0], SIZE) is None  # no partition: no room
    for key in scoped("a", 3, seed=14):
        assert await put(tier, key) is PutResult.STORED
    assert tier.partition_stats("a")["objects"] == 2  # its quota held
    await tier.aclose()


async def test_orphans_go_first_and_a_smaller_quota_is_trimmed_at_start(tmp_path):
    tier = partitioned(tmp_path, 8 * SIZE, {"a": 4 * SIZE, "b": 4 * SIZE})
    for key in scoped("a", 4, seed=15) + scoped("b", 4, seed=16):
        await put(tier, key)
    await tier.aclose()
    # b is gone from the configuration, a's quota shrank: b's objects are orphans now
    tier = partitioned(tmp_path, 8 * SIZE, {"a": 2 * SIZE, "c": 4 * SIZE})
    assert tier.partition_stats("a")["objects"] == 2 and tier.stats().objects == 6
    MARKS[tenant_mark("c")] = "c"
    try:
        for key in scoped("c", 4, seed=17):
            assert await put(tier, key) is PutResult.STORED  # room made from orphans
        assert tier.partition_stats("c")["objects"] == 4 and tier.partition_stats("a")["objects"] == 2
        assert tier.stats().objects == 8 and tier.stats().evictions == 2 + 2  # 2 trimmed, 2 orphans
    finally:
        del MARKS[tenant_mark("c")]
    await tier.aclose()
