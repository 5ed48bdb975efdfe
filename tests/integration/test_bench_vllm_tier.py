"""``kvstore bench vllm-tier`` (``harness.bench_vllm_tier.main``, the command's own code) in a
tiny configuration: 6 blocks of 64 KiB in requests of 4, one repeat, through vLLM's own
``TieringOffloadingManager`` over a real /dev/shm primary region, with our tier on a real SSD
directory, our tier over a real ``kvstore serve`` (started by the bench), and vLLM's ``fs``
tier on a directory.

Proves: the table has the store, restart-lookup and load rows of both setups beside the
limit's; every block of every setup (and of the limit) came back byte for byte, and the exit
status is 0; with ``--damage-one`` (a byte of one stored file flipped per setup before the
restart) the comparison fails and the exit status is 1: kvstore refuses the damaged object
(a missing block), vLLM's fs tier loads the wrong bytes (the store process's objects are in
its memory, and are left alone).  The figures are not checked (speed
is the bench's business, never a test's); bad sizes are refused by name; pyproject names the
``kvstore bench vllm-tier`` entry point, whose parser runs ``command``.
Cost: about 8 s for the two runs (each starts a store process), plus importing vLLM when no
earlier test did (5-30 s on a busy 2-core host).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import bench_vllm_tier as bench

TINY = ["--blocks", "6", "--request-blocks", "4", "--block-bytes", str(64 * 1024), "--repeats", "1"]


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    status = bench.main([*TINY, "--dir", str(tmp_path / "work"), "--json", str(out), *extra])
    return status, json.loads(out.read_text())


def test_both_setups_load_every_block_back_beside_the_limit(tmp_path, capsys):
    status, report = _run(tmp_path)
    assert status == 0
    names = [r["name"] for r in report["rows"]]
    assert names == [f"{s} {phase}" for s in bench.SETUPS for phase in ("store", "restart lookup", "load")]
    assert all(r["value"] > 0 and r["limit_value"] > 0 for r in report["rows"])
    assert {r["unit"] for r in report["rows"]} == {"GB/s", "ms"}
    for name in (bench.LIMIT, *bench.SETUPS):
        found = report["checks"][name]
        assert (found["ok"], found["equal"], found["missing"]) == (True, [6], [0]), name
    assert isinstance(report["checks"]["vllm-fs"]["o_direct"], bool)  # vLLM's fs tier was really built
    assert "vllm-fs load" in capsys.readouterr().out
    assert not any((tmp_path / "work").iterdir())  # the run's directories are gone


def test_a_damaged_block_fails_the_comparison(tmp_path):
    status, report = _run(tmp_path, "--damage-one")
    assert status == 1
    names = ("kvstore", "vllm-fs", bench.LIMIT, "kvstore-serve")
    ours, theirs, limit, serve = (report["checks"][n] for n in names)
    assert ours["ok"] is False and ours["equal"] == [5] and ours["missing"] == [1]  # refused: checksum
    assert theirs["ok"] is False and theirs["equal"] == [5] and theirs["missing"] == [0]  # loaded, wrong bytes
    assert limit["ok"] is True and serve["ok"] is True  # not damaged: by design; in the store's memory


@pytest.mark.parametrize("bad", [["--block-bytes", "5000"], ["--blocks", "0"]])
def test_bad_sizes_are_refused_by_name(bad, capsys):
    assert bench.main([*TINY, *bad]) == 2
    err = capsys.readouterr().err
    assert ("--block-bytes" in err) if "--block-bytes" in bad else ("--blocks" in err)


def test_kvstore_bench_names_the_suite():
    import argparse
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["kvstore.bench"]["vllm-tier"] == "harness.bench_vllm_tier:register"
    suites = argparse.ArgumentParser().add_subparsers()
    bench.register(suites)
    args = suites.choices["vllm-tier"].parse_args(["--blocks", "3"])
    assert args.func is bench.command and args.blocks == 3 and args.page_cache == "cold"
