"""``kvstore bench ... --plot FILE.png``: each row drawn beside its same-run limit."""

from __future__ import annotations

from kvstore.bench.common import Row
from kvstore.bench.plot import plot_rows


def test_plot_draws_every_row_as_value_over_limit(tmp_path):
    rows = [
        Row("host get 32 MiB", 8.7, "GB/s", "copy into reused buffer", 4.8, target=0.8),
        Row("chained hash", 3.1, "µs", "target", 2.0, better="lower", target=1.0),
        Row("no target", 1.0, "B", "limit", 2.0),
    ]
    out = plot_rows(tmp_path / "rows.png", "a title", rows)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # a taller table makes a taller picture (one bar per row)
    more = plot_rows(tmp_path / "more.png", "t", rows * 4)
    assert _png_height(more.read_bytes()) > _png_height(data)


def _png_height(png: bytes) -> int:
    return int.from_bytes(png[20:24], "big")


def test_plot_flag_is_offered_by_every_suite():
    from kvstore.cli.main import build_parser

    parser = build_parser()
    for suite in ("tiers", "redis", "store"):
        assert parser.parse_args(["bench", suite, "--plot", "x.png"]).plot == "x.png"


def test_rows_with_a_zero_limit_do_not_break_the_plot(tmp_path):
    out = plot_rows(tmp_path / "z.png", "t", [Row("zero", 1.0, "x", "none", 0.0)])
    assert out.read_bytes()[:4] == b"\x89PNG"
