"""`python -m kvstore capacity` end to end, as a subprocess: numbers, --json and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GQA = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]
MLA = ["--layers", "61", "--mla-latent-dim", "512", "--mla-rope-dim", "64", "--dtype", "bf16"]


def capacity(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "capacity", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def capacity_json(*args: str) -> dict:
    proc = capacity(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # exactly one JSON object, nothing else on stdout


def test_text_report_of_the_seed_example():
    proc = capacity(*GQA, "--tokens", "8192")
    assert proc.returncode == 0, proc.stderr
    assert "131072 B (128.00 KiB)" in proc.stdout  # 2 x 32 x 8 x 128 x 2
    assert "1073741824 B (1.00 GiB)" in proc.stdout  # x 8192 tokens
    assert proc.stderr == ""


def test_json_sixteen_requests():
    d = capacity_json(*GQA, "--tokens", "8192", "--requests", "16")
    assert d["bytes_per_token"] == 131_072
    assert d["bytes_per_request"] == 1 << 30
    assert d["total_bytes"] == 16 << 30  # 16 x 1 GiB
    assert d["geometry"]["dtype"] == "bf16" and d["geometry"]["attention"] == "gqa"


@pytest.mark.parametrize(
    "args, per_token, per_rank",
    [
        # Llama-2-7B MHA fp16: 2 x 32 x 32 x 128 x 2 = 524288
        (["--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--dtype", "fp16"], 524_288, 524_288),
        # MQA: 2 x 32 x 1 x 64 x 2 = 8192
        (["--layers", "32", "--kv-heads", "1", "--head-dim", "64", "--dtype", "bf16"], 8_192, 8_192),
        # fp8 GQA: 2 x 32 x 8 x 128 x 1 = 65536
        (GQA[:-1] + ["fp8"], 65_536, 65_536),
        # MLA: 61 x 576 x 2 = 70272, no factor 2
        (MLA, 70_272, 70_272),
        # TP 2: 4 heads per rank -> 65536 per rank
        (GQA + ["--tp", "2"], 131_072, 65_536),
        # TP 16 > 8 heads: replicated, 1 head per rank: 2 x 32 x 1 x 128 x 2 = 16384
        (GQA + ["--tp", "16"], 131_072, 16_384),
        # PP 4: 8 layers per stage: 2 x 8 x 8 x 128 x 2 = 32768
        (GQA + ["--pp", "4"], 131_072, 32_768),
        # MLA PP 4: ceil(61/4) = 16 layers: 16 x 576 x 2 = 18432
        (MLA + ["--pp", "4", "--tp", "8"], 70_272, 18_432),
    ],
)
def test_json_bytes_per_token(args, per_token, per_rank):
    d = capacity_json(*args)
    assert d["bytes_per_token"] == per_token
    assert d["per_rank"]["bytes_per_token"] == per_rank


def test_json_sliding_window():
    # 16 full layers x 8192 x 4096 B + 16 windowed x 4096 x 4096 B = 805306368
    d = capacity_json(*GQA, "--sliding-window", "4096", "--sliding-layers", "16")
    assert d["bytes_per_request"] == 805_306_368
    assert d["geometry"]["sliding_layers"] == 16


def test_json_page_rounding_and_chunk():
    # 33 tokens, block 16 -> 48; waste 15 x 131072 = 1966080
    d = capacity_json(*GQA, "--tokens", "33", "--block-size", "16", "--chunk-size", "256")
    assert (d["rounded_tokens"], d["tail_tokens"]) == (48, 15)
    assert d["total_bytes"] == 4_325_376  # 33 x 131072
    assert d["page_rounded_bytes"] == 6_291_456  # 48 x 131072
    assert d["tail_waste_bytes"] == 1_966_080
    assert d["pages_per_chunk"] == 16  # 256 / 16


@pytest.mark.parametrize(
    "args, message",
    [
        (GQA[:-1] + ["int4"], "unknown dtype 'int4'; expected one of fp32, bf16, fp16, fp8"),
        (["--layers", "0"] + GQA[2:], "layers must be a positive integer, got 0"),
        (["--layers", "-3"] + GQA[2:], "layers must be a positive integer, got -3"),
        (GQA[:2] + ["--kv-heads", "0"] + GQA[4:], "kv_heads"),
        (GQA[:4] + ["--head-dim", "-1"] + GQA[6:], "head_dim"),
        (GQA + ["--tokens", "0"], "tokens"),
        (GQA + ["--requests", "-1"], "requests"),
        (GQA + ["--tp", "0"], "tp"),
        (GQA + ["--pp", "0"], "pp"),
        (GQA + ["--block-size", "0"], "block_size"),
        (
            GQA + ["--chunk-size", "100", "--block-size", "16"],
            "chunk_size 100 must be a positive multiple of block_size 16",
        ),
        (GQA + ["--sliding-layers", "4"], "sliding_layers needs sliding_window"),
        (MLA + ["--kv-heads", "128"], "do not apply with --mla-latent-dim"),
        (GQA[:4] + GQA[6:], "--kv-heads and --head-dim are required"),
    ],
)
def test_bad_input_exits_nonzero_with_clear_message(args, message):
    proc = capacity(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvstore capacity: error: ")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_json_hybrid_groups_window_layers_and_recurrent_state():
    """Per group: a full layer keeps every token, a sliding layer its window, a recurrent
    layer a fixed state whatever the length (and per rank, its share over TP and PP)."""
    d = capacity_json(
        "--layers",
        "6",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--dtype",
        "fp32",
        "--sliding-window",
        "256",
        "--sliding-layers",
        "5",
        "--recurrent-layers",
        "4",
        "--state-bytes",
        "65536",
        "--tokens",
        "2000",
        "--tp",
        "2",
        "--pp",
        "2",
    )
    per_layer_token = 2 * 2 * 64 * 4
    assert d["bytes_per_request"] == 1 * 2000 * per_layer_token + 5 * 256 * per_layer_token + 4 * 65536
    assert (
        d["per_rank"]["bytes_per_request"] - (1 * 2000 + 2 * 256) * per_layer_token // 2 == 2 * 65536 // 2
    )  # 2 recurrent layers, half the state


def test_recurrent_layers_need_their_state_size():
    proc = capacity(
        "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bf16", "--recurrent-layers", "2"
    )
    assert proc.returncode != 0 and "state_bytes" in proc.stderr
