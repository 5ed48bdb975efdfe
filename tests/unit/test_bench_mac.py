"""``kvstore bench mac``'s own arithmetic (the engines it runs are the main job's, tested by
``tests/integration/test_cli_main_job.py``; the bench itself is run for the notes): the
order of the settings rotates every round, and each row is the median over the rounds of
one setting beside MACs off, the limit.  Pure functions: well under a second."""

import math

from harness.bench_mac import ENGINES, SETTINGS, TARGET, Pass, interleaved, rows


def test_the_order_rotates_so_no_setting_always_runs_first():
    assert list(SETTINGS) == ["mac", "off", "encrypted"]
    assert interleaved(2) == ["mac", "off", "encrypted", "off", "encrypted", "mac"]
    order = interleaved(5)
    assert all(order.count(s) == 5 for s in SETTINGS) and len(order) == 15
    assert {order[3 * r] for r in range(3)} == set(SETTINGS)  # each setting leads a round


def test_rows_are_medians_of_each_setting_beside_the_limit():
    hit_p50 = {
        "mac": [(0.010, 0.050), (0.030, 0.052), (0.012, 0.051)],  # 0.030: an outlier the median ignores
        "off": [(0.011, 0.040), (0.009, 0.046), (0.010, 0.044)],
        "encrypted": [(0.011, 0.060), (0.010, 0.066), (0.013, 0.062)],
    }
    passes = [Pass(s, p, True) for s, ps in hit_p50.items() for p in ps]
    host_mac, host_enc, ssd_mac, ssd_enc = rows(passes)
    assert [host_mac.name, ssd_enc.name] == [f"{ENGINES[0]}, MACs", f"{ENGINES[1]}, encrypted"]
    assert math.isclose(host_mac.value, 12.0) and math.isclose(host_mac.limit_value, 10.0)
    assert math.isclose(ssd_mac.value, 51.0) and math.isclose(ssd_mac.limit_value, 44.0)
    assert math.isclose(host_enc.value, 11.0) and math.isclose(ssd_enc.value, 62.0)
    assert host_mac.better == "lower" and host_mac.target == TARGET == 1.05 and ssd_enc.target is None
    assert host_mac.meets_target is False and math.isclose(ssd_mac.ratio, 51 / 44)
