"""The LMCache L2 adapter's key mapping and settings, without LMCache (``adapters.lmcache_l2.names``,
``adapters.lmcache_l2.settings``): every field of LMCache's object key and the adapter's scope
changes the kvstore key, the scope and the cache salt cannot be confused, and bad parameters
are refused naming the key.  Cost: well under 1 s."""

from __future__ import annotations

import pytest

from adapters.lmcache_l2.names import TAG, KeyMapper
from adapters.lmcache_l2.settings import parse_settings
from kvstore.errors import ConfigError

BASE = (b"\x01" * 8, "org/model", 0, 0, "")


def test_every_field_names_a_different_object():
    keys = KeyMapper("").key
    variants = [
        keys(*BASE),
        keys(b"\x02" * 8, *BASE[1:]),
        keys(b"\x01" * 9, *BASE[1:]),  # chunk hashes of any length
        keys(BASE[0], "org/other", 0, 0, ""),
        keys(BASE[0], "org/model", 1, 0, ""),
        keys(BASE[0], "org/model", 0, 1, ""),
        keys(BASE[0], "org/model", 0, 0, "salt"),
        KeyMapper("team-a").key(*BASE),
    ]
    assert len(set(variants)) == len(variants)
    assert all(k.tag == TAG for k in variants)
    assert keys(*BASE) == KeyMapper("").key(*BASE)  # deterministic across adapters


def test_scope_and_salt_cannot_be_confused():
    assert KeyMapper("a/b").key(BASE[0], "m", 0, 0, "") != KeyMapper("a").key(BASE[0], "m", 0, 0, "b")
    assert KeyMapper("a").key(*BASE).namespace != KeyMapper("").key(BASE[0], "org/model", 0, 0, "a").namespace


def test_settings_take_the_connector_vocabulary():
    s = parse_settings({"store_target": "127.0.0.1:7470", "scope": "t", "max_capacity_gb": 1.5, "redis-url": ""})
    assert (s.tiers.store_target, s.scope, s.max_capacity_bytes) == ("127.0.0.1:7470", "t", 3 << 29)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({}, "store_target"),
        ({"store_target": "h:1", "bogus": 1}, "'bogus'"),
        ({"store_target": "h:1", "device": "cpu"}, "'device'"),
        ({"store_target": "h:1", "scope": ["x"]}, "scope"),
        ({"store_target": "h:1", "max_capacity_gb": True}, "max_capacity_gb"),
        ({"store_target": "h:1", "ssd_capacity": "lots"}, "ssd_capacity"),
        ("store_target=h:1", "adapter_params"),
    ],
)
def test_bad_parameters_name_the_key(params, named):
    with pytest.raises(ConfigError, match=named) as err:
        parse_settings(params)  # type: ignore[arg-type]
    assert "adapter_params" in str(err.value)


def test_the_bench_command_is_registered_and_says_how_to_get_lmcache(tmp_path, capsys):
    import subprocess
    import sys

    from harness import bench_lmcache_l2

    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "lmcache-l2", "--help"], capture_output=True, text=True, check=True
    )
    assert "--lmcache-site" in out.stdout
    assert bench_lmcache_l2.main(["--lmcache-site", str(tmp_path)]) == 2
    assert "make lmcache" in capsys.readouterr().err
