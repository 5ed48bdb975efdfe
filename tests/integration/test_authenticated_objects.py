"""Authenticated objects against real parts (kvstore.integrity, docs/integrity.md).

* Redis shared by engines (real ``redis-server``): an engine of tenant b writing under a key
  of tenant a's namespace, and an object with a valid xxh3 checksum but no MAC written
  straight into Redis, are both counted misses for tenant a's engine and are removed; a's
  own objects are served.
* A real ``kvstore serve`` with an SSD directory: an object file rewritten with a valid
  checksum (and the old MAC copied over) is refused after a restart, counted and removed,
  while its neighbour is served; an object sealed before a rotation is served after it and
  refused once its key id is retired.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from connector.config import ConnectorConfig
from connector.lower import keys_of
from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore.cli import keys as keys_cli
from kvstore.keys import Namespace
from kvstore.store.tiered import TieredStore
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import MiB, Objects, StoreClient, random_key, wait_until
from tiers.base import PutResult, put_bytes

SIZE = 256 * 1024


def _obj(key, seed: int) -> bytes:
    return bytes(Objects(SIZE).make(key, SIZE, seed=seed))


async def _engine(redis_url: str, keys_file) -> TieredStore:
    """An engine's store over the shared Redis, keyed as the connector keys it."""
    cfg = ConnectorConfig.from_extra_config({"redis_url": redis_url, "keys_file": str(keys_file)}, env={})
    return await TieredStore.open([("host:", {"capacity": 8 * MiB}), (redis_url, {})], keys=keys_of(cfg))


def test_an_object_forged_in_redis_under_tenant_as_key_is_a_counted_miss_and_removed(redis_server, tmp_path):
    deployment = tmp_path / "keys.json"
    keys_cli.create(deployment)
    keys_cli.export(deployment, "a", tmp_path / "a.keys")
    keys_cli.export(deployment, "b", tmp_path / "b.keys")
    rng = np.random.default_rng(7)
    ns = Namespace(rng.bytes(32))  # tenant a's namespace
    genuine, by_b, unsealed = (random_key(rng, namespace=ns) for _ in range(3))

    async def story():
        a = await _engine(redis_server.url, tmp_path / "a.keys")
        assert await a.put(genuine, memoryview(_obj(genuine, 1))) is PutResult.STORED
        await a.drain()
        await a.aclose()
        b = await _engine(redis_server.url, tmp_path / "b.keys")  # b's engine, straight to Redis
        assert await b.put(by_b, memoryview(_obj(by_b, 2))) is PutResult.STORED
        await b.drain()
        raw = b.lower[0]
        forged = _obj(unsealed, 3)
        codec.verify(forged, expected_key=unsealed)  # a valid xxh3 checksum, no MAC
        assert await put_bytes(raw, unsealed, memoryview(forged)) is PutResult.STORED
        await b.aclose()

        reader = await _engine(redis_server.url, tmp_path / "a.keys")  # a fresh engine of a
        redis = reader.lower[0]
        assert await redis.contains(by_b) and await redis.contains(unsealed)
        out = memoryview(bytearray(SIZE))
        got = await reader.read_into(genuine, out)
        assert got is not None and got.tier == redis.name
        assert bytes(out[codec.HEADER_SIZE :]) == _obj(genuine, 1)[codec.HEADER_SIZE :]
        assert await reader.read_into(by_b, out) is None
        assert await reader.promote(unsealed) is None
        assert reader.counters.forged == {redis.name: 2}
        assert not await redis.contains(by_b) and not await redis.contains(unsealed)
        assert not reader.host.contains_sync(by_b) and not reader.host.contains_sync(unsealed)
        await reader.aclose()

    asyncio.run(story())


def _ssd_file(ssd_dir, scoped_key_matches):
    files = [p for p in ssd_dir.rglob("*.kv")]
    return [p for p in files if scoped_key_matches(codec.decode_header(p.read_bytes()[: codec.HEADER_SIZE]))]


def _server(tmp_path, keys_file):
    return StoreProcess(
        tmp_path, "--host-capacity", "32MiB", "--ssd-dir", str(tmp_path / "ssd"), "--keys-file", str(keys_file)
    )


def test_an_ssd_object_rewritten_with_a_valid_checksum_is_refused_after_a_restart(tmp_path):
    keys = tmp_path / "keys.json"
    keys_cli.create(keys)
    rng = np.random.default_rng(11)
    victim, neighbour = random_key(rng), random_key(rng)
    with _server(tmp_path, keys).start() as proc:
        with StoreClient(proc.target) as c:
            for i, key in enumerate((victim, neighbour)):
                assert c.put_stream(key, memoryview(_obj(key, i))) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: c.stats()[1]["ssd.objects"] == 2)
        assert proc.terminate() == 0
    [path] = _ssd_file(tmp_path / "ssd", lambda h: h.key.chunk_hash == victim.chunk_hash)
    data = bytearray(path.read_bytes())
    header = codec.decode_header(data)
    assert header.key_id == 1  # the store sealed it
    data[codec.HEADER_SIZE + 100] ^= 0x55  # the attacker's change...
    codec.encode_into(data, header.key, header.geometry, None, header.parent)  # ...a valid checksum
    codec.set_mac(data, header.key_id, header.mac)  # ...and the old MAC
    codec.verify(data, expected_key=header.key)
    path.write_bytes(data)

    with _server(tmp_path, keys).start() as proc, StoreClient(proc.target) as c:
        out = np.zeros(SIZE, np.uint8)
        assert c.get_stream(victim, out) is None
        assert c.get_stream(neighbour, out) == SIZE and bytes(out) == _obj(neighbour, 1)
        counters = c.stats()[1]
        assert counters["store.failures.ssd_forged"] == 1
        assert not path.exists() and counters["ssd.objects"] == 1


