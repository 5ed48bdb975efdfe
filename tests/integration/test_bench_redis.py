"""``kvstore bench redis`` end to end: it starts its own redis-server (or uses --redis URL),
prints the house table and writes every row as JSON with its same-run limit and ratio.
No speed is asserted (the machine is shared); the shape and the honesty of the rows are."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

EXPECTED = [
    (f"redis tier {op} {mb} MiB{suffix}", limit)
    for mb in (1, 4, 32)
    for op, suffix, limit in (
        ("put", "", "plain redis-py SET"),
        ("get", "", "plain redis-py GET"),
        ("put", " vs TCP", "loopback TCP put"),
        ("get", " vs TCP", "loopback TCP get"),
        *((("get", ": round trips", "one round trip"),) if mb == 1 else ()),
    )
] + [
    ("lookup 512 keys: round trips", "target"),
    ("lookup 512 keys: server commands", "target"),
    ("lookup 512 keys: latency", "plain redis-py GET round trip"),
]


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "redis", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_redis_writes_every_row_beside_its_limit(tmp_path):
    out = tmp_path / "redis.json"
    done = run_bench("--repeat", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["name"], r["limit_name"]) for r in rows] == EXPECTED
    for r in rows:
        assert set(r) == {
            "name",
            "value",
            "unit",
            "limit_name",
            "limit_value",
            "better",
            "target",
            "ratio",
            "meets_target",
        }
        assert r["value"] > 0 and r["limit_value"] > 0 and math.isfinite(r["value"])
        assert math.isclose(r["ratio"], r["value"] / r["limit_value"], rel_tol=1e-3)
        met = (
            None
            if r["target"] is None
            else (r["ratio"] >= r["target"] if r["better"] == "higher" else r["ratio"] <= r["target"])
        )
        assert r["meets_target"] == met
    by_name = {r["name"]: r for r in rows}
    for mb in (1, 4, 32):
        assert by_name[f"redis tier get {mb} MiB"]["unit"] == "GB/s"
        assert by_name[f"redis tier put {mb} MiB"]["value"] == by_name[f"redis tier put {mb} MiB vs TCP"]["value"]
        want = (2.0, 0.5) if mb == 32 else (1.0, None) if mb == 1 else (None, None)
        got = (by_name[f"redis tier get {mb} MiB"]["target"], by_name[f"redis tier get {mb} MiB vs TCP"]["target"])
        assert got == want
    # an object of one part (the default part_size) is read in one round trip, counted by the tier
    assert by_name["redis tier get 1 MiB: round trips"]["value"] == 1
    assert by_name["lookup 512 keys: round trips"]["value"] == 1  # one MGET on a single server
    assert by_name["lookup 512 keys: server commands"]["value"] == 1
    assert by_name["lookup 512 keys: round trips"]["meets_target"] is True
    assert "started by the benchmark" in done.stdout and "limit (same run)" in done.stdout


def test_bench_redis_against_a_given_url(redis_server, tmp_path):
    out = tmp_path / "given.json"
    done = run_bench("--redis", redis_server.url, "--repeat", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"kvstore bench redis on redis://127.0.0.1:{redis_server.port}" in done.stdout
    assert len(json.loads(out.read_text())) == len(EXPECTED)
    with redis_server.client() as c:
        assert c.dbsize() == 0  # the benchmark removed what it stored


def test_bench_redis_rejects_bad_arguments():
    done = run_bench("--repeat", "0")
    assert done.returncode != 0 and "must be at least 1" in done.stderr
    done = run_bench("--redis", "http://nowhere")
    assert done.returncode != 0 and "unknown redis URL scheme 'http'" in done.stderr
