"""The KV events and metrics of kvstore's vLLM secondary tier (adapters.vllm_tier.observe),
read through vLLM's own ``TieringOffloadingManager`` (``take_events``, ``get_stats``) and
``TieringOffloadingSpec.build_metric_definitions``, over a real SSD directory.

Proves: a store job's chunks yield one stored event of our tier (our medium, ownership, the
job's keys); a key deleted from the tier, or evicted by a full SSD directory, yields a removed
event with that key; the stats count the bytes stored and loaded, the lookups by result and a
forged object's refusal; with vLLM's KV cache events off the tier keeps no events; vLLM's spec
lists the tier's metric definitions.
Cost: about 3-5 s (five small managers), plus importing vLLM when no earlier test did.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from adapters.vllm_tier.config import LAYOUT_ID
from adapters.vllm_tier.observe import LOAD_MISSED, LOADED_BYTES, LOOKUPS, METRICS, REFUSED, STORED_BYTES
from kvstore import codec
from tests.kits import vllm_tier as kit
from tiers.base import PutResult, put_bytes

HIT, MISS = LookupResult.HIT, LookupResult.MISS
TIER_TYPE = kit.TIER["type"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("models") / "a", 1)


def ours(mgr) -> list:
    return [e for e in mgr.take_events() if e.ownership == TIER_TYPE]


def values(stats, name: str) -> dict:
    return stats.data["data"].get(name, {})


def test_stored_and_removed_events(model, tmp_path):
    keys, data = kit.offload_keys(3, seed=21), kit.payloads(3, seed=21)
    mgr = kit.manager(model, {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"}, events=True)
    try:
        kit.store(mgr, keys, data)
        (stored,) = ours(mgr)
        assert (stored.removed, stored.medium, list(stored.keys)) == (False, Medium.STORAGE, keys)
        assert ours(mgr) == []  # taken once
        tier = kit.our_tier(mgr)
        (ssd,) = tier.store.tiers
        assert tier.store.call(ssd.delete(tier.key_of(keys[1])), 10)
        (removed,) = ours(mgr)
        assert (removed.removed, list(removed.keys)) == (True, [keys[1]])
    finally:
        mgr.shutdown()


def test_no_events_when_vllm_has_them_off(model, tmp_path):
    mgr = kit.manager(model, {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"})
    try:
        kit.store(mgr, kit.offload_keys(2, seed=22), kit.payloads(2, seed=22))
        assert ours(mgr) == [] and not kit.our_tier(mgr).events.enabled
    finally:
        mgr.shutdown()


def _forge(tier, key) -> None:
    """An object of the right checksum and size but no MAC (test_vllm_tier's forgery)."""
    geometry = codec.ObjectGeometry(1, 1, kit.CHUNK_BYTES, dtype="uint8", layout_id=LAYOUT_ID)
    obj = bytearray(codec.object_size(geometry))
    codec.encode_into(obj, key, geometry, bytes(kit.CHUNK_BYTES))
    (ssd,) = tier.store.tiers
    assert tier.store.call(put_bytes(ssd, key, memoryview(obj)), 10) is PutResult.STORED


def test_stats_count_what_the_tier_did(model, tmp_path):
    keys, data = kit.offload_keys(3, seed=23), kit.payloads(3, seed=23)
    params = {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"}
    first = kit.manager(model, params)
    try:
        kit.store(first, keys, data)
        assert values(first.get_stats(), STORED_BYTES) == {(): 3 * kit.CHUNK_BYTES}
    finally:
        first.shutdown()
    second = kit.manager(model, params)  # a restart: nothing in its primary tier
    try:
        forged = kit.offload_keys(1, seed=24)
        _forge(kit.our_tier(second), kit.our_tier(second).key_of(forged[0]))
        assert kit.lookup(second, keys[:2] + forged) == [HIT, HIT, MISS]
        stats = second.get_stats()
        assert values(stats, LOADED_BYTES) == {(): 2 * kit.CHUNK_BYTES}
        assert values(stats, REFUSED) == {("ssd", "forged"): 1}
        assert values(stats, LOAD_MISSED) == {(): 1}
        assert values(stats, LOOKUPS)[("hit",)] >= 3
        assert not values(stats, STORED_BYTES)
        later = second.get_stats()
        assert later is None or not values(later, REFUSED)  # taken once
    finally:
        second.shutdown()


def test_vllm_spec_lists_the_tier_metrics(tmp_path):
    extra = {"secondary_tiers": [{**kit.TIER, "ssd_dir": str(tmp_path / "ssd")}]}
    definitions = TieringOffloadingSpec.build_metric_definitions(extra)
    assert {name: definitions.get(name) for name in METRICS} == METRICS


def test_ssd_eviction_gives_removed_events(model, tmp_path):
    """An SSD directory of room for about two objects: storing four evicts the oldest, and
    each evicted key comes back as a removed event of our tier."""
    keys, data = kit.offload_keys(4, seed=25), kit.payloads(4, seed=25)
    room = 2 * kit.CHUNK_BYTES + kit.CHUNK_BYTES // 2
    mgr = kit.manager(model, {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": room}, events=True)
    try:
        kit.store(mgr, keys[:2], data[:2], req_id="a")
        kit.store(mgr, keys[2:], data[2:], req_id="b")
        events = ours(mgr)
        removed = [k for e in events if e.removed for k in e.keys]
        stored = [k for e in events if not e.removed for k in e.keys]
        assert stored == keys and removed and set(removed) <= set(keys[:2]), events
        (ssd,) = kit.our_tier(mgr).store.tiers
        assert ssd.stats().evictions == len(removed)
    finally:
        mgr.shutdown()
