"""StoreConfig and size parsing: tables of cases, and bad input that must name the key."""
import re
from pathlib import Path

import pytest

from kvstore.config import StoreConfig, WritePolicy, parse_size
from kvstore.errors import ConfigError


@pytest.mark.parametrize("text,expected", [
    (4096, 4096),
    ("4096", 4096),
    ("512MiB", 512 * 2**20),
    ("8GiB", 8 * 2**30),
    ("1.5GB", 1_500_000_000),
    ("64 kib", 64 * 1024),
    ("2TB", 2 * 10**12),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-5", "0", 0, -1, "1e9", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, "host_capacity")


def test_from_mapping_converts_and_reads_env(tmp_path):
    env = {"KVSTORE_SSD_CAPACITY": "2GiB", "KVSTORE_HOST_CAPACITY": "1GiB"}
    cfg = StoreConfig.from_mapping({"host_capacity": "512MiB", "ssd_dir": str(tmp_path)}, env=env)
    assert cfg.host_capacity == 512 * 2**20          # the mapping wins over the environment
    assert cfg.ssd_capacity == 2 * 2**30             # the environment fills the gap
    assert cfg.ssd_dir == Path(tmp_path)
    assert cfg.write_policy is WritePolicy.WRITE_THROUGH


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match="ssd_dirr"):
        StoreConfig.from_mapping({"ssd_dirr": "/tmp/x"}, env={})


@pytest.mark.parametrize("values,needle", [
    ({"chunk_size": 0}, "chunk_size 0"),
    ({"chunk_size": "abc"}, "chunk_size"),
    ({"host_capacity": "lots"}, "host_capacity"),
    ({"ssd_capacity": -1}, "ssd_capacity"),
    ({"write_policy": "sometimes"}, "write_policy"),
    ({"lease_ttl": "soon"}, "lease_ttl"),
    ({"lease_ttl": 0}, "lease_ttl"),
])
def test_bad_values_name_the_key(values, needle):
    with pytest.raises(ConfigError, match=needle):
        StoreConfig.from_mapping(values, env={})


# --- the connector's shared-tier keys ---------------------------------------------------------

def test_connector_shared_tier_keys_convert():
    from connector.config import ConnectorConfig

    cfg = ConnectorConfig.from_extra_config(
        {"store_target": "kvstore:50051", "store_tls_ca": "/etc/ca.pem", "store_transport": "stream",
         "redis_url": "redis://r:6379/0", "write_policy": "write_back", "lower_tiers_required": "no"},
        env={"KVSTORE_STORE_TOKEN": "t0k"})
    assert (cfg.store_target, cfg.store_token, str(cfg.store_tls_ca)) == ("kvstore:50051", "t0k", "/etc/ca.pem")
    assert (cfg.store_transport, cfg.write_policy, cfg.lower_tiers_required) == ("stream", WritePolicy.WRITE_BACK, False)
    assert cfg.has_lower_tiers
    assert not ConnectorConfig.from_extra_config({}, env={}).has_lower_tiers


@pytest.mark.parametrize("values,needle", [
    ({"store_target": "localhost"}, "store_target: expected HOST:PORT"),
    ({"store_target": "a b:1"}, "store_target"),
    ({"store_transport": "tcp"}, "store_transport: 'tcp' is not one of auto, shm, stream"),
    ({"write_policy": "write_around"}, "write_policy: 'write_around'"),
    ({"lower_tiers_required": "maybe"}, "lower_tiers_required"),
])
def test_connector_shared_tier_keys_reject(values, needle):
    from connector.config import ConnectorConfig

    with pytest.raises(ConfigError, match=re.escape(needle)):
        ConnectorConfig.from_extra_config(values, env={})
