"""RedisConfig.from_url: schemes, credentials, options, and clear errors for bad input;
the Redis manifest codec; the tier's refusal of objects above max_object_bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvstore import codec
from kvstore.errors import CapacityError, ConfigError, CorruptHeaderError
from kvstore.keys import Identity, chunk_hashes, object_keys
from tiers.redis import RedisTier
from tiers.redis_config import DEFAULT_PART_SIZE, RedisConfig
from tiers.redis_manifest import INLINE, MANIFEST_SIZE, Manifest, data_keys, inline_key, manifest_key, part_keys, unpack

NS = Identity("m", "r", "bf16", "x", 1, 1, 1).namespace()
KEY = object_keys(NS, chunk_hashes(NS, np.arange(16), 16))[0]


@pytest.mark.parametrize(
    "url, host, port, db, tls, cluster",
    [
        ("redis://127.0.0.1", "127.0.0.1", 6379, 0, False, False),
        ("redis://cache.internal:7001/3", "cache.internal", 7001, 3, False, False),
        ("rediss://cache:6380", "cache", 6380, 0, True, False),
        ("redis+cluster://10.0.0.5:7000", "10.0.0.5", 7000, 0, False, True),
        ("rediss+cluster://node1:7000/", "node1", 7000, 0, True, True),
        ("redis://node1:7000?cluster=true", "node1", 7000, 0, False, True),
        ("REDIS://[::1]:6390", "::1", 6390, 0, False, False),
    ],
)
def test_schemes_hosts_ports(url, host, port, db, tls, cluster):
    cfg = RedisConfig.from_url(url)
    assert (cfg.host, cfg.port, cfg.db, cfg.tls, cfg.cluster) == (host, port, db, tls, cluster)
    assert (cfg.key_prefix, cfg.ttl_s, cfg.connect_timeout_s, cfg.op_timeout_s) == ("kvstore:", 0.0, 1.0, 2.0)
    assert cfg.part_size == DEFAULT_PART_SIZE


def test_options_from_query_and_keywords_keywords_win():
    cfg = RedisConfig.from_url(
        "redis://h:1/0?key_prefix=tenant-a:&ttl_s=90&part_size=2MiB&pool_size=4&max_inflight_parts=3"
        "&connect_timeout_s=0.5&op_timeout_s=1.5&retry_s=0.25&orphan_ttl_s=30&max_object_bytes=64MiB",
        pool_size=9,
        ttl_s="120",
    )
    assert (cfg.key_prefix, cfg.ttl_s, cfg.part_size, cfg.pool_size, cfg.max_inflight_parts) == (
        "tenant-a:",
        120.0,
        2 << 20,
        9,
        3,
    )
    assert (cfg.connect_timeout_s, cfg.op_timeout_s, cfg.retry_s, cfg.orphan_ttl_s) == (0.5, 1.5, 0.25, 30.0)
    assert cfg.max_object_bytes == 64 << 20


def test_credentials_from_url_or_options_and_never_shown():
    cfg = RedisConfig.from_url("redis://alice:p%40ss%3Aw0rd@h:6379/1")
    assert (cfg.username, cfg.password) == ("alice", "p@ss:w0rd")
    for text in (repr(cfg), str(cfg), cfg.redacted_url):
        assert "p@ss" not in text and "w0rd" not in text
    assert cfg.redacted_url == "redis://alice:***@h:6379/1"
    only_pw = RedisConfig.from_url("redis://:secret@h")
    assert (only_pw.username, only_pw.password, only_pw.redacted_url) == (None, "secret", "redis://:***@h:6379")
    opts = RedisConfig.from_url("rediss://h", username="bob", password="hunter2", tls_ca="/ca.pem")
    assert (opts.username, opts.password, opts.tls_ca) == ("bob", "hunter2", "/ca.pem")
    assert "hunter2" not in repr(opts) and "bob" in repr(opts)


@pytest.mark.parametrize(
    "url, options, message",
    [
        ("", {}, "non-empty"),
        ("http://h:6379", {}, "unknown redis URL scheme 'http'"),
        ("h:6379", {}, "unknown redis URL scheme"),
        ("redis://", {}, "has no host"),
        ("redis://:pw@:6379", {}, "has no host"),
        ("redis://h:notaport", {}, "malformed redis URL"),
        ("redis://h:70000", {}, "malformed redis URL"),
        ("redis://h:0", {}, "port 0"),
        ("redis://h/zero", {}, "database number"),
        ("redis://h#frag", {}, "fragment"),
        ("redis://h?ttl=5", {}, "unknown redis option(s) ttl"),
        ("redis://h", {"poolsize": 3}, "unknown redis option(s) poolsize"),
        ("redis://h?pool_size=2&pool_size=3", {}, "repeats option(s) pool_size"),
        ("redis://h?key_prefix=my%20app:", {}, "must be printable ASCII without spaces"),
        ("redis://h", {"key_prefix": "tab\there"}, "without spaces"),
        ("redis://h", {"key_prefix": "x" * 65}, "1-64 characters"),
        ("redis://h", {"key_prefix": "{tag}"}, "hash tags"),
        ("redis://h", {"part_size": "1GiB"}, "part_size 1073741824 is outside"),
        ("redis://h", {"part_size": 100}, "part_size 100 is outside"),
        ("redis://h", {"part_size": "lots"}, "part_size: cannot parse size 'lots'"),
        ("redis://h", {"pool_size": 0}, "pool_size must be positive"),
        ("redis://h", {"pool_size": "many"}, "pool_size: expected an integer"),
        ("redis://h", {"max_inflight_parts": -1}, "max_inflight_parts must be positive"),
        ("redis://h", {"ttl_s": -5}, "ttl_s must be 0"),
        ("redis://h", {"op_timeout_s": "soon"}, "op_timeout_s: expected a number of seconds, got 'soon'"),
        ("redis://h", {"connect_timeout_s": 0}, "connect_timeout_s must be positive"),
        ("redis://h", {"retry_s": "inf"}, "retry_s: expected a finite number of seconds, got 'inf'"),
        ("redis://h", {"cluster": "maybe"}, "cluster: expected true or false"),
        ("redis+cluster://h", {"cluster": False}, "cluster URL but the options say cluster=false"),
        ("redis+cluster://h/2", {}, "only database 0"),
        ("redis://h", {"tls_ca": "/ca.pem"}, "not a TLS URL; use rediss://"),
        ("rediss://h", {"tls_cert": "/c.pem"}, "tls_cert and tls_key must be given together"),
    ],
)
def test_bad_input_is_a_clear_config_error(url, options, message):
    with pytest.raises(ConfigError) as err:
        RedisConfig.from_url(url, **options)
    assert message in str(err.value)


def test_bad_url_errors_never_show_the_password():
    with pytest.raises(ConfigError) as err:
        RedisConfig.from_url("redis://u:topsecret@h:port")
    assert "topsecret" not in str(err.value) and "u:***@h" in str(err.value)
    with pytest.raises(ConfigError) as err:
        RedisConfig.from_url("redis://u:topsecret@h?nope=1")
    assert "topsecret" not in str(err.value)


def test_manifest_round_trip_and_layout():
    m = Manifest(3 * 4096 + 7, 4096, b"\x01\x02\x03\x04\x05\x06\x07\x08")
    raw = m.pack()
    assert len(raw) == MANIFEST_SIZE == 40
    assert unpack(raw) == m and m.count == 4
    assert [m.part_range(i) for i in range(4)] == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 12295)]
    assert manifest_key("kv:", KEY) == f"kv:m:{KEY.printable()}"
    assert part_keys("kv:", KEY, m) == [f"kv:p:{KEY.printable()}:0102030405060708:{i}" for i in range(4)]


def test_inline_manifest_round_trip_and_layout():
    m = Manifest(4000, 4096, bytes(8), inline=True)
    raw = m.pack()
    assert struct.unpack_from("<H", raw, 6)[0] == INLINE and unpack(raw) == m and m.count == 1
    assert data_keys("kv:", KEY, m) == [inline_key("kv:", KEY)] == [f"kv:i:{KEY.printable()}"]
    parts = Manifest(4000, 4096, bytes(8))
    assert data_keys("kv:", KEY, parts) == part_keys("kv:", KEY, parts) and not unpack(parts.pack()).inline
    with pytest.raises(CorruptHeaderError, match="exceeds its part size"):
        Manifest(4097, 4096, bytes(8), inline=True)


def _resealed(raw: bytearray) -> bytes:
    struct.pack_into("<Q", raw, 32, xxhash.xxh3_64_intdigest(bytes(raw[:32])))
    return bytes(raw)


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "count", "flags", "inline too big"])
def test_damaged_manifest_is_rejected(damage):
    raw = bytearray(Manifest(10_000, 4096, bytes(8)).pack())
    if damage == "truncate":
        raw = raw[:-1]
    elif damage == "flip":
        raw[9] ^= 0x40
    elif damage == "magic":
        raw[:4] = b"XXXX"
    elif damage == "count":
        struct.pack_into("<I", raw, 20, 5)  # part count disagrees with the sizes
        raw = _resealed(raw)
    elif damage == "flags":
        struct.pack_into("<H", raw, 6, 2)  # a flag this reader does not know
        raw = _resealed(raw)
    else:
        struct.pack_into("<H", raw, 6, INLINE)  # inline, but 10 000 bytes in parts of 4096
        raw = _resealed(raw)
    with pytest.raises(CorruptHeaderError):
        unpack(bytes(raw))


async def test_object_larger_than_max_object_bytes_is_a_capacity_error(redis_server):
    tier = await RedisTier.open(RedisConfig.from_url(redis_server.url, max_object_bytes="1MiB"))
    try:
        with pytest.raises(CapacityError, match="exceeds max_object_bytes 1048576"):
            await tier.put_start(KEY, (1 << 20) + 1)
        with pytest.raises(ConfigError, match="smaller than the 256-byte header"):
            await tier.put_start(KEY, codec.HEADER_SIZE - 1)
        handle = await tier.put_start(KEY, 1 << 20)  # exactly the limit is fine
        assert handle is not None
        assert await tier.put_commit(handle, False) is False
    finally:
        await tier.aclose()


def test_budget_bytes_is_a_size_and_never_negative():
    assert RedisConfig.from_url("redis://h/0?budget_bytes=64MiB").budget_bytes == 64 << 20
    assert RedisConfig.from_url("redis://h/0").budget_bytes == 0
    with pytest.raises(ConfigError, match="budget_bytes"):
        RedisConfig.from_url("redis://h/0", budget_bytes=-1)
