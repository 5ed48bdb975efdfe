"""The Grafana dashboard (``deploy/grafana/kvstore.json``) against a real Prometheus: every
panel's query is valid PromQL there, and the queries of what moved return series.

A real ``kvstore serve`` (its ``/metrics``) and the connector's collectors (a connector pair
driven through a save and a hit, served from this process as a vLLM engine process serves
them) are scraped every second by a real ``prometheus`` (Debian's package; ``make test``
installs it).  Traffic runs while Prometheus scrapes, so rates have several samples.  Each
panel query, with Grafana's ``$__rate_interval`` as ``30s``, goes to the query API: every
one must succeed, and the panels of counters that moved must return data.  Cost: about 25 s.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY, start_http_server

from kvstore.testing.redis_proc import free_port
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.chain import keys_of, make_object, namespace
from tests.kits.halves import Engine, finish, prompt, run_request
from tests.kits.store_calls import StoreClient

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"
# Panels whose metrics this traffic moves: each must return at least one series.
MOVED = (
    "kvstore_hit_tokens_total",
    "kvstore_looked_up_tokens_total",
    "kvstore_requests_total",
    "kvstore_load_decisions_total",
    "kvstore_bytes_total",
    "kvstore_stage_seconds_bucket",
    "kvstore_server_lookup_keys_total",
    "kvstore_server_bytes_total",
    "kvstore_server_stage_seconds_bucket",
    "kvstore_server_leases_held",
)


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


@pytest.fixture
def prometheus_server(tmp_path):
    def start(scrape: list[str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": f"job{i}", "static_configs": [{"targets": [t]}]} for i, t in enumerate(scrape)
                    ],
                }
            )
        )
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=open(tmp_path / "prometheus.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return f"http://127.0.0.1:{port}"

    procs: list[subprocess.Popen] = []
    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def traffic(engine: Engine, store: StoreClient, round_: int) -> None:
    """A save and a hit through the connector pair; puts, lookups and gets on the store."""
    tokens = prompt(600, seed=round_)
    run_request(engine, f"a{round_}", tokens, [0, 1, 2, 3, 4])
    engine.settle()
    finish(engine, f"a{round_}")
    run_request(engine, f"b{round_}", tokens, [10, 11, 12, 13, 14], seed=9)
    finish(engine, f"b{round_}")
    ns = namespace("dashboard")
    for key in keys_of(ns, 3, seed=round_):
        store.put_stream(key, memoryview(make_object(key, 64 * 1024)))
        store.lookup([key])
        out = np.empty(64 * 1024, np.uint8)
        assert store.get_stream(key, out) == 64 * 1024


def test_every_panel_query_runs_on_a_real_prometheus(tmp_path, prometheus_server):
    exporter_port = free_port()
    start_http_server(exporter_port, addr="127.0.0.1", registry=REGISTRY)  # the connector's, as vLLM serves it
    engine = Engine(tmp_path / "engine")
    with StoreProcess(tmp_path / "store", "--metrics-port", "0") as proc, StoreClient(proc.target) as store:
        store_metrics = urllib.parse.urlparse(proc.metrics_url).netloc
        base = prometheus_server([f"127.0.0.1:{exporter_port}", store_metrics])
        deadline = time.monotonic() + 60
        while True:  # both targets scraped (a deadline only turns a hang into a failure)
            try:
                if targets_up(base) == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        for round_ in range(6):  # traffic across several scrapes, so every rate has two samples or more
            traffic(engine, store, round_)
            time.sleep(1.0)  # one scrape interval between rounds
        # Queried while both targets still run: once a target goes, Prometheus marks its
        # series stale and a gauge's instant query answers nothing.
        panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
        empty, moved_seen = [], set()
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "30s")
                answer = query(base, expr)
                assert answer["status"] == "success", (panel["title"], expr, answer)
                if answer["data"]["result"]:
                    moved_seen |= {m for m in MOVED if m in expr}
                else:
                    empty.append(panel["title"])
    engine.close()
    print(f"{len(panels)} panels; queries with no series yet (nothing of theirs moved): {sorted(set(empty))}")
    assert moved_seen == set(MOVED)
    assert query(base, "kvstore_hit_token_total_not_a_metric")["data"]["result"] == []  # what an empty answer is
    assert query(base, "sum(rate(kvstore_requests_total[30s])")["status"] == "error"  # what a bad query is
