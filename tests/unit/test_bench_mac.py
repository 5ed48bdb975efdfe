"""``kvstore bench mac``'s own arithmetic (the engines it runs are the main job's, tested by
``tests/integration/test_cli_main_job.py``; the bench itself is run for the notes):
the passes interleave on/off and off/on, and each row is the median over the rounds of each
setting, MACs off as the limit.  Pure functions: well under a second."""

import math

from harness.bench_mac import ENGINES, TARGET, Pass, interleaved, rows


def test_passes_interleave_so_neither_setting_always_runs_first():
    assert interleaved(1) == [True, False]
    assert interleaved(4) == [True, False, False, True, True, False, False, True]
    assert sum(interleaved(5)) == 5 and len(interleaved(5)) == 10


def test_rows_are_medians_of_each_setting_beside_the_limit():
    passes = [
        Pass(True, (0.010, 0.050), True),
        Pass(False, (0.011, 0.040), True),
        Pass(False, (0.009, 0.046), True),
        Pass(True, (0.030, 0.052), True),  # an outlier: the median ignores it
        Pass(True, (0.012, 0.051), True),
        Pass(False, (0.010, 0.044), True),
    ]
    host, ssd = rows(passes)
    assert [host.name, ssd.name] == list(ENGINES)
    assert math.isclose(host.value, 12.0) and math.isclose(host.limit_value, 10.0)
    assert math.isclose(ssd.value, 51.0) and math.isclose(ssd.limit_value, 44.0)
    assert host.better == "lower" and host.target == TARGET == 1.05
    assert host.meets_target is False and math.isclose(ssd.ratio, 51 / 44)
