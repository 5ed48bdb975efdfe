"""One engine of a reinforcement-learning loop, as a trainer drives a rollout engine:
``python -m tests.kits.rl_child SPEC OUT``.  A real vLLM ``LLM`` (single process, vLLM's own
prefix caching on) with the kvstore connector runs the spec's actions in order and writes
what each gave:

* ``["generate", label, tokens, params, salt]``: one greedy request with logprobs;
  ``params`` is its ``kv_transfer_params`` (None: none), ``salt`` its ``cache_salt``;
* ``["reload", scale]``: the trainer pushes new weights in place: every MLP and attention
  output weight of the model's files times ``scale``, through ``collective_rpc`` and the
  model runner's ``reload_weights`` (what RL frameworks call);
* ``["reset"]``: ``reset_prefix_cache(reset_connector=True)``, timed.

At the end, vLLM's own metrics (``LLM.get_metrics``): its per-source cached prompt tokens and
our counters on its registry (``vllm:kvstore_*``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _reloaded(model_dir: str, scale: float):
    """The weights of ``model_dir``'s files, MLP and ``o_proj`` weights times ``scale``."""
    from safetensors.torch import load_file

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if ("mlp" in name or "o_proj" in name) and name.endswith("weight"):
                tensor = tensor * scale
            yield name, tensor


def _push(model_dir: str, scale: float):
    def push(worker) -> None:
        worker.model_runner.reload_weights(weights_iterator=_reloaded(model_dir, scale))

    return push


def _totals(path: str) -> dict:
    """The connector's running totals (its stats file, written as each request ends)."""
    stats = json.loads(Path(path).read_text())
    return {k: stats[k] for k in ("tokens_hit", "tokens_hit_by_tier", "not_cached", "resets", "requests")}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        seed=0,
        distributed_executor_backend="uni",
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**spec["connector"]),
    )
    results = []
    for action in spec["actions"]:
        if action[0] == "reload":
            llm.collective_rpc(_push(spec["model"], action[1]))
            results.append({"action": "reload", "scale": action[1]})
        elif action[0] == "reset":
            t0 = time.perf_counter()
            ok = llm.reset_prefix_cache(reset_connector=True)
            results.append({"action": "reset", "ok": ok, "seconds": time.perf_counter() - t0})
        else:
            _, label, tokens, params, salt = action
            sp = SamplingParams(
                max_tokens=spec["max_tokens"],
                temperature=0.0,
                logprobs=1,
                ignore_eos=True,
                extra_args={"kv_transfer_params": params} if params is not None else None,
            )
            prompt = TokensPrompt(prompt_token_ids=tokens)
            if salt:
                prompt["cache_salt"] = salt
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            seq = out.outputs[0]
            results.append(
                {
                    "action": "generate",
                    "label": label,
                    "tokens": list(seq.token_ids),
                    "logprobs": [lp[t].logprob for t, lp in zip(seq.token_ids, seq.logprobs)],
                    "kv_transfer_params": out.kv_transfer_params,
                    "num_cached_tokens": out.num_cached_tokens,
                    "stats": _totals(spec["stats_path"]),
                }
            )
    metrics = [
        {"name": m.name, "labels": m.labels, "value": m.value}
        for m in llm.get_metrics()
        if m.name.startswith(("vllm:kvstore_", "vllm:prompt_tokens_cached_by_source"))
    ]
    results.append({"action": "metrics", "metrics": metrics})
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
