"""Tiers by spec (``kvstore.store.registry``): every spec kind opened for real, bad specs
and options refused with a ``ConfigError`` naming the spec before anything is opened, and
``open_tiers`` leaving out unreachable tiers only when they are not required."""

from __future__ import annotations

import pytest

from kvstore.config import RetentionPolicy, StoreConfig
from kvstore.errors import ConfigError, TierUnavailableError
from kvstore.store.registry import open_tier, open_tiers, parse_spec, resolve, tier_specs
from kvstore.testing.redis_proc import free_port
from tiers.base import Tier
from tiers.host import HostTier
from tiers.ssd import SSDTier


@pytest.mark.parametrize(
    "spec,kind,target",
    [
        ("host:", "host", ""),
        ("ssd:/var/lib/kv", "ssd", "/var/lib/kv"),
        ("ssd:rel/dir:with:colons", "ssd", "rel/dir:with:colons"),
        ("redis://cache:6379/2?key_prefix=a", "redis", "redis://cache:6379/2?key_prefix=a"),
        ("rediss://cache:6380", "redis", "rediss://cache:6380"),
        ("redis+cluster://n1:7000", "redis", "redis+cluster://n1:7000"),
        ("REDISS+CLUSTER://n1:7000", "redis", "REDISS+CLUSTER://n1:7000"),
        ("kvstore://127.0.0.1:50051", "remote", "127.0.0.1:50051"),
        ("kvstore://[::1]:50051", "remote", "[::1]:50051"),
    ],
)
def test_specs_parse_to_their_kind(spec, kind, target):
    parsed = parse_spec(spec)
    assert (parsed.kind, parsed.target) == (kind, target)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("", "non-empty string"),
        ("host:4GiB", "'host:4GiB': host: takes no argument"),
        ("ssd:", "'ssd:': ssd: needs a directory"),
        ("s3:bucket", "unknown tier spec 's3:bucket'"),
        ("/var/lib/kv", "unknown tier spec '/var/lib/kv'"),
        ("http://cache:6379", "unknown redis URL scheme 'http'"),
        ("http://u:secret@cache:6379", "'http://u:***@cache:6379'"),
        ("kvstore://nohost", "'kvstore://nohost': expected kvstore://HOST:PORT"),
        ("kvstore://h:1/path", "expected kvstore://HOST:PORT"),
    ],
)
def test_bad_specs_name_the_spec(spec, needle):
    with pytest.raises(ConfigError) as info:
        parse_spec(spec)
    assert needle in str(info.value) and "secret" not in str(info.value)


@pytest.mark.parametrize(
    "spec,options,needle",
    [
        ("host:", {}, "'host:' needs a capacity= option"),
        ("host:", {"capacity": "lots"}, "tier spec 'host:': capacity: cannot parse size 'lots'"),
        ("host:", {"capacity": 1 << 20, "colour": "red"}, "'host:': unknown option(s) colour"),
        ("ssd:/tmp/x", {"capacity": 1 << 20, "fsync": True, "sync": 1}, "'ssd:/tmp/x': unknown option(s) sync"),
        ("kvstore://127.0.0.1:1", {"tokn": "t"}, "'kvstore://127.0.0.1:1': unknown option(s) tokn"),
        (
            "redis://u:secret@127.0.0.1:1/0",
            {"bogus": 1},
            "unknown redis option(s) bogus in redis://u:***@127.0.0.1:1/0",
        ),
    ],
)
def test_bad_options_name_the_spec_and_are_found_without_io(spec, options, needle):
    with pytest.raises(ConfigError) as info:
        resolve(spec, **options)
    assert needle in str(info.value) and "secret" not in str(info.value)


async def test_host_and_ssd_specs_open_real_tiers(tmp_path):
    host = await open_tier("host:", capacity="1MiB", pin=False, name="pool")
    ssd = await open_tier(f"ssd:{tmp_path / 'ssd'}", capacity="4MiB", fsync=False)
    try:
        assert isinstance(host, HostTier) and host.name == "pool"
        assert host.stats().capacity_bytes == 1 << 20
        assert isinstance(ssd, SSDTier) and ssd.stats().capacity_bytes == 4 << 20
        assert all(isinstance(t, Tier) for t in (host, ssd))
    finally:
        await ssd.aclose()
        await host.aclose()


