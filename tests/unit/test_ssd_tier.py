"""SSD tier against real files in tmp_path: round trips, re-open, damage, failures.  Eviction
and reads in flight: ``test_ssd_eviction.py``."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from kvstore.codec import HEADER_SIZE, ObjectGeometry, encode_into, object_size, verify
from kvstore.errors import CapacityError, ConfigError, TierUnavailableError
from kvstore.keys import ROOT, Identity, ObjectKey
from tests.kits.chain import Chain
from tiers.base import PutResult, Tier, put_bytes
from tiers.ssd import SSDTier, drop_page_cache

CHAIN = Chain(Identity("test-model", "r1", "bf16", "cpu:test", 2, 2, 64).namespace(), chunk_tokens=4)
PAYLOAD = 4096
SIZE = HEADER_SIZE + PAYLOAD


def make_obj(key: ObjectKey, payload: int = PAYLOAD, parent: ObjectKey | None = None) -> bytearray:
    geometry = ObjectGeometry(1, 1, payload)
    buf = bytearray(object_size(geometry))
    data = random.Random(key).randbytes(payload)
    encode_into(buf, key, geometry, data, parent.chunk_hash if parent is not None else ROOT)
    return buf


async def store(tier: SSDTier, keys: list[ObjectKey], payload: int = PAYLOAD, chained: bool = True) -> None:
    for key in keys:
        parent = CHAIN.parent_of(key) if chained else None
        obj = memoryview(make_obj(key, payload, parent))
        assert await put_bytes(tier, key, obj, parent) is PutResult.STORED


async def read(tier: SSDTier, key: ObjectKey) -> bytearray | None:
    buf = bytearray((await tier.size_of(key) or 0) + 64)  # a little larger than the object
    n = await tier.read_into(key, memoryview(buf))
    return None if n is None else buf[:n]


def kv_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.kv"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("fsync", [True, False])
async def test_round_trip_several_sizes(tmp_path, fsync):
    tier = SSDTier(tmp_path / "ssd", 1 << 30, fsync=fsync)
    assert isinstance(tier, Tier)
    sizes = [1, 255, 4096, (1 << 20) + 3, 8 << 20]
    keys = CHAIN.keys(len(sizes))
    for key, size in zip(keys, sizes):
        obj = make_obj(key, size)
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.EXISTS
        assert await read(tier, key) == obj
        assert await tier.size_of(key) == len(obj)
        assert tier.path_of(key) == tmp_path / "ssd" / key.chunk_hash.hex()[:2] / f"{key.printable()}.kv"
        assert tier.path_of(key).stat().st_size == len(obj)
    st = tier.stats()
    assert (st.objects, st.puts, st.hits, st.corrupt) == (5, 5, 5, 0)
    assert st.bytes_used == st.bytes_written == st.bytes_read == sum(HEADER_SIZE + s for s in sizes)
    await tier.aclose()


async def test_survives_reopen(tmp_path):
    keys = CHAIN.keys(6)
    async with SSDTier(tmp_path, 1 << 30) as tier:
        await store(tier, keys)
    tier = SSDTier(tmp_path, 1 << 30)
    st = tier.stats()
    assert st.objects == len(kv_files(tmp_path)) == 6 and st.bytes_used == 6 * SIZE
    assert st.extra["torn_removed"] == st.extra["corrupt_removed"] == 0
    assert await tier.lookup(keys) == 6
    for key in keys:
        assert await read(tier, key) == make_obj(key, parent=CHAIN.parent_of(key))
    await tier.aclose()


async def test_flipped_payload_byte_is_a_counted_miss(tmp_path):
    keys = CHAIN.keys(2)
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, keys)
    flip(tier.path_of(keys[0]), HEADER_SIZE + 100)
    assert await read(tier, keys[0]) is None
    assert not tier.path_of(keys[0]).exists() and not await tier.contains(keys[0])
    assert await read(tier, keys[1]) is not None
    st = tier.stats()
    assert (st.corrupt, st.misses, st.hits, st.objects) == (1, 1, 1, 1)
    await tier.aclose()


@pytest.mark.parametrize("damage", ["header", "truncate", "extend", "other_key", "bad_name"])
async def test_damaged_files_are_removed_at_scan(tmp_path, damage):
    keys = CHAIN.keys(3)
    async with SSDTier(tmp_path, 1 << 30) as tier:
        await store(tier, keys)
        victim = tier.path_of(keys[1])
    if damage == "header":
        flip(victim, 70)
    elif damage in ("truncate", "extend"):
        os.truncate(victim, SIZE - 1 if damage == "truncate" else SIZE + 1)
    elif damage == "other_key":
        victim.write_bytes(tier.path_of(keys[2]).read_bytes())
    else:
        victim = victim.with_name("not-a-key.kv")
        victim.write_bytes(b"junk")
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.stats().extra["corrupt_removed"] == 1 and not victim.exists()
    expected = 3 if damage == "bad_name" else 2
    assert tier.stats().objects == len(kv_files(tmp_path)) == expected
    assert await read(tier, keys[0]) is not None and await read(tier, keys[2]) is not None
    await tier.aclose()


async def test_stray_temp_files_are_removed_at_scan(tmp_path):
    async with SSDTier(tmp_path, 1 << 30) as tier:
        await store(tier, CHAIN.keys(1))
    (tmp_path / "tmp" / "half-written.1.2.tmp").write_bytes(b"\0" * 1000)
    (tmp_path / "tmp" / "other").write_bytes(b"x")
    tier = SSDTier(tmp_path, 1 << 30)
    st = tier.stats()
    assert st.extra["torn_removed"] == 2 and st.objects == 1
    assert list((tmp_path / "tmp").iterdir()) == []
    await tier.aclose()


async def test_another_keys_object_under_this_name_is_a_miss(tmp_path, caplog):
    a, b = CHAIN.keys(1, seed=1) + CHAIN.keys(1, seed=2)
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, [a, b], chained=False)
    tier.path_of(a).write_bytes(tier.path_of(b).read_bytes())  # same size: only the key differs
    assert await read(tier, a) is None
    assert "expected" in caplog.text  # KeyMismatchError: "object holds ..., expected ..."
    assert not tier.path_of(a).exists() and tier.stats().corrupt == 1
    assert await read(tier, b) is not None
    await tier.aclose()


async def test_file_truncated_while_indexed_is_a_counted_miss(tmp_path):
    key = CHAIN.keys(1)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, [key])
    os.truncate(tier.path_of(key), SIZE - 100)
    assert await read(tier, key) is None
    assert tier.stats().corrupt == 1 and not tier.path_of(key).exists()
    await tier.aclose()


async def test_a_late_removal_never_deletes_a_newer_put_of_the_key(tmp_path):
    key = CHAIN.keys(1)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, [key])
    old_inode = tier.path_of(key).stat().st_ino
    handle = await tier.put_start(key, SIZE)  # a second put of the same key replaces the file
    await tier.put_write(handle, 0, memoryview(make_obj(key)))
    assert await tier.put_commit(handle)
    tier._remove_published(key, old_inode)  # an eviction of the old file, arriving late
    assert await read(tier, key) == make_obj(key) and tier.stats().objects == 1
    await tier.aclose()


async def test_vanished_file_is_a_miss_and_leaves_the_index(tmp_path):
    key = CHAIN.keys(1)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, [key])
    tier.path_of(key).unlink()
    assert await read(tier, key) is None
    assert not await tier.contains(key) and tier.stats().corrupt == 0
    await tier.aclose()


async def test_abandoned_put_leaves_nothing(tmp_path):
    key = CHAIN.keys(1)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    handle = await tier.put_start(key, SIZE)
    await tier.put_write(handle, 0, memoryview(make_obj(key)))
    assert tier.stats().extra["reserved_bytes"] == SIZE
    assert not await tier.put_commit(handle, ok=False)
    await assert_nothing_published(tier, tmp_path, key)
    with pytest.raises(RuntimeError):
        await tier.put_commit(handle)
    await tier.aclose()


async def assert_nothing_published(tier: SSDTier, root: Path, key: ObjectKey) -> None:
    st = tier.stats()
    assert not await tier.contains(key) and await read(tier, key) is None
    assert kv_files(root) == [] and list((root / "tmp").iterdir()) == []
    assert (st.objects, st.puts, st.put_failures, st.extra["reserved_bytes"]) == (0, 0, 1, 0)


@pytest.mark.parametrize("bad", ["other_key", "zeros", "short", "longer_header", "write_error"])
async def test_a_bad_put_is_not_published(tmp_path, bad):
    key, other = CHAIN.keys(1, seed=1)[0], CHAIN.keys(1, seed=2)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    obj = make_obj(other if bad == "other_key" else key, 2 * PAYLOAD if bad == "longer_header" else PAYLOAD)
    data = {"zeros": bytearray(SIZE), "short": obj[: SIZE - 10], "longer_header": obj[:SIZE]}.get(bad, obj)
    handle = await tier.put_start(key, SIZE)
    if bad == "write_error":
        os.close(handle.token.fd)  # the next pwrite fails with EBADF, like a disk error would
    await tier.put_write(handle, 0, memoryview(data))
    assert not await tier.put_commit(handle, ok=True)
    await assert_nothing_published(tier, tmp_path, key)
    await tier.aclose()


async def test_put_write_outside_the_object_is_rejected(tmp_path):
    key = CHAIN.keys(1)[0]
    async with SSDTier(tmp_path, 1 << 30) as tier:
        handle = await tier.put_start(key, SIZE)
        with pytest.raises(ConfigError):
            await tier.put_write(handle, 1, memoryview(make_obj(key)))
        assert not await tier.put_commit(handle, ok=False)


async def test_configuration_failures_lose_nothing(tmp_path):
    keys = CHAIN.keys(3)
    tier = SSDTier(tmp_path / "ssd", 3 * SIZE)
    await store(tier, keys)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="file/ssd.*Not a directory"):
        SSDTier(tmp_path / "file" / "ssd", 1 << 20)
    with pytest.raises(ConfigError, match="capacity"):
        SSDTier(tmp_path / "other", 0)
    with pytest.raises(ConfigError, match="in use"):
        SSDTier(tmp_path / "ssd", 1 << 20)
    with pytest.raises(CapacityError):
        await tier.put_start(CHAIN.keys(1, seed=7)[0], 3 * SIZE + 1)
    with pytest.raises(ConfigError, match="buffer"):
        await tier.read_into(keys[0], memoryview(bytearray(SIZE - 1)))
    assert await tier.lookup(keys) == 3 and tier.stats().evictions == 0
    for key in keys:
        assert await read(tier, key) is not None
    await tier.aclose()
    with pytest.raises(TierUnavailableError):
        await tier.contains(keys[0])


async def test_lookup_delete_and_reopen_with_less_capacity(tmp_path):
    keys = CHAIN.keys(4)
    tier = SSDTier(tmp_path, 1 << 30)
    await store(tier, keys)
    assert await tier.delete(keys[3]) and not await tier.delete(keys[3])
    await store(tier, keys[3:])
    assert await tier.delete(keys[1])
    assert await tier.lookup(keys) == 1 and await tier.lookup([]) == 0
    await store(tier, keys[1:2])
    assert await tier.lookup(keys) == 4 and len(kv_files(tmp_path)) == 4
    await tier.aclose()
    tier = SSDTier(tmp_path, 2 * SIZE)  # shrunk: the chain loses its tails, keys[3] then keys[2]
    assert tier.stats().evictions == 2 and await tier.lookup(keys) == 2
    assert len(kv_files(tmp_path)) == 2 and tier.stats().bytes_used == 2 * SIZE
    await tier.aclose()


async def test_aclose_abandons_puts_in_progress(tmp_path):
    key = CHAIN.keys(1)[0]
    tier = SSDTier(tmp_path, 1 << 30)
    handle = await tier.put_start(key, SIZE)
    await tier.put_write(handle, 0, memoryview(make_obj(key)))
    await tier.aclose()
    assert list((tmp_path / "tmp").iterdir()) == [] and kv_files(tmp_path) == []


async def test_cold_read_after_drop_page_cache(tmp_path):
    key = CHAIN.keys(1)[0]
    async with SSDTier(tmp_path, 1 << 30) as tier:
        await store(tier, [key], payload=1 << 20)
        drop_page_cache(tier.path_of(key))
        assert await read(tier, key) == make_obj(key, 1 << 20)


@pytest.mark.parametrize("seed", range(4))
async def test_random_concurrent_ops_match_the_disk(tmp_path, seed):
    """Concurrent puts, reads and deletes on a small tier; then index == files, all verify."""
    rng = random.Random(seed)
    keys = [k for s in range(6) for k in CHAIN.keys(3, seed=s)]
    tier = SSDTier(tmp_path, 8 * SIZE)

    async def worker(n: int) -> None:
        for _ in range(n):
            key, op = rng.choice(keys), rng.random()
            if op < 0.5:
                await put_bytes(tier, key, memoryview(make_obj(key)))
            elif op < 0.9:
                got = await read(tier, key)
                assert got is None or verify(got, key)
            else:
                await tier.delete(key)

    await asyncio.gather(*(worker(100) for _ in range(6)))
    st = tier.stats()
    on_disk = {ObjectKey.parse(p.name[:-3]) for p in kv_files(tmp_path)}
    assert st.objects == len(on_disk) and st.bytes_used == len(on_disk) * SIZE <= 8 * SIZE
    assert {k for k in keys if await tier.contains(k)} == on_disk
    assert st.extra["reserved_bytes"] == 0 and st.corrupt == 0
    for key in on_disk:
        assert verify(await read(tier, key), key)
    await tier.aclose()


async def test_batch_sizes_match_size_of(tmp_path):
    """``sizes`` answers a whole batch like ``size_of`` per key (used by batched lookups);
    ``present``, ``lookup`` and ``contains`` are ``TierBase``'s over it."""
    tier = SSDTier(tmp_path / "batch", 1 << 20)
    ks = CHAIN.keys(4, seed=77)
    await put_bytes(tier, ks[0], memoryview(make_obj(ks[0], 1000)))
    await put_bytes(tier, ks[2], memoryview(make_obj(ks[2], 5000)))
    expected = [await tier.size_of(k) for k in ks]
    assert expected[1] is None and expected[3] is None and expected[0] < expected[2]
    assert await tier.sizes(ks) == expected
    assert await tier.present(ks) == [True, False, True, False]
    assert await tier.lookup(ks) == 1 and await tier.contains(ks[2]) and not await tier.contains(ks[3])
    await tier.aclose()
    with pytest.raises(TierUnavailableError):  # a closed tier raises: the core counts a miss
        await tier.sizes(ks)


