"""The README's main job and the tier benchmark, run as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_demo_reads_back_from_ssd_after_restart(tmp_path):
    proc = run_cli("demo", "--dir", str(tmp_path / "ssd"), "--host-capacity", "128MiB")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "result: PASS" in out
    replay = out.split("== engine 2")[1]
    ssd_line = next(line for line in replay.splitlines() if "tier ssd" in line)
    assert int(ssd_line.split("hits")[1].split()[0]) > 0
    assert "0 failed -> OK" in replay
    assert "hit tokens / looked-up prompt tokens" in out
    assert any(p.suffix == ".kv" for p in (tmp_path / "ssd").rglob("*"))


def test_demo_rejects_bad_capacity():
    proc = run_cli("demo", "--host-capacity", "lots")
    assert proc.returncode != 0
    assert "cannot parse size" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_tiers_rows_carry_limits(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_cli(
        "bench",
        "tiers",
        "--repeat",
        "1",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "rows.png"),
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    names = {r["name"] for r in rows}
    for expected in (
        "host put 32 MiB",
        "host get 28 MiB",
        "ssd write 32 MiB",
        "ssd cold read 28 MiB",
        "chained hash per 256-token chunk",
        "host index bytes per object",
        "MAC seal (keyed BLAKE3) 32 MiB",
        "MAC check (keyed BLAKE3) 32 MiB",
        "AES-256-GCM encrypt 32 MiB",
        "AES-256-GCM decrypt 32 MiB",
        "xxh3-128 checksum 32 MiB",
        "ssd hit 2 MiB encrypted, cold",
        "ssd hit 2 MiB encrypted, warm",
    ):
        assert expected in names
    digest = {n.split(",")[0] for n in names if n.startswith("weight digest")}
    assert digest == {"weight digest 1 GiB cold", "weight digest 1 GiB warm"}
    for r in rows:
        assert {"name", "value", "unit", "limit_name", "limit_value", "ratio"} <= set(r)
        assert r["limit_value"] > 0 and r["value"] > 0
        assert abs(r["ratio"] - r["value"] / r["limit_value"]) < 1e-3
    assert "limit (same run)" in proc.stdout
    assert (tmp_path / "rows.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_rejects_zero_repeat():
    proc = run_cli("bench", "tiers", "--repeat", "0")
    assert proc.returncode == 2 and "--repeat" in proc.stderr