def test_rotation_an_object_of_the_old_key_id_reads_until_that_id_is_retired(tmp_path):
    keys = tmp_path / "keys.json"
    keys_cli.create(keys)
    rng = np.random.default_rng(12)
    old, new = random_key(rng), random_key(rng)
    server = _server(tmp_path, keys)
    with server.start() as proc:
        with StoreClient(proc.target) as c:
            assert c.put_stream(old, memoryview(_obj(old, 1))) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: c.stats()[1]["ssd.objects"] == 1)
        assert proc.terminate() == 0
        assert keys_cli.rotate(keys) == 2
        proc.start()
        with StoreClient(proc.target) as c:
            out = np.zeros(SIZE, np.uint8)
            assert c.get_stream(old, out) == SIZE and bytes(out) == _obj(old, 1)  # key id 1 still reads
            assert c.put_stream(new, memoryview(_obj(new, 2))) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: c.stats()[1]["ssd.objects"] == 2)
        assert proc.terminate() == 0
    ids = {codec.decode_header(p.read_bytes()[: codec.HEADER_SIZE]).key_id for p in (tmp_path / "ssd").rglob("*.kv")}
    assert ids == {1, 2}  # new seals use the new id
    keys_cli.retire(keys, 1)
    with _server(tmp_path, keys).start() as proc, StoreClient(proc.target) as c:
        out = np.zeros(SIZE, np.uint8)
        assert c.get_stream(old, out) is None  # retired: refused
        assert c.get_stream(new, out) == SIZE and bytes(out) == _obj(new, 2)
        assert c.stats()[1]["store.failures.ssd_forged"] == 1


def test_a_store_without_a_keys_file_makes_one_default_secret_and_keeps_it_across_restarts(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "KVSTORE_STATE_DIR": str(state)}
    rng = np.random.default_rng(13)
    key = random_key(rng)
    server = StoreProcess(tmp_path, "--host-capacity", "32MiB", "--ssd-dir", str(tmp_path / "ssd"), env=env)
    with server.start() as proc:
        with StoreClient(proc.target) as c:
            assert c.put_stream(key, memoryview(_obj(key, 1))) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: c.stats()[1]["ssd.objects"] == 1)
        proc.restart()
        assert (state / "keys.json").stat().st_mode & 0o777 == 0o600
        with StoreClient(proc.target) as c:
            out = np.zeros(SIZE, np.uint8)
            assert c.get_stream(key, out) == SIZE and bytes(out) == _obj(key, 1)
            assert "store.failures.ssd_forged" not in c.stats()[1]


def test_a_tenants_object_moved_under_another_tenants_key_is_refused_by_the_store(tmp_path):
    """The store verifies with the keys of the tenant the key belongs to: tenant a's sealed
    object, rekeyed (valid checksum) and planted as tenant b's file, is refused for b."""
    from kvstore.keys import ObjectKey
    from tests.kits.store_calls import write_tokens
    from tiers.ssd_files import object_path

    keys = tmp_path / "keys.json"
    keys_cli.create(keys)
    tokens = write_tokens(
        tmp_path / "tokens.yaml",
        [
            {"token": "tok-a", "tenant": "a", "permissions": ["read", "write"]},
            {"token": "tok-b", "tenant": "b", "permissions": ["read", "write"]},
            {"token": "tok-ops", "tenant": "ops", "permissions": ["read", "admin"]},
        ],
    )
    key = random_key(np.random.default_rng(14))
    server = StoreProcess(
        tmp_path,
        "--host-capacity",
        "32MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--keys-file",
        str(keys),
        "--auth-tokens",
        str(tokens),
    )
    with server.start() as proc:
        with StoreClient(proc.target, token="tok-a") as a:
            assert a.put_stream(key, memoryview(_obj(key, 1))) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: a.stats()[1]["ssd.objects"] == 1)
        assert proc.terminate() == 0
    as_b = ObjectKey(key.namespace.scoped("b"), key.chunk_hash, key.tag)
    [path] = list((tmp_path / "ssd").rglob("*.kv"))
    data = bytearray(path.read_bytes())
    codec.rekey(data, as_b)  # MAC kept, checksum valid
    planted = object_path(tmp_path / "ssd", as_b)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(data)
    server = StoreProcess(
        tmp_path,
        "--host-capacity",
        "32MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--keys-file",
        str(keys),
        "--auth-tokens",
        str(tokens),
    )
    with server.start() as proc:
        out = np.zeros(SIZE, np.uint8)
        with StoreClient(proc.target, token="tok-b") as b:
            assert b.get_stream(key, out) is None
        with StoreClient(proc.target, token="tok-a") as a:
            assert a.get_stream(key, out) == SIZE and bytes(out) == _obj(key, 1)
        with StoreClient(proc.target, token="tok-ops") as ops:
            assert ops.stats()[1]["store.failures.ssd_forged"] == 1
        assert not planted.exists() and path.exists()