def test_a_root_of_another_owner_is_refused_and_an_open_one_is_closed(tmp_path, caplog):
    """Whoever else can write the root can replace an object file with a valid checksum."""
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)  # nobody's directory
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        SSDTier(other, 1 << 30)
    assert os.listdir(other) == []  # nothing was made in it
    open_root = tmp_path / "open"
    open_root.mkdir()
    os.chmod(open_root, 0o777)
    asyncio.run(SSDTier(open_root, 1 << 30).aclose())
    assert (os.stat(open_root).st_mode & 0o777) == 0o700
    assert "other users could read or replace" in caplog.text
    link = tmp_path / "link"
    link.symlink_to(open_root)
    with pytest.raises(ConfigError, match="not a directory"):
        SSDTier(link, 1 << 30)


def test_another_uid_cannot_replace_an_object_in_the_tier(tmp_path):
    """The attack, run as an unprivileged uid (nobody) against a root that was world-writable."""
    import subprocess
    import sys

    root = tmp_path / "ssd"
    root.mkdir()
    os.chmod(root, 0o777)
    os.chmod(tmp_path, 0o755)
    asyncio.run(_put_one(SSDTier(root, 1 << 30)))
    victim = next(p for p in root.rglob("*.kv"))
    attack = (
        f"import os\nos.setgid(65534)\nos.setuid(65534)\n"
        f"try:\n    os.replace({str(tmp_path / 'forged')!r}, {str(victim)!r})\nexcept OSError as e:\n"
        f"    print('refused', e.errno)\nelse:\n    print('replaced')\n"
        f"try:\n    open({str(root / 'x')!r}, 'w')\nexcept OSError as e:\n    print('refused', e.errno)\n"
    )
    (tmp_path / "forged").write_bytes(victim.read_bytes())
    os.chmod(tmp_path / "forged", 0o666)
    out = subprocess.run([sys.executable, "-c", attack], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["refused 13", "refused 13"]  # EACCES, twice


async def _put_one(tier: SSDTier) -> None:
    key = CHAIN.keys(1)[0]
    try:
        assert await put_bytes(tier, key, make_obj(key)) is PutResult.STORED
    finally:
        await tier.aclose()
