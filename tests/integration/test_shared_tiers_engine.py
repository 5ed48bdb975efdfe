"""Real vLLM engines sharing the network tiers: Redis, and the store process dying mid-run.

* Two engine processes on one Redis (no SSD): the main job with ``--redis-url --no-ssd``,
  so engine 2's hits can only come from Redis; every output equals the recompute reference.
* The store process killed while an engine is using it: the engine keeps serving by
  recomputing (the remote tier's circuit breaker opens), and its outputs stay correct.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness import kit, tinymodel
from harness.main import connector_config
from kvstore.testing.serve_proc import StoreProcess

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_two_engines_share_one_redis(redis_server, tmp_path):
    """The main job as a user runs it, on Redis (eager, as the other engine tests: vLLM's
    default compiled model runs with the connector in tests/compose, the main job in a
    container, and in test_mla_engine.py)."""
    run = subprocess.run(
        [sys.executable, "-m", "harness.main", "--no-ssd", "--redis-url", redis_server.url, "--workdir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "result: PASS" in run.stdout and "MISMATCH" not in run.stdout, run.stdout
    stats2 = json.loads((tmp_path / "stats-2.json").read_text())
    for stats in (json.loads((tmp_path / "stats-1.json").read_text()), stats2):  # per-tier truth
        assert sum(stats["tokens_hit_by_tier"].values()) == stats["tokens_hit"] > 0
        assert all(sum(e["tiers"].values()) == e["hit_tokens"] for e in stats["recent"])
    assert run.stdout.count(" = total ") == 2, run.stdout
    assert stats2["tokens_hit_by_tier"].get("redis", 0) > 0
    assert stats2["tiers"]["redis"]["hits"] > 0
    assert stats2["tokens_hit_by_tier"].get("ssd", 0) == 0
    assert redis_server.client().dbsize() > 0


def test_store_killed_mid_run_engine_recomputes_and_stays_correct(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", "tiny-f32")
    workload = kit.Workload.standard(vocab=tinymodel.GEOMETRIES["tiny-f32"].vocab)
    reference = kit.run_engine(model, None, workload)
    with StoreProcess(tmp_path / "store", "--host-capacity", "512MiB").start() as store:
        first = tmp_path / "stats-1.json"
        result = kit.run_engine(model, connector_config(None, first, store_target=store.target), workload)
        assert kit.compare_outputs(reference, result)
        second = tmp_path / "stats-2.json"
        killed = threading.Event()

        def kill_after_first_request() -> None:  # stats are rewritten as each request ends
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not killed.is_set():
                try:
                    if json.loads(second.read_text())["requests"] >= 1:
                        store.kill()
                        killed.set()
                        return
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.05)

        killer = threading.Thread(target=kill_after_first_request, daemon=True)
        killer.start()
        result = kit.run_engine(model, connector_config(None, second, store_target=store.target), workload)
        killed.set()
        killer.join(5)
    cmp = kit.compare_outputs(reference, result)
    assert cmp, cmp.mismatches
    stats = json.loads(second.read_text())
    remote = stats["tiers"]["remote"]
    assert remote["breaker_opened"] >= 1  # it noticed the store was gone
    assert len(result.requests) == len(workload.requests)  # and served every request
    assert stats["requests"] == len(workload.requests) + 1  # (+1: the warm-up prompt)
