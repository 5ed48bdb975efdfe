"""StoreConfig and size parsing: tables of cases, and bad input that must name the key."""
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
