"""Capacity arithmetic worked by hand (docs/architecture.md#kv-geometry-and-capacity), one table per variant."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import ConfigError
from kvstore.layout import (
    AttentionKind,
    ChunkShape,
    DType,
    KVGeometry,
    bytes_per_request,
    bytes_per_token,
    format_bytes,
    pages_per_chunk,
    round_up_tokens,
    validate_chunk_size,
)
from kvstore.layout.capacity import plan_capacity

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
BF16, FP16 = DType.BF16, DType.FP16


def gqa(**kw) -> KVGeometry:
    """The seed's teaching model: 32 layers, 8 KV heads, head dim 128, bf16."""
    return KVGeometry(32, 8, 128, BF16, **kw)


def dsv3(**kw) -> KVGeometry:
    """DeepSeek-V3-like MLA: 61 layers, latent 512 + rope 64."""
    return KVGeometry.mla(61, 512, 64, BF16, **kw)


# ---- DType -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, dtype, nbytes",
    [
        ("fp32", DType.FP32, 4),
        ("bf16", DType.BF16, 2),
        ("fp16", DType.FP16, 2),
        ("fp8", DType.FP8, 1),
        (" BF16 ", DType.BF16, 2),
    ],
)
def test_dtype_parse_and_size(name, dtype, nbytes):
    assert DType.parse(name) is dtype
    assert dtype.nbytes == nbytes


@pytest.mark.parametrize("name", ["int4", "", "bfloat16", "fp64"])
def test_dtype_unknown_lists_valid_names(name):
    with pytest.raises(ConfigError) as err:
        DType.parse(name)
    assert str(err.value) == f"unknown dtype {name!r}; expected one of fp32, bf16, fp16, fp8"


# ---- bytes per token: MHA / GQA / MQA / MLA ------------------------------------------------


@pytest.mark.parametrize(
    "geom, expected, kind",
    [
        # Llama-2-7B MHA: 2 x 32 layers x 32 heads x 128 x 2 B = 524288
        (KVGeometry(32, 32, 128, FP16, q_heads=32), 524_288, AttentionKind.MHA),
        # GQA teaching model: 2 x 32 x 8 x 128 x 2 = 131072 = 128 KiB
        (gqa(q_heads=32), 131_072, AttentionKind.GQA),
        # q_heads unknown: labelled GQA (MHA is its special case); bytes identical
        (gqa(), 131_072, AttentionKind.GQA),
        # GQA in fp32: 2 x 32 x 8 x 128 x 4 = 262144; in fp8: ... x 1 = 65536
        (KVGeometry(32, 8, 128, DType.FP32), 262_144, AttentionKind.GQA),
        (KVGeometry(32, 8, 128, DType.FP8), 65_536, AttentionKind.GQA),
        # MQA (Falcon-7B-like): 2 x 32 layers x 1 head x 64 x 2 = 8192
        (KVGeometry(32, 1, 64, BF16, q_heads=71), 8_192, AttentionKind.MQA),
        # MLA: 61 layers x (512 + 64) x 2 B, one vector, no factor 2 = 70272
        (dsv3(), 70_272, AttentionKind.MLA),
    ],
)
def test_bytes_per_token(geom, expected, kind):
    assert bytes_per_token(geom) == expected
    assert geom.kind is kind


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (8192, 1 * GiB),  # 131072 x 8192 = 2^17 x 2^13 = 2^30
        (6144, 3 * GiB // 4),  # 131072 x 6144 = 805306368 = 0.75 GiB
        (256, 32 * MiB),  # 131072 x 256 = 33554432: 256 more tokens cost 32 MiB
        (1, 128 * KiB),
    ],
)
def test_gqa_bytes_per_request(tokens, expected):
    assert bytes_per_request(gqa(), tokens) == expected


def test_sixteen_requests_of_8k_need_16_gib():
    report = plan_capacity(gqa(), tokens=8192, requests=16)
    assert report.bytes_per_request == 1 * GiB
    assert report.total_bytes == 16 * GiB  # 16 x 1 GiB
    assert report.tail_waste_bytes == 0  # 8192 is a multiple of 16


# ---- sliding window -----------------------------------------------------------------------
# one layer, one token of gqa(): 2 x 8 x 128 x 2 = 4096 B


