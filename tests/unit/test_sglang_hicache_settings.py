"""The SGLang HiCache backend's extra config and key names, without SGLang (under ``.venv``).

Proves that SGLang's own keys pass through, the connector's tier keys parse with its typed
config, engine-only and unknown keys are refused by name, a config without a lower tier is
refused, and that namespaces separate scopes, TP ranks (except MLA KV) and models while SGLang's
hex keys are the objects' chunk hashes as they are.  Cost: under a second.
"""

from __future__ import annotations

import hashlib

import pytest

from adapters.sglang_hicache.names import Shard, backend_namespaces, format_tag, object_keys, page_hash, parents
from adapters.sglang_hicache.settings import parse_settings
from kvstore.errors import ConfigError
from kvstore.keys import ROOT

SGLANG = {
    "backend_name": "kvstore",
    "module_path": "adapters.sglang_hicache.backend",
    "class_name": "KVStoreHiCache",
    "interface_v1": 1,
    "prefetch_threshold": 256,
}


def test_sglang_keys_pass_and_tier_keys_parse(tmp_path):
    s = parse_settings({**SGLANG, "ssd_dir": str(tmp_path), "host_capacity": "16MiB", "scope": "team-a"}, env={})
    assert s.tiers.ssd_dir == tmp_path and s.tiers.host_capacity == 16 << 20
    assert (s.scope, s.model) == ("team-a", "")


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"ssd_dir": "/tmp", "chunk_size": 256}, ["'chunk_size'", "engine side"]),
        ({"ssd_dir": "/tmp", "bogus": 1}, ["hicache_storage_backend_extra_config", "'bogus'"]),
        ({"ssd_dir": "/tmp", "scope": 3}, ["scope must be a string"]),
        ({"host_capacity": "16MiB"}, ["needs a tier below host memory"]),
        ({"store_target": "no-port"}, ["store_target", "HOST:PORT"]),
    ],
)
def test_bad_configs_are_refused_by_name(extra, words):
    with pytest.raises(ConfigError) as err:
        parse_settings({**SGLANG, **extra}, env={})
    for word in words:
        assert word in str(err.value)


def test_namespaces_separate_scopes_ranks_and_models():
    base = backend_namespaces("m", "", Shard(tp_rank=0, tp_size=2))
    assert backend_namespaces("m", "", Shard(tp_rank=0, tp_size=2)) == base
    assert backend_namespaces("m", "t", Shard(tp_rank=0, tp_size=2)).rank != base.rank
    assert backend_namespaces("other", "", Shard(tp_rank=0, tp_size=2)).rank != base.rank
    assert backend_namespaces("m", "", Shard(tp_rank=1, tp_size=2)).rank != base.rank
    assert base.of_pool("kv") == base.rank  # MHA: KV pages are per TP rank
    mla = [backend_namespaces("m", "", Shard(tp_rank=r, tp_size=2, is_mla=True)) for r in (0, 1)]
    assert mla[0].of_pool("kv") == mla[1].of_pool("kv")  # MLA KV: one copy for every rank
    assert mla[0].of_pool("mamba") != mla[1].of_pool("mamba")  # Mamba states stay per rank


def test_keys_are_sglang_hashes_and_parents_chain():
    hexes = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    assert [page_hash(k).hex() for k in hexes] == hexes
    assert page_hash("not-hex") != page_hash("not-hex2")
    ns = backend_namespaces("m", "", Shard()).rank
    tag = format_tag("deepseek_v4_c4_indexer_scale", {"layout": "page_first"})
    assert len(tag) <= 32 and tag != format_tag("deepseek_v4_c4_indexer_scale", {"layout": "layer_first"})
    keys = object_keys(ns, tag, hexes)
    assert parents(keys, None) == [ROOT, page_hash(hexes[0]), page_hash(hexes[1])]
    assert parents(keys, ["ab" * 32])[0] == page_hash("ab" * 32)
    with pytest.raises(ValueError, match="non-empty string"):
        page_hash("")
