"""The framework adapters speak the connector's one vocabulary for the lower tiers.

``connector.lower.LOWER_TIER_KEYS`` is the list the vLLM tier, the SGLang backend and the
LMCache L2 adapter take; this proves that every key in it is a real connector setting (a
renamed field would otherwise be refused by every adapter) and that each adapter's parsing
takes it with the connector's types.  The vLLM tier's own parsing is proven in
tests/integration/test_vllm_tier.py (it imports vLLM).  Cost: well under a second.
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from adapters.lmcache_l2 import settings as lmcache_settings
from adapters.sglang_hicache import settings as sglang_settings
from connector.config import ConnectorConfig
from connector.lower import LOWER_TIER_KEYS
from kvstore.errors import ConfigError


def test_every_lower_tier_key_is_a_connector_setting() -> None:
    assert LOWER_TIER_KEYS <= {f.name for f in fields(ConnectorConfig)}
    assert {"ssd_dir", "store_target", "redis_url", "keys_file"} <= LOWER_TIER_KEYS
    assert "host_capacity" not in LOWER_TIER_KEYS and "chunk_size" not in LOWER_TIER_KEYS


def test_both_framework_free_adapters_take_the_whole_vocabulary() -> None:
    assert lmcache_settings.TIER_KEYS == LOWER_TIER_KEYS
    assert sglang_settings.TIER_KEYS == LOWER_TIER_KEYS | {"host_capacity", "write_policy"}


@pytest.mark.parametrize("parse", [lmcache_settings.parse_settings, sglang_settings.parse_settings])
def test_a_lower_tier_key_is_parsed_with_the_connectors_types(parse, tmp_path) -> None:
    parsed = parse({"ssd_dir": str(tmp_path), "ssd_capacity": "2GiB", "lower_tiers_required": False})
    assert parsed.tiers.ssd_dir == tmp_path and parsed.tiers.ssd_capacity == 2 << 30
    assert parsed.tiers.lower_tiers_required is False
    with pytest.raises(ConfigError, match="ssd_capacity"):
        parse({"ssd_dir": str(tmp_path), "ssd_capacity": "lots"})
