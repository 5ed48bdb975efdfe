"""The stage trace (``trace_path``) and each request's provenance, from the connector's two
halves driven in vLLM's hook order (``tests.kits.halves``, no engine): request a misses and is
saved; request b loads its two chunks from host memory; after a restart (a new connector
pair on the same SSD directory) request c loads them from SSD through a prefetch.

The trace file parses as Chrome's JSON array, spans nest on every track, every load ticket
shows its stages in lifecycle order (the four completion moments among them), and the
stats log says where each chunk came from and how long each stage took."""

from __future__ import annotations

import json

import pytest

from connector.device import HostDevice
from connector.emulated_cuda import EmulatedCudaDevice
from kvstore import trace
from tests.kits.halves import Engine, finish, prompt, run_request
from tests.kits.trace_stages import LOAD_STAGES, check_nesting, ticket_stages, track_names


@pytest.mark.parametrize("device", [HostDevice, EmulatedCudaDevice])
def test_trace_nests_and_orders_every_stage(tmp_path, device):
    tokens = prompt(600)
    e = Engine(tmp_path, device(), trace_path=str(tmp_path / "t1.json"), stats_path=str(tmp_path / "s1.json"))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    finish(e, "a")
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], seed=9) == 512
    finish(e, "b")
    e.close()
    e2 = Engine(tmp_path, device(), trace_path=str(tmp_path / "t2.json"), stats_path=str(tmp_path / "s2.json"))
    assert run_request(e2, "c", tokens, [0, 1, 2, 3, 4], seed=7) == 512
    finish(e2, "c")
    e2.close()

    events = trace.load(tmp_path / "t1.json")
    assert (tmp_path / "t1.json").read_text().rstrip().endswith("{}]")  # closed: strict JSON
    json.loads((tmp_path / "t1.json").read_text())
    check_nesting(events)
    names = set(track_names(events).values())
    assert {"req a", "req a saves", "req b", "req b chunk 0", "req b chunk 1", "copy stream rank 0"} <= names
    tickets = ticket_stages(events)
    assert [stages for _, stages in tickets] == [LOAD_STAGES, LOAD_STAGES]
    assert sorted(name for name, _ in tickets) == ["chunk 0 from host", "chunk 1 from host"]
    spans = {e["name"].rstrip("0123456789 ") for e in events if e["ph"] == "X"}
    assert {"request", "load job", "save job", "planned", "gather_issued", "snapshot_done"} <= spans
    assert [e["name"] for e in events if e["ph"] == "i" and e["name"].startswith("persisted")] == [
        "persisted ssd"
    ] * 2  # both chunks of a written down
    decisions = [e for e in events if e["ph"] == "i" and e["name"].startswith("decision")]
    assert [d["name"] for d in decisions] == ["decision: miss", "decision: load"]
    assert decisions[1]["args"]["outcome"] == "load"
    copies = [e for e in events if e["ph"] == "X" and track_names(events)[(e["pid"], e["tid"])] == "copy stream rank 0"]
    assert any("verify" in c["name"] for c in copies) and any("save" in c["name"] for c in copies)

    events2 = trace.load(tmp_path / "t2.json")
    check_nesting(events2)
    assert [s for _, s in ticket_stages(events2)] == [LOAD_STAGES, LOAD_STAGES]
    assert any(e["name"] == "prefetch from ssd" for e in events2 if e["ph"] == "X")

    stats = json.loads((tmp_path / "s2.json").read_text())
    (entry,) = [r for r in stats["recent"] if r["req_id"] == "c"]
    assert [(c["start"], c["end"], c["tier"]) for c in entry["chunks"]] == [(0, 256, "ssd"), (256, 512, "ssd")]
    assert set(entry["stages"]) == set(LOAD_STAGES) and all(v >= 0 for v in entry["stages"].values())
    assert sum(entry["tiers"].values()) == entry["hit_tokens"] == 512
    assert set(stats["stage_latency"]) >= set(LOAD_STAGES)
    assert stats["stage_latency"]["looked_up"]["p99"] >= stats["stage_latency"]["looked_up"]["p50"]


def test_a_trace_cut_short_still_loads(tmp_path):
    t = trace.Tracer(tmp_path / "cut.json", "test")
    tid = t.track("x")
    t.span(tid, "a", 1.0, 2.0)
    t.flush()  # no close: a crash
    assert [e["name"] for e in trace.load(tmp_path / "cut.json") if e["ph"] == "X"] == ["a"]


def test_a_request_that_ends_before_its_load_is_reported_keeps_its_stages(tmp_path):
    """A one-token request ends in the step that loads it, and vLLM frees a finished request
    before it hands the connector that step's worker output: the load's stage times arrive
    after ``request_finished``.  They still reach the request's stats entry (they were dropped,
    and ``bench e2e``'s restart scenario, all one-token prompts, had no stage times at all)."""
    tokens = prompt(600)
    e = Engine(tmp_path, HostDevice(), stats_path=str(tmp_path / "s.json"))
    run_request(e, "a", tokens, [0, 1, 2, 3, 4])
    e.settle()
    finish(e, "a")
    deliver, ended = e.sched.on_report, []

    def finished_first(report):
        if report is not None and report.timings and not ended:
            ended.append(e.sched.request_finished("b"))
        deliver(report)

    e.sched.on_report = finished_first
    assert run_request(e, "b", tokens, [10, 11, 12, 13, 14], seed=9) == 512
    e.sched.on_report = deliver
    assert ended  # request_finished ran before the load's report was delivered
    e.step(finished={"b"})
    e.close()
    stats = json.loads((tmp_path / "s.json").read_text())
    (entry,) = [r for r in stats["recent"] if r["req_id"] == "b"]
    assert set(entry["stages"]) == set(LOAD_STAGES)
    assert set(stats["stage_latency"]) >= set(LOAD_STAGES)