async def test_a_shared_host_pool_has_its_segment(tmp_path):
    host = await open_tier("host:", capacity=1 << 20, shared=True, pin=False)
    try:
        assert host.shm_path is not None
    finally:
        await host.aclose()


async def test_a_redis_spec_opens_a_redis_tier_with_its_options(redis_server):
    tier = await open_tier(redis_server.url, key_prefix="reg", ttl_s=5)
    try:
        assert tier.name == "redis" and (tier.cfg.key_prefix, tier.cfg.ttl_s) == ("reg", 5.0)
        assert await tier.present([]) == []
    finally:
        await tier.aclose()


async def test_unreachable_backends_raise_tier_unavailable_naming_them():
    port = free_port()
    with pytest.raises(TierUnavailableError, match=f"cannot reach redis at 127.0.0.1:{port}"):
        await open_tier(f"redis://127.0.0.1:{port}/0", connect_timeout_s=0.5)
    with pytest.raises(TierUnavailableError, match=str(port)):
        await open_tier(f"kvstore://127.0.0.1:{port}", timeout_s=0.3)


async def test_open_tiers_checks_every_spec_before_opening_any(tmp_path):
    with pytest.raises(ConfigError, match="unknown redis URL scheme 'http'"):
        await open_tiers([(f"ssd:{tmp_path / 'ssd'}", {"capacity": 1 << 20}), ("http://cache:1", {})])
    assert not (tmp_path / "ssd").exists()  # nothing was opened


async def test_open_tiers_leaves_out_unreachable_tiers_only_when_not_required(tmp_path):
    specs = [
        ("host:", {"capacity": 1 << 20, "pin": False}),
        (f"ssd:{tmp_path / 'ssd'}", {"capacity": 1 << 20}),
        (f"redis://127.0.0.1:{free_port()}/0", {"connect_timeout_s": 0.5}),
    ]
    with pytest.raises(TierUnavailableError):
        await open_tiers(specs)
    left_out = []
    tiers = await open_tiers(specs, required=False, on_left_out=lambda kind, err: left_out.append(kind))
    try:
        assert [t.name for t in tiers] == ["host", "ssd"] and left_out == ["redis"]
    finally:
        for t in tiers:
            await t.aclose()


async def test_a_failed_open_closes_the_tiers_already_open(tmp_path):
    ssd_dir = tmp_path / "ssd"
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="is not usable"):  # always fatal, even if not required
        await open_tiers(
            [(f"ssd:{ssd_dir}", {"capacity": 1 << 20}), (f"ssd:{blocker / 'ssd'}", {"capacity": 1 << 20})],
            required=False,
        )
    again = await open_tier(f"ssd:{ssd_dir}", capacity=1 << 20)  # its lock was released
    await again.aclose()


def test_tier_specs_is_the_one_builder_of_a_stores_specs(tmp_path):
    """Host first with its capacity and options, SSD only when configured, lower tiers in
    order, a lower tier without a spec left out; every spec it builds resolves."""
    bare = StoreConfig(host_capacity=1 << 20, ssd_dir=None, host_retention=RetentionPolicy.LRU)
    assert tier_specs(bare, lower=[(None, {}), ("", {})]) == [
        ("host:", {"capacity": 1 << 20, "retention": RetentionPolicy.LRU})
    ]
    cfg = StoreConfig(host_capacity=1 << 20, ssd_dir=tmp_path / "ssd", ssd_capacity=2 << 20)
    specs = tier_specs(
        cfg, host={"pin": False}, ssd={"fsync": False}, lower=[("redis://127.0.0.1:1/0", {}), (None, {"x": 1})]
    )
    assert specs == [
        ("host:", {"capacity": 1 << 20, "retention": RetentionPolicy.REUSE, "pin": False}),
        (f"ssd:{tmp_path / 'ssd'}", {"capacity": 2 << 20, "fsync": False}),
        ("redis://127.0.0.1:1/0", {}),
    ]
    for spec, options in specs:
        resolve(spec, **options)
