"""The connector's store (``connector.lower``): its tiers opened from the connector config
through the registry, ``lower_tiers_required``, and the core's events as the connector's
failure and byte counters.  The write-down itself is ``tests/unit/test_writedown.py``."""

from __future__ import annotations

import pytest
from test_host_tier import make_obj  # noqa: E402 - shared object maker

from connector.config import ConnectorConfig
from connector.lower import lower_tier_specs, open_store, tier_specs
from kvstore import codec
from kvstore.config import RetentionPolicy
from kvstore.errors import ConfigError, TierUnavailableError
from kvstore.store.writedown import Offer
from kvstore.testing.redis_proc import free_port
from tests.kits.chain import keys_of, namespace
from tiers.ssd_files import scan_objects

NS = namespace("lower")


def config(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"host_capacity": "1MiB", **extra}, env={})


class Counts:
    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []
        self.bytes: list[tuple[str, str, int]] = []

    async def open(self, cfg: ConnectorConfig):
        return await open_store(cfg, lambda *a: self.bytes.append(a), lambda *a: self.failures.append(a))


def test_specs_follow_the_config_host_pool_first(tmp_path):
    cfg = config(
        ssd_dir=str(tmp_path / "ssd"),
        store_target="127.0.0.1:7000",
        store_token="t",
        redis_url="redis://127.0.0.1:6390/0",
    )
    specs = tier_specs(cfg)
    assert [s for s, _ in specs] == [
        "host:",
        f"ssd:{tmp_path / 'ssd'}",
        "kvstore://127.0.0.1:7000",
        "redis://127.0.0.1:6390/0",
    ]
    assert specs[0][1] == {"capacity": 1 << 20, "retention": RetentionPolicy.REUSE, "shared": True, "pin": False}
    assert tier_specs(config(host_retention="adaptive"))[0][1]["retention"] is RetentionPolicy.ADAPTIVE
    assert specs[2][1]["token"] == "t" and specs[2][1]["transport"] == cfg.store_transport
    assert specs[2][1]["lease_ttl_s"] == cfg.lease_ttl == 30.0  # one default, and it is read
    assert lower_tier_specs(cfg) == specs[1:]  # the tiers below the host pool
    assert lower_tier_specs(config()) == []
    assert tier_specs(config(store_target="h:1", lease_ttl="2.5"))[1][1]["lease_ttl_s"] == 2.5


async def test_unreachable_store_process_fails_start_or_is_left_out(tmp_path):
    port = free_port()  # nothing listens there
    counts = Counts()
    with pytest.raises(TierUnavailableError, match=str(port)):
        await counts.open(config(store_target=f"127.0.0.1:{port}"))
    lax = config(store_target=f"127.0.0.1:{port}", ssd_dir=str(tmp_path / "ssd"), lower_tiers_required="false")
    store = await counts.open(lax)
    try:
        assert [t.name for t in store.tiers] == ["host", "ssd"]
        assert counts.failures == [("remote", "open")]
    finally:
        await store.aclose()


async def test_unreachable_redis_is_left_out_when_not_required():
    counts = Counts()
    store = await counts.open(config(redis_url=f"redis://127.0.0.1:{free_port()}/0", lower_tiers_required="false"))
    try:
        assert [t.name for t in store.tiers] == ["host"] and counts.failures == [("redis", "open")]
    finally:
        await store.aclose()


async def test_write_down_results_become_connector_counters(tmp_path):
    counts = Counts()
    store = await counts.open(config(ssd_dir=str(tmp_path / "ssd")))
    k1, k2 = keys_of(NS, 2)
    try:
        for k in (k1, k2):
            obj = make_obj(k, 1)
            handle = store.host.put_start_sync(k, len(obj))
            handle.buffer[:] = obj
            assert store.host.put_commit_sync(handle)
        assert store.written(k1, None) is Offer.QUEUED
        assert await store.drain(5)
        assert counts.bytes == [("ssd", "write", len(make_obj(k1, 1)))] and counts.failures == []
        await store.lower[0].aclose()  # the disk tier fails from now on
        store.written(k2, None)
        assert await store.drain(5)
        assert counts.failures == [("ssd", "write:TierUnavailableError")]
        store.host.delete_sync(k2)  # now only a lower tier could answer: the failing one
        assert (await store.lookup([k1, k2])).tiers == ["host"]
        assert counts.failures[-1] == ("ssd", "lookup:TierUnavailableError")
    finally:
        await store.aclose()


@pytest.mark.parametrize("mac", [True, False])
async def test_mac_objects_decides_whether_ssd_objects_are_sealed(tmp_path, mac):
    """``mac_objects`` on (the default): what the connector writes to its SSD directory
    carries a key id and a MAC; off (a private directory, ``kvstore bench mac``'s limit):
    unsealed, and still read back.  Off is refused beside a shared Redis or encryption."""
    cfg = config(ssd_dir=str(tmp_path / "ssd"), mac_objects=str(mac).lower())
    store = await Counts().open(cfg)
    (k,) = keys_of(NS, 1)
    obj = make_obj(k, 1)
    try:
        assert (await store.put(k, memoryview(obj))).name == "STORED"
        assert await store.drain(5)
        (path,) = scan_objects(tmp_path / "ssd")
        assert (codec.decode_header(path.read_bytes()).key_id != 0) is mac
        store.host.delete_sync(k)
        buf = memoryview(bytearray(len(obj)))
        got = await store.read_into(k, buf)
        assert got is not None and bytes(buf[codec.HEADER_SIZE :]) == obj[codec.HEADER_SIZE :].tobytes()
    finally:
        await store.aclose()
    for other in ({"redis_url": "redis://127.0.0.1:1"}, {"encrypt_at_rest": "true"}):
        with pytest.raises(ConfigError, match="mac_objects: false is only for a private SSD directory"):
            config(ssd_dir=str(tmp_path / "ssd"), mac_objects="false", **other)
