"""Encryption at rest against real parts (kvstore.integrity, docs/integrity.md).

* A real ``kvstore serve`` with an SSD directory and a real ``redis-server``, tenant a with
  ``encrypt: true`` and tenant b without: a's payload pattern is nowhere in the SSD files
  nor in any Redis value, b's is (what shows the search can fail); a's objects read back
  equal from SSD after a restart (also to an engine core over the store process, which
  is told the encrypted size and gets the smaller object), and from Redis once the SSD
  copies are gone.  An encrypting engine with its own SSD directory over that store
  encrypts its SSD copy and sends the store the object in clear.
* The same store, SSD only: a ciphertext with one flipped byte, one moved from another of
  a's objects and one moved from tenant b's object (checksums made valid) are each refused,
  counted as forged and removed, while a's untouched object is served; after a rotation
  with encryption turned off, an object encrypted under the old key id still reads and new
  objects are written in clear.
* The connector's ``encrypt_at_rest`` (an engine writing its own SSD directory and Redis):
  no plaintext in either, a fresh engine reads it back, a core without keys misses it and
  leaves it, another tenant's engine cannot read it (counted forged, removed).

Cost: about 6-15 s (six store starts, two redis-servers).
"""

from __future__ import annotations

import asyncio

import numpy as np
import redis
import yaml

from connector.config import ConnectorConfig
from connector.lower import keys_of
from kvstore import codec, integrity
from kvstore._proto import kvstore_pb2 as pb
from kvstore.cli import keys as keys_cli
from kvstore.keys import ObjectKey
from kvstore.store.tiered import TieredStore
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import MiB, StoreClient, random_key, wait_until
from tiers.base import PutResult
from tiers.ssd_files import object_path

SIZE = 256 * 1024
GEOMETRY = codec.ObjectGeometry(1, 1, SIZE - codec.HEADER_SIZE)


def _pattern(name: str) -> bytes:
    return f"<KV-PLAINTEXT-{name}>".encode()


