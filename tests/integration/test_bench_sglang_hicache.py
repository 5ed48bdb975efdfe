"""``python -m harness.bench_sglang_hicache`` end to end, tiny: our HiCache backend (SSD directory,
both SGLang page paths, a real ``kvstore serve``) and SGLang's own ``HiCacheFile`` measured in one
run under SGLang 0.5.23's Python (``.venv-sglang``, ``make sglang``).

Proves that the bench writes a row with a limit for each setup and operation, that every page
of every setup came back from storage into the cleared host pool byte for byte (the child's own
report, read here) with exit status 0, that a page missing or differing makes it exit 1, and
that without ``.venv-sglang`` it exits 2 naming ``make sglang``.  No speed assertions: this
machine is shared and noisy.

Cost: about 20-35 s on this 2-core host (one SGLang import, about 15 s of it; one store process).
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness import bench_sglang_hicache as bench

ROOT = Path(__file__).resolve().parents[2]
PAGES = 4
OPS = ("set acked", "set", "get", "hit query")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    assert (ROOT / ".venv-sglang" / "bin" / "python").exists(), "run `make sglang` (make test does)"
    work = tmp_path_factory.mktemp("bench-sglang-hicache")
    cmd = [sys.executable, "-m", "harness.bench_sglang_hicache", "--pages", str(PAGES), "--repeats", "1"]
    cmd += ["--work", str(work / "run"), "--json", str(work / "rows.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return done, work


def test_bench_exits_0_with_a_row_per_setup_and_operation(run):
    done, work = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((work / "rows.json").read_text())
    assert [r["name"] for r in rows] == [f"{s} {op}" for s in bench.SETUPS for op in OPS]
    for r in rows:
        assert r["value"] > 0 and r["limit_value"] > 0 and math.isfinite(r["ratio"]), r
        assert r["limit_name"].startswith("page files"), r


def test_every_page_of_every_setup_came_back_equal(run):
    done, work = run
    report = json.loads((work / "run" / "report.json").read_text())
    assert report["sglang"] == "0.5.23"
    assert set(report["setups"]) == set(bench.SETUPS)
    for name, (one,) in report["setups"].items():
        counts = {k: one.get(k) for k in ("set_pages", "hit_pages", "got_pages", "equal_pages")}
        assert counts == dict.fromkeys(counts, PAGES), (name, one)
    paths = {name: runs[0]["path"] for name, runs in report["setups"].items()}
    assert paths == {
        "kvstore-ssd": "v1",
        "kvstore-ssd-generic": "generic",
        "kvstore-serve": "v1",
        "hicache-file": "generic",
    }
    assert bench.check(report, PAGES) == []


def test_a_missing_or_different_page_fails_the_run(run):
    _, work = run
    report = json.loads((work / "run" / "report.json").read_text())
    for field in ("equal_pages", "hit_pages", "got_pages"):
        bad = copy.deepcopy(report)
        bad["setups"]["hicache-file"][0][field] = PAGES - 1
        (problem,) = bench.check(bad, PAGES)
        assert problem.startswith("hicache-file repeat 0: expected 4 pages each"), problem
        assert [r.name for r in bench.rows_of(bad, PAGES)][-1] == "kvstore-serve hit query"  # no figures
    bad = copy.deepcopy(report)
    bad["setups"]["kvstore-ssd"][0]["limit"]["equal_pages"] = 0
    assert bench.check(bad, PAGES) == [f"kvstore-ssd repeat 0: limit: 0 equal, {PAGES} found"]


def test_without_the_sglang_environment_it_says_make_sglang(tmp_path, capsys):
    code = bench.main(["--sglang-python", str(tmp_path / "nowhere" / "python"), "--pages", "1"])
    assert code == 2
    assert "run `make sglang`" in capsys.readouterr().err