@pytest.mark.parametrize(
    "window, sliding, tokens, expected",
    [
        # 16 full layers x 8192 x 4096 + 16 windowed layers x 4096 x 4096 = 512 MiB + 256 MiB
        (4096, 16, 8192, 805_306_368),
        # all 32 layers windowed (sliding_layers=None): 32 x 4096 x 4096 = 512 MiB
        (4096, None, 8192, 536_870_912),
        # below the window every layer keeps everything: 32 x 1000 x 4096 = 131072000
        (4096, 16, 1000, 131_072_000),
        # 1 windowed layer of 128 tokens: 31 x 8192 x 4096 + 1 x 128 x 4096 = 1040187392 + 524288
        (128, 1, 8192, 1_040_711_680),
    ],
)
def test_sliding_window_request_bytes(window, sliding, tokens, expected):
    geom = gqa(sliding_window=window, sliding_layers=sliding)
    assert bytes_per_request(geom, tokens) == expected
    assert bytes_per_token(geom) == 131_072  # the per-token rate ignores the window


# ---- TP and PP (largest rank) -------------------------------------------------------------


@pytest.mark.parametrize(
    "geom, heads, layers, replicated, expected",
    [
        # even split kv 8 / tp 2 = 4 heads: 2 x 32 x 4 x 128 x 2 = 65536
        (gqa(tp=2), 4, 32, False, 65_536),
        # kv 8 / tp 8 = 1 head: 2 x 32 x 1 x 128 x 2 = 16384
        (gqa(tp=8), 1, 32, False, 16_384),
        # kv 8 < tp 16: replicated, still 1 head per rank = 16384
        (gqa(tp=16), 1, 32, True, 16_384),
        # kv 6, tp 4: uneven, ceil(6/4) = 2 heads: 2 x 32 x 2 x 128 x 2 = 32768
        (KVGeometry(32, 6, 128, BF16, tp=4), 2, 32, True, 32_768),
        # MLA latent is replicated over TP: 61 x 576 x 2 = 70272 on every rank
        (dsv3(tp=8), 1, 61, True, 70_272),
        # PP 4 of 32 layers = 8 layers: 2 x 8 x 8 x 128 x 2 = 32768
        (gqa(pp=4), 8, 8, False, 32_768),
        # PP 4 of 61 layers: ceil(61/4) = 16 layers: 16 x 576 x 2 = 18432
        (dsv3(pp=4), 1, 16, False, 18_432),
        # TP 2 x PP 2: 4 heads, 16 layers: 2 x 16 x 4 x 128 x 2 = 32768
        (gqa(tp=2, pp=2), 4, 16, False, 32_768),
    ],
)
def test_per_rank_bytes_per_token(geom, heads, layers, replicated, expected):
    assert (geom.heads_per_rank, geom.layers_per_stage, geom.tp_replicated) == (heads, layers, replicated)
    assert bytes_per_token(geom, per_rank=True) == expected


@pytest.mark.parametrize(
    "sliding, expected",
    [
        # 16 full layers, pp 4 -> stage of 8, worst case all full: 8 x 8192 x 4096 = 256 MiB
        (16, 268_435_456),
        # 28 sliding (4 full): stage = 4 full + 4 windowed: 4 x 8192 x 4096 + 4 x 4096 x 4096
        (28, 201_326_592),
    ],
)
def test_pp_with_sliding_window_takes_worst_stage(sliding, expected):
    geom = gqa(pp=4, sliding_window=4096, sliding_layers=sliding)
    assert bytes_per_request(geom, 8192, per_rank=True) == expected


# ---- page rounding and tail waste ---------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, block, rounded",
    [
        (33, 16, 48),
        (32, 16, 32),
        (1, 16, 16),
        (8192, 16, 8192),
        (129, 128, 256),
        (5, 1, 5),
    ],
)
def test_round_up_tokens(tokens, block, rounded):
    assert round_up_tokens(tokens, block) == rounded


def test_page_rounding_tail_waste_33_tokens():
    report = plan_capacity(gqa(), tokens=33, requests=2, block_size=16)
    assert report.rounded_tokens == 48  # 3 blocks of 16
    assert report.bytes_per_request == 4_325_376  # 33 x 131072
    assert report.total_bytes == 8_650_752  # 2 x 4325376
    assert report.page_rounded_bytes == 12_582_912  # 2 x 48 x 131072
    assert report.tail_waste_bytes == 3_932_160  # 2 x 15 x 131072


def test_page_rounding_of_windowed_layers():
    # all 32 layers windowed at 100 tokens, 200 tokens, block 16: kept 100 -> rounded 112
    geom = gqa(sliding_window=100)
    assert bytes_per_request(geom, 200) == 13_107_200  # 32 x 100 x 4096
    assert bytes_per_request(geom, 200, block_size=16) == 14_680_064  # 32 x 112 x 4096


