"""``kvstore bench tiers --growth`` at tiny sizes (200 and 2000 objects, 1 and 3 tenants):
the rows it prints and its ``--json`` shape, that every run really held its objects (the
host fill through the store core, the SSD files found by the tier's start-up scan) and that
every lookup of a present key hit, every absent one missed and every new put was stored.
Also: the bench's fast file writer produces exactly the file the SSD tier's own put
publishes.  No speed is checked.  Cost: about 10 s (the SSD puts fsync)."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from kvstore.bench.growth import GEOM, OBJ, PAYLOAD, Keys, write_files
from kvstore.cli.main import main
from tiers.base import put_bytes
from tiers.ssd import SSDTier
from tiers.ssd_files import object_path

SIZES, TENANTS, OPS = (200, 2000), (1, 3), 50


@pytest.fixture(scope="module")
def growth(tmp_path_factory):
    """One run of the CLI: its printed text and its JSON."""
    tmp = tmp_path_factory.mktemp("growth")
    out = tmp / "growth.json"
    sizes = ",".join(map(str, SIZES))
    argv = [
        "bench",
        "tiers",
        "--growth",
        "--host-sizes",
        sizes,
        "--ssd-sizes",
        sizes,
        "--tenants",
        ",".join(map(str, TENANTS)),
        "--ops",
        str(OPS),
        "--dir",
        str(tmp),
        "--json",
        str(out),
    ]
    return argv, json.loads(out.read_text()) if main(argv) == 0 else None


def test_every_run_held_its_objects_and_found_them(growth):
    _, data = growth
    runs = data["runs"]
    assert sorted((r["tier"], r["tenants"], r["size"]) for r in runs) == sorted(
        (tier, t, n) for tier in ("host", "ssd") for t in TENANTS for n in SIZES
    )
    for r in runs:
        assert r["objects"] == r["size"], r
        assert (r["hits"], r["misses"], r["stored"], r["lookups"]) == (OPS, OPS, OPS, OPS), r
        assert {op: v["n"] for op, v in r["latency_us"].items()} == {"put": OPS, "lookup hit": OPS, "lookup miss": OPS}
        assert (r["scan_s"] > 0) == (r["tier"] == "ssd")
        assert r["pool_bytes"] == (r["size"] * OBJ if r["tier"] == "host" else 0)


def test_rows_put_each_size_beside_the_smallest(growth):
    _, data = growth
    rows = {r["name"]: r for r in data["rows"]}
    # per tier and tenants: 3 operations x (p50, p99) per size, and the SSD scan per size
    assert len(rows) == len(TENANTS) * len(SIZES) * (6 + 7)
    big = rows["ssd 2k obj 3t lookup hit p99"]
    small = rows["ssd 200 obj 3t lookup hit p99"]
    assert big["limit_name"] == "same at 200" and big["limit_value"] == small["value"]
    assert (big["target"], big["better"], small["ratio"]) == (2.0, "lower", 1.0)
    assert rows["host 2k obj 1t put p50"]["target"] is None
    assert "host 2k obj 1t scan per object" not in rows and "ssd 2k obj 1t scan per object" in rows


def test_the_table_is_printed(growth, capsys):
    argv, _ = growth
    assert main([*argv[:-2], "--host-sizes", "20", "--ssd-sizes", "20", "--tenants", "1", "--ops", "5"]) == 0
    text = capsys.readouterr().out
    assert "kvstore bench tiers --growth" in text
    assert "ssd 20 obj 1t put p99" in text and "same at 20" in text
    assert "ssd 20 objects, 1 tenant(s): held 20" in text


def test_plain_tiers_bench_does_not_run_growth():
    from kvstore.cli.main import build_parser

    args = build_parser().parse_args(["bench", "tiers"])
    assert args.growth is False


def test_fast_writer_makes_the_tiers_own_file(tmp_path):
    keys = Keys(2)
    write_files(tmp_path / "fast", keys, 3)
    key = keys(2)
    buf = np.empty(OBJ, np.uint8)
    from kvstore import codec

    codec.encode_into(buf, key, GEOM, PAYLOAD)

    async def put() -> None:
        async with SSDTier(tmp_path / "tier", 8 * OBJ) as ssd:
            await put_bytes(ssd, key, memoryview(buf))

    asyncio.run(put())
    fast, own = object_path(tmp_path / "fast", key), object_path(tmp_path / "tier", key)
    assert fast.relative_to(tmp_path / "fast") == own.relative_to(tmp_path / "tier")
    assert fast.read_bytes() == own.read_bytes()
    assert (os.stat(fast).st_mode & 0o777, os.stat(fast.parent).st_mode & 0o777) == (
        os.stat(own).st_mode & 0o777,
        os.stat(own.parent).st_mode & 0o777,
    )
