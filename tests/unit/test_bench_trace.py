"""``kvstore bench trace``: plain LRU and Belady's MIN against values worked out by hand,
strict reading of the trace file, the ``--json`` shape, and the host tier's own policy
(the real ``HostTier`` through the store core) beside LRU on a hot prefix among scans,
under each retention policy, and the generated second trace shape.  About 3 s."""

from __future__ import annotations

import asyncio
import json
from fractions import Fraction

import pytest

from kvstore.bench import trace_gen
from kvstore.bench.trace import Request, lru_ratio, min_ratio, ours_ratio, read_trace
from kvstore.cli.main import main
from kvstore.config import RetentionPolicy
from kvstore.errors import ConfigError


def line(ts: float, n_in: int, ids: list[int], n_out: int = 1) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


# Worked by hand at a capacity of 3 blocks (512 tokens a block):
#   r0 [1,2,3] 1536 tokens  LRU: miss                       MIN: miss
#   r1 [1,2,4] 1400         LRU: hits 1,2 (1024); 3 goes    MIN: hits 1,2 (1024); 4 goes at once
#   r2 [5,6]   1024         LRU: miss; 1 and 2 go           MIN: miss; 5 and 6 go at once
#   r3 [1,2,3] 1536         LRU: miss                       MIN: hits 1,2,3 (1536)
HAND = [line(0, 1536, [1, 2, 3]), line(1000, 1400, [1, 2, 4]), line(2000, 1024, [5, 6]), line(3000, 1536, [1, 2, 3])]
TOTAL = 1536 + 1400 + 1024 + 1536


@pytest.fixture
def hand_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("\n".join(HAND) + "\n")
    return path


def test_lru_and_min_match_the_values_worked_by_hand(hand_trace):
    requests = read_trace(hand_trace)
    assert [r.hash_ids for r in requests] == [(1, 2, 3), (1, 2, 4), (5, 6), (1, 2, 3)]
    assert Fraction(lru_ratio(requests, 3)).limit_denominator(10**6) == Fraction(1024, TOTAL)
    assert Fraction(min_ratio(requests, 3)).limit_denominator(10**6) == Fraction(1024 + 1536, TOTAL)
    # A hit is capped at the request's input length: r1's two blocks hold 1024 of its 1400
    # tokens; with a cache that never evicts, r3 hits all 1536 and r1 its 1024.
    assert min_ratio(requests, 100) == lru_ratio(requests, 100) == pytest.approx((1024 + 1536) / TOTAL)


def test_min_evicts_the_farthest_next_use_and_may_drop_the_current_request():
    # Capacity 2: r0 stores 1,2 (next used by r2); r1's 3 is next used only by r3, farther:
    # MIN drops 3 at once and r2 hits both blocks; LRU drops 1 and then misses r2.
    reqs = [Request(0, 1024, 1, (1, 2)), Request(1, 512, 1, (3,)), Request(2, 700, 1, (1, 2)), Request(3, 512, 1, (3,))]
    total = 1024 + 512 + 700 + 512
    assert min_ratio(reqs, 2) == pytest.approx(700 / total)  # capped at input_length
    assert lru_ratio(reqs, 2) == 0.0


@pytest.mark.parametrize(
    "bad, why",
    [
        ("not json", "not JSON"),
        ('{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "missing hash_ids"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}', "hash id"),
        ("[1, 2]", "JSON object"),
        ("", "not JSON"),
    ],
)
def test_a_malformed_line_is_an_error_naming_its_line(tmp_path, bad, why, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(HAND[0] + "\n" + HAND[1] + "\n" + bad + "\n" + HAND[2] + "\n")
    with pytest.raises(ConfigError, match=rf"bad\.jsonl:3: .*{why}"):
        read_trace(path)
    assert main(["bench", "trace", str(path), "--capacity-blocks", "2"]) == 2
    assert "bad.jsonl:3" in capsys.readouterr().err


def test_json_output_has_the_documented_shape(hand_trace, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "trace", str(hand_trace), "--fractions", "0.5,1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [sorted(r) for r in rows] == [["capacity_blocks", "capacity_fraction", "lru", "min", "ours"]] * 2
    assert [(r["capacity_fraction"], r["capacity_blocks"]) for r in rows] == [(0.5, 3), (1.0, 6)]
    assert rows[0]["lru"] == pytest.approx(1024 / TOTAL) and rows[0]["min"] == pytest.approx(2560 / TOTAL)
    assert all(0 <= r["ours"] <= r["min"] + 1e-12 for r in rows)
    printed = capsys.readouterr().out
    assert "Belady MIN" in printed and "plain LRU" in printed
    assert main(["bench", "trace", str(hand_trace), "--capacity-blocks", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["capacity_blocks"] == 3 and row["capacity_fraction"] == pytest.approx(0.5)


def hot_prefix_with_scans(rounds: int = 30) -> list[Request]:
    """A 4-block system prompt asked with a fresh 2-block question every 2 s, and between
    two of them a 12-block one-shot document (a scan) that shares nothing."""
    reqs, fresh, t = [], 1000, 0.0
    for _ in range(rounds):
        reqs.append(Request(t, 6 * 512, 1, (1, 2, 3, 4, fresh, fresh + 1)))
        fresh += 2
        t += 2000
        reqs.append(Request(t, 12 * 512, 1, tuple(range(fresh, fresh + 12))))
        fresh += 12
        t += 2000
    return reqs


def test_ours_beats_plain_lru_on_a_hot_prefix_among_scans():
    reqs = hot_prefix_with_scans()
    ours, lru, best = asyncio.run(ours_ratio(reqs, 12)), lru_ratio(reqs, 12), min_ratio(reqs, 12)
    assert lru == 0.0  # each scan flushes the prompt out of LRU
    assert ours > lru and ours <= best
    # The first scan pushes the prompt out while it was used once; stored again by the
    # second question, its keys return (the pool remembers evicted keys): reused, they stay,
    # and the prompt (4 of 6 blocks) hits on every question from the third on.
    assert ours == pytest.approx(28 * 4 * 512 / sum(r.input_length for r in reqs))


def test_the_retention_policy_measured_as_ours_is_selectable():
    """``--retention``: the same replay through a host tier of each policy; ``lru`` loses the
    prompt to every scan as plain LRU does, ``adaptive`` keeps it as ``reuse`` does."""
    reqs = hot_prefix_with_scans()
    ratio = {p: asyncio.run(ours_ratio(reqs, 12, RetentionPolicy(p))) for p in ("reuse", "adaptive", "lru")}
    assert ratio["lru"] == lru_ratio(reqs, 12) == 0.0
    assert ratio["adaptive"] == ratio["reuse"] == asyncio.run(ours_ratio(reqs, 12)) > 0.0


def test_the_generated_chat_and_scan_trace_reads_back_and_repeats_for_a_seed(tmp_path):
    """``kvstore.bench.trace_gen``: the second trace shape of docs/bench-trace.md."""
    out = tmp_path / "gen.jsonl"
    assert trace_gen.main([str(out), "--seed", "3", "--requests", "300"]) == 0
    reqs = read_trace(out)
    assert len(reqs) == 300
    assert [list(r.hash_ids) for r in reqs] == [r["hash_ids"] for r in trace_gen.chat_and_scans(300, 3)]
    assert [r.hash_ids for r in reqs] != [tuple(r["hash_ids"]) for r in trace_gen.chat_and_scans(300, 4)]
    assert 0.0 < lru_ratio(reqs, 200) <= min_ratio(reqs, 200)  # prompts and turns are reused