def _obj(key: ObjectKey, name: str) -> bytes:
    """An object whose payload repeats ``_pattern(name)``: searchable in raw bytes."""
    pat = _pattern(name)
    payload = (pat * (GEOMETRY.payload_bytes // len(pat) + 1))[: GEOMETRY.payload_bytes]
    buf = bytearray(codec.object_size(GEOMETRY))
    codec.encode_into(buf, key, GEOMETRY, payload)
    return bytes(buf)


def _ssd_bytes(ssd) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(ssd.rglob("*")) if p.is_file())


def _redis_bytes(url: str) -> bytes:
    """Every value in the Redis database, raw (strings and hash fields)."""
    r = redis.Redis.from_url(url)
    out = []
    for k in r.scan_iter(count=1000):
        kind = r.type(k)
        if kind == b"string":
            out.append(r.get(k))
        elif kind == b"hash":
            out.extend(r.hgetall(k).values())
    r.close()
    return b"".join(out)


def _tokens(path, encrypt: dict[str, bool]):
    doc = {
        "tokens": [{"token": f"tok-{t}", "tenant": t, "permissions": ["read", "write"]} for t in ("a", "b")]
        + [{"token": "tok-ops", "tenant": "ops", "permissions": ["read", "admin"]}],
        "tenants": {t: {"encrypt": on} for t, on in encrypt.items()},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _server(tmp_path, keys, tokens, *extra: str) -> StoreProcess:
    return StoreProcess(
        tmp_path,
        "--host-capacity",
        "32MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--keys-file",
        str(keys),
        "--auth-tokens",
        str(tokens),
        *extra,
    )


def _get(proc, tenant: str, key: ObjectKey) -> bytes | None:
    out = np.zeros(SIZE, np.uint8)
    with StoreClient(proc.target, token=f"tok-{tenant}") as c:
        n = c.get_stream(key, out)
    return None if n is None else bytes(out[:n])


def _put(proc, tenant: str, key: ObjectKey, name: str, ssd_objects: int) -> None:
    with StoreClient(proc.target, token=f"tok-{tenant}") as c:
        assert c.put_stream(key, memoryview(_obj(key, name))) == pb.PUT_OUTCOME_STORED
    assert wait_until(lambda: _ops(proc)["ssd.objects"] == ssd_objects)


def _ops(proc) -> dict:
    with StoreClient(proc.target, token="tok-ops") as c:
        return c.stats()[1]


def test_the_store_writes_no_plaintext_of_an_encrypting_tenant_to_ssd_or_redis(tmp_path, redis_server):
    keys = tmp_path / "keys.json"
    keys_cli.create(keys)
    tokens = _tokens(tmp_path / "tokens.yaml", {"a": True})  # b: off, the default
    rng = np.random.default_rng(21)
    ka, kb = random_key(rng), random_key(rng)
    server = _server(tmp_path, keys, tokens, "--redis", redis_server.url)
    with server.start() as proc:
        _put(proc, "a", ka, "a", 1)
        _put(proc, "b", kb, "b", 2)
        assert wait_until(lambda: _pattern("b") in _redis_bytes(redis_server.url))
        assert proc.terminate() == 0
    disk, mem = _ssd_bytes(tmp_path / "ssd"), _redis_bytes(redis_server.url)
    assert _pattern("b") in disk and _pattern("b") in mem  # off: the search finds it
    assert _pattern("a") not in disk and _pattern("a") not in mem  # on: nowhere at rest
    kc = random_key(rng)
    with server.start() as proc:  # host pools empty: from SSD
        assert asyncio.run(_through_the_store(proc, ka)) == _obj(ka, "a")[codec.HEADER_SIZE :]
        asyncio.run(_engine_over_the_store(proc, tmp_path, keys, kc))
        assert _get(proc, "a", kc) == _obj(kc, "c")
        assert _get(proc, "a", ka) == _obj(ka, "a")
        assert _ops(proc).get("store.failures.ssd_forged", 0) == 0
        assert proc.terminate() == 0
    for p in (tmp_path / "ssd").rglob("*.kv"):
        p.unlink()
    with server.start() as proc:  # SSD copies gone: from Redis
        assert _get(proc, "a", ka) == _obj(ka, "a")
        assert _get(proc, "b", kb) == _obj(kb, "b")
        assert _ops(proc).get("store.failures.redis_forged", 0) == 0


async def _through_the_store(proc, key: ObjectKey) -> bytes:
    """An engine core over the store process promotes ``key``: the store reports the size
    of the encrypted SSD copy, answers with the smaller decrypted object, and the engine's
    slot shrinks to it.  The object's payload."""
    from kvstore.store.registry import open_tier

    remote = await open_tier(f"kvstore://{proc.target}", transport="stream", token="tok-a")
    core = TieredStore(await open_tier("host:", capacity=8 * MiB, pin=False), [remote])
    try:
        assert (await core.lookup([key])).sizes == [SIZE + codec.AEAD_OVERHEAD]
        assert await core.promote(key) == remote.name
        out = memoryview(bytearray(SIZE + codec.AEAD_OVERHEAD))
        got = await core.read_into(key, out)
        assert got is not None and got.tier == "host" and got.length == SIZE
        return bytes(out[codec.HEADER_SIZE : SIZE])
    finally:
        await core.aclose()


async def _engine_over_the_store(proc, tmp_path, keys, key: ObjectKey) -> None:
    """An encrypting engine with its own SSD directory and the store process below it: its
    SSD copy is encrypted, the store gets the object in clear (it would refuse to seal an
    encrypted one) and encrypts it itself."""
    from kvstore.store.registry import open_tiers

    ring = integrity.load_keys(keys).keyring("a").encrypting(True)
    tiers = await open_tiers(
        [
            ("host:", {"capacity": 8 * MiB, "pin": False}),
            (f"ssd:{tmp_path / 'own'}", {"capacity": 8 * MiB}),
            (f"kvstore://{proc.target}", {"transport": "stream", "token": "tok-a"}),
        ]
    )
    core = TieredStore(tiers[0], tiers[1:], keys=lambda _k: ring)
    try:
        assert await core.put(key, memoryview(_obj(key, "c"))) is PutResult.STORED
        await core.drain()
        assert core.counters.encrypted == 1
        assert core.counters.write_down == {f"{t.name}:stored": 1 for t in tiers[1:]}
    finally:
        await core.aclose()
    own = _ssd_bytes(tmp_path / "own")
    assert own and _pattern("c") not in own


def _replace_payload(path, payload: bytes) -> None:
    """Put ``payload`` (stored bytes) into the object file at ``path`` with a valid checksum."""
    data = bytearray(path.read_bytes())
    header = codec.decode_header(data)
    assert header.encrypted and len(payload) == header.stored_len
    data[codec.HEADER_SIZE :] = payload
    data[: codec.HEADER_SIZE] = codec.with_payload(header, True, header.stored_len, codec.checksum(payload))
    codec.verify(data, expected_key=header.key)  # damage checks pass
    path.write_bytes(data)


def test_tampered_or_moved_ciphertexts_are_refused_and_rotation_keeps_old_objects(tmp_path):
    keys = tmp_path / "keys.json"
    keys_cli.create(keys)
    tokens = _tokens(tmp_path / "tokens.yaml", {"a": True, "b": True})
    rng = np.random.default_rng(22)
    flipped, moved, from_b, kept, kb = (random_key(rng) for _ in range(5))
    server = _server(tmp_path, keys, tokens)
    with server.start() as proc:
        for i, key in enumerate((flipped, moved, from_b, kept)):
            _put(proc, "a", key, f"a{i}", i + 1)
        _put(proc, "b", kb, "b", 5)
        assert proc.terminate() == 0
    ssd = tmp_path / "ssd"
    path = {
        k: object_path(ssd, ObjectKey(k.namespace.scoped(t), k.chunk_hash, k.tag))
        for k, t in ((flipped, "a"), (moved, "a"), (from_b, "a"), (kept, "a"), (kb, "b"))
    }
    stored = {k: p.read_bytes()[codec.HEADER_SIZE :] for k, p in path.items()}
    bad = bytearray(stored[flipped])
    bad[1000] ^= 0x01
    _replace_payload(path[flipped], bytes(bad))
    _replace_payload(path[moved], stored[kept])
    _replace_payload(path[from_b], stored[kb])
    with server.start() as proc:
        for key in (flipped, moved, from_b):
            assert _get(proc, "a", key) is None
        assert _get(proc, "a", kept) == _obj(kept, "a3")
        assert _ops(proc)["store.failures.ssd_forged"] == 3
        assert not any(path[k].exists() for k in (flipped, moved, from_b)) and path[kept].exists()
        assert proc.terminate() == 0

    assert keys_cli.rotate(keys) == 2
    _tokens(tokens, {"a": False, "b": True})  # a turns encryption off
    fresh = random_key(rng)
    with server.start() as proc:
        assert _get(proc, "a", kept) == _obj(kept, "a3")  # encrypted under id 1: reads
        assert _get(proc, "b", kb) == _obj(kb, "b")
        _put(proc, "a", fresh, "fresh", 3)
        assert proc.terminate() == 0
    fresh_path = object_path(ssd, ObjectKey(fresh.namespace.scoped("a"), fresh.chunk_hash, fresh.tag))
    header = codec.decode_header(fresh_path.read_bytes())
    assert header.key_id == 2 and not header.encrypted and _pattern("fresh") in fresh_path.read_bytes()


async def _engine(tmp_path, redis_url: str, keys_file, encrypt: bool) -> TieredStore:
    extra = {"redis_url": redis_url, "keys_file": str(keys_file), "encrypt_at_rest": encrypt}
    cfg = ConnectorConfig.from_extra_config(extra, env={})
    return await TieredStore.open(
        [("host:", {"capacity": 8 * MiB}), (f"ssd:{tmp_path / 'essd'}", {"capacity": 16 * MiB}), (redis_url, {})],
        keys=keys_of(cfg),
    )


def test_the_connector_option_encrypts_its_own_ssd_and_redis_copies(tmp_path, redis_server):
    deployment = tmp_path / "keys.json"
    keys_cli.create(deployment)
    keys_cli.export(deployment, "a", tmp_path / "a.keys")
    keys_cli.export(deployment, "b", tmp_path / "b.keys")
    rng = np.random.default_rng(23)
    secret, clear = random_key(rng), random_key(rng)

    async def story():
        a = await _engine(tmp_path, redis_server.url, tmp_path / "a.keys", encrypt=True)
        assert await a.put(secret, memoryview(_obj(secret, "secret"))) is PutResult.STORED
        await a.drain()
        assert a.counters.encrypted == 1
        await a.aclose()
        off = await _engine(tmp_path, redis_server.url, tmp_path / "a.keys", encrypt=False)
        assert await off.put(clear, memoryview(_obj(clear, "clear"))) is PutResult.STORED
        await off.drain()
        await off.aclose()
        disk, mem = _ssd_bytes(tmp_path / "essd"), _redis_bytes(redis_server.url)
        assert _pattern("clear") in disk and _pattern("clear") in mem
        assert _pattern("secret") not in disk and _pattern("secret") not in mem

        reader = await _engine(tmp_path, redis_server.url, tmp_path / "a.keys", encrypt=False)
        out = memoryview(bytearray(SIZE))
        got = await reader.read_into(secret, out)  # off now: still reads
        assert got is not None and got.length == SIZE  # the sealed object: MAC set
        assert bytes(out[codec.HEADER_SIZE :]) == _obj(secret, "secret")[codec.HEADER_SIZE :]
        assert reader.counters.decrypted == 1 and not reader.counters.forged
        await reader.aclose()
        ring = integrity.load_keys(tmp_path / "a.keys").keyring()
        small = await TieredStore.open(
            [
                ("host:", {"capacity": SIZE // 2}),  # no room for a promotion
                (f"ssd:{tmp_path / 'essd'}", {"capacity": 16 * MiB}),
            ],
            keys=lambda _k: ring,
        )
        out[:] = bytes(SIZE)
        got = await small.read_into(secret, out)  # straight from SSD: staged, decrypted, copied
        assert got is not None and got.tier == "ssd" and got.length == SIZE
        assert bytes(out[codec.HEADER_SIZE :]) == _obj(secret, "secret")[codec.HEADER_SIZE :]
        assert small.counters.decrypted == 1 and small.counters.promote_no_room == 1
        await small.aclose()

        keyless = await TieredStore.open(
            [("host:", {"capacity": 8 * MiB}), (f"ssd:{tmp_path / 'essd'}", {"capacity": 16 * MiB})]
        )
        assert await keyless.read_into(secret, out) is None  # no keys: a miss...
        assert await keyless.promote(secret) is None
        assert keyless.counters.tier_errors == {"ssd:encrypted": 3}  # promote + direct read, promote
        assert await keyless.lower[0].contains(secret)  # ...that removes nothing
        await keyless.aclose()

        thief = await _engine(tmp_path, redis_server.url, tmp_path / "b.keys", encrypt=True)
        assert await thief.read_into(secret, out) is None
        assert sum(thief.counters.forged.values()) == 2  # SSD and Redis copies
        assert not await thief.contains(secret)
        await thief.aclose()

    asyncio.run(story())