# ---- chunk helpers ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk, block, pages", [(256, 16, 16), (256, 128, 2), (16, 16, 1)])
def test_pages_per_chunk(chunk, block, pages):
    validate_chunk_size(chunk, block)
    assert pages_per_chunk(chunk, block) == pages


@pytest.mark.parametrize("chunk, block", [(100, 16), (0, 16), (-16, 16), (8, 16), (256, 0)])
def test_bad_chunk_size_names_both_numbers(chunk, block):
    for make in (pages_per_chunk, ChunkShape):
        with pytest.raises(ConfigError) as err:
            make(chunk, block)
        assert str(chunk) in str(err.value) and str(block) in str(err.value)


def test_a_chunk_shape_gives_its_pages_and_whole_blocks():
    shape = ChunkShape(256, 128)
    assert (shape.pages, shape.whole_blocks(599), shape.whole_blocks(127), shape.whole_blocks(256)) == (2, 512, 0, 256)


# ---- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: KVGeometry(0, 8, 128, BF16), "layers"),
        (lambda: KVGeometry(-1, 8, 128, BF16), "layers"),
        (lambda: KVGeometry(32, 0, 128, BF16), "kv_heads"),
        (lambda: KVGeometry(32, 8, -128, BF16), "head_dim"),
        (lambda: KVGeometry(32, 8, 128, "bf16"), "dtype"),
        (lambda: KVGeometry(True, 8, 128, BF16), "layers"),
        (lambda: gqa(tp=0), "tp"),
        (lambda: gqa(pp=-2), "pp"),
        (lambda: gqa(pp=33), "pp"),
        (lambda: gqa(q_heads=12), "q_heads"),
        (lambda: gqa(sliding_window=0), "sliding_window"),
        (lambda: gqa(sliding_window=4096, sliding_layers=33), "sliding_layers"),
        (lambda: gqa(sliding_window=4096, sliding_layers=0), "sliding_layers"),
        (lambda: gqa(sliding_layers=4), "sliding_layers"),
        (lambda: KVGeometry.mla(61, 0, 64, BF16), "kv_lora_rank"),
        (lambda: KVGeometry(61, 8, 576, BF16, kv_lora_rank=512, qk_rope_head_dim=64), "MLA"),
        (lambda: KVGeometry(61, 1, 128, BF16, qk_rope_head_dim=64), "kv_lora_rank"),
        (lambda: plan_capacity(gqa(), tokens=0), "tokens"),
        (lambda: plan_capacity(gqa(), tokens=-5), "tokens"),
        (lambda: plan_capacity(gqa(), tokens=8, requests=0), "requests"),
        (lambda: plan_capacity(gqa(), tokens=8, block_size=0), "block_size"),
        (lambda: plan_capacity(gqa(), tokens=8, chunk_size=24), "chunk_size"),
    ],
)
def test_bad_input_raises_config_error_naming_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        KVGeometry(0, 8, 128, BF16)


# ---- report -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (131_072, "128.00 KiB"),
        (805_306_368, "768.00 MiB"),
        (GiB, "1.00 GiB"),
        (16 * GiB, "16.00 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_report_to_dict_is_json_and_complete():
    report = plan_capacity(gqa(tp=2), tokens=33, requests=2, block_size=16, chunk_size=256)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["geometry"]["dtype"] == "bf16" and d["geometry"]["heads_per_rank"] == 4
    assert (d["tokens"], d["requests"], d["block_size"]) == (33, 2, 16)
    assert (d["rounded_tokens"], d["tail_tokens"]) == (48, 15)
    assert d["bytes_per_token"] == 131_072
    assert d["page_rounded_bytes"] - d["total_bytes"] == d["tail_waste_bytes"] == 3_932_160
    assert d["per_rank"]["bytes_per_token"] == 65_536  # half the heads
    assert d["per_rank"]["tail_waste_bytes"] == 1_966_080  # 2 x 15 x 65536
    assert (d["pages_per_chunk"], d["chunk_bytes"]) == (16, 16 * MiB)  # 256 x 65536


def test_report_format_shows_exact_and_binary_units():
    text = plan_capacity(gqa(), tokens=8192, requests=16).format()
    assert "131072 B (128.00 KiB)" in text
    assert "1073741824 B (1.00 GiB)" in text
    assert "17179869184 B (16.00 GiB)" in text
    assert "GQA" in text and "bf16" in text
