"""The connector's stats file (``kvstore.metrics.HitStats.write``), rewritten as each request
ends: every logged entry and every counter in it, an amended entry as amended, the oldest
entries gone past ``RECENT_MAX``, and the write's cost not growing with the entries already
encoded (each is encoded once).  Under 1 s."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.metrics import HitStats


def _log(stats: HitStats, i: int) -> dict[str, object]:
    return stats.log_request(100 + i, 64, {"host": 64}, False, {"outcome": "load"}, f"req-{i}", 0, [])


def test_the_file_holds_every_entry_and_counter_and_an_amended_entry_as_amended(tmp_path: Path):
    stats, path = HitStats(), tmp_path / "stats.json"
    entries = [_log(stats, i) for i in range(3)]
    stats.requests, stats.tokens_hit = 3, 192
    stats.add("decisions", "load", 3)
    stats.write(path, tiers={"host": {"objects": 2}})
    first = json.loads(path.read_text())
    assert [e["req_id"] for e in first["recent"]] == ["req-0", "req-1", "req-2"]
    assert "stages" not in first["recent"][1]
    assert first["requests"] == 3 and first["tokens_hit"] == 192 and first["decisions"] == {"load": 3}
    assert first["tiers"] == {"host": {"objects": 2}} and "rates" in first and "stage_latency" in first

    stats.amend(entries[1], stages={"on_device": 0.01})  # the load's stage times, reported later
    stats.requests = 4
    _log(stats, 3)
    stats.write(path)
    second = json.loads(path.read_text())
    assert second["recent"][1]["stages"] == {"on_device": 0.01}
    assert [e["req_id"] for e in second["recent"]] == ["req-0", "req-1", "req-2", "req-3"]
    assert second["requests"] == 4 and "tiers" not in second
    assert stats.to_json()["recent"] == second["recent"]


def test_only_the_last_entries_are_kept_and_each_is_encoded_once(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(HitStats, "RECENT_MAX", 5)
    stats, path = HitStats(), tmp_path / "stats.json"
    for i in range(8):
        _log(stats, i)
    stats.write(path)
    assert [e["req_id"] for e in json.loads(path.read_text())["recent"]] == [f"req-{i}" for i in range(3, 8)]
    assert len(stats._encoded) == 5  # the dropped entries' texts went with them

    calls: list[object] = []
    real = json.dumps

    def counting(obj, *args, **kwargs):
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr("kvstore.metrics.json.dumps", counting)
    _log(stats, 8)
    stats.write(path)
    # the counters once, the new entry once: the four kept entries reuse their text
    assert len(calls) == 2
    assert sorted(("requests" in c, c.get("req_id")) for c in calls) == [(False, "req-8"), (True, None)]
    assert [e["req_id"] for e in json.loads(path.read_text())["recent"]] == [f"req-{i}" for i in range(4, 9)]
