"""TieredStore over a real host pool and a real SSD directory: lookup across tiers,
promotion, write-through, restart, corruption and capacity errors.  The core's parts alone
are ``tests/unit/test_store_core.py`` and ``tests/unit/test_writedown.py``."""

import numpy as np
import pytest

from kvstore import codec
from kvstore.config import StoreConfig
from kvstore.errors import CapacityError, ConfigError
from kvstore.keys import ROOT, Identity
from kvstore.store.tiered import TieredStore
from tests.kits.chain import Chain
from tiers.base import PutResult

GEOM = codec.ObjectGeometry(num_layers=2, pages_per_layer=2, page_bytes=2048)
SIZE = codec.object_size(GEOM)
CHAIN = Chain(Identity("m", "r", "bf16", "test:opaque", 2, 1, 64).namespace(), chunk_tokens=256)


def payload(i):
    return np.full(GEOM.payload_bytes, i + 1, np.uint8)


async def make_store(tmp_path, host_capacity=64 * SIZE):
    cfg = StoreConfig(host_capacity=host_capacity, ssd_dir=tmp_path / "ssd", ssd_capacity=1 << 26)
    return await TieredStore.from_config(cfg)


async def put_chain(store, hashes, keys, count=None):
    for i in range(count if count is not None else len(keys)):
        res = await store.put_payload(keys[i], GEOM, payload(i), hashes[i - 1] if i else ROOT)
        assert res is PutResult.STORED


async def test_put_lookup_get_from_host(tmp_path):
    _, hashes, keys = CHAIN.links(4)
    buf = np.empty(SIZE, np.uint8)
    async with await make_store(tmp_path) as store:
        await put_chain(store, hashes, keys, 3)
        found = await store.lookup(keys)
        assert (found.looked_up, found.hits, found.tiers) == (4, 3, ["host"] * 3)
        assert found.sizes == [SIZE] * 3 and found.by_tier == {"host": 3}
        got = await store.read_into(keys[1], memoryview(buf))
        assert (got.length, got.tier) == (SIZE, "host")
        assert np.array_equal(buf[codec.HEADER_SIZE :], payload(1))
        assert await store.put_payload(keys[1], GEOM, payload(1), hashes[0]) is PutResult.EXISTS


async def test_restart_reads_from_ssd_and_promotes(tmp_path):
    _, hashes, keys = CHAIN.links(3)
    async with await make_store(tmp_path) as store:
        await put_chain(store, hashes, keys)
        assert await store.drain(10)  # written through, in the background
        assert store.stats()["tiers"]["ssd"].objects == 3
    buf = np.empty(SIZE, np.uint8)
    async with await make_store(tmp_path) as store:  # a cold host tier
        found = await store.lookup(keys)
        assert found.tiers == ["ssd"] * 3 and found.sizes == [SIZE] * 3
        got = await store.read_into(keys[0], memoryview(buf))
        assert got.tier == "ssd" and np.array_equal(buf[codec.HEADER_SIZE :], payload(0))
        assert (await store.lookup(keys)).tiers == ["host", "ssd", "ssd"]
        assert store.counters.promotions == 1
        parent_of_1 = codec.verify(buf).parent
        assert parent_of_1 == ROOT


async def test_gap_ends_the_hit_across_tiers(tmp_path):
    _, hashes, keys = CHAIN.links(4)
    async with await make_store(tmp_path) as store:
        await put_chain(store, hashes, keys)
        assert await store.drain(10)
        await store.host.delete(keys[1])  # chunk 1 only on SSD now
        for tier in store.tiers:  # chunk 2 nowhere
            await tier.delete(keys[2])
        found = await store.lookup(keys)
        assert found.tiers == ["host", "ssd"]  # chunk 3 exists but is unreachable


async def test_corrupt_ssd_object_is_a_counted_miss(tmp_path):
    _, hashes, keys = CHAIN.links(2)
    async with await make_store(tmp_path) as store:
        await put_chain(store, hashes, keys)
        ssd = store.lower[0]  # closing writes everything through first
    path = ssd.path_of(keys[1])
    raw = bytearray(path.read_bytes())
    raw[codec.HEADER_SIZE + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    buf = np.empty(SIZE, np.uint8)
    async with await make_store(tmp_path) as store:
        assert await store.read_into(keys[1], memoryview(buf)) is None
        assert store.stats()["tiers"]["ssd"].corrupt == 1
        assert not path.exists()
        assert (await store.lookup(keys)).hits == 1
        assert await store.read_into(keys[0], memoryview(buf)) is not None  # the rest survives


async def test_object_larger_than_host_is_a_capacity_error(tmp_path):
    _, hashes, keys = CHAIN.links(1)
    async with await make_store(tmp_path, host_capacity=SIZE // 2) as store:
        with pytest.raises(CapacityError):
            await store.put_payload(keys[0], GEOM, payload(0), ROOT)


async def test_unwritable_ssd_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="file"):
        await TieredStore.from_config(StoreConfig(host_capacity=1 << 20, ssd_dir=blocker / "ssd"))
