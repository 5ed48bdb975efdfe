"""The Grafana dashboard (``deploy/grafana/kvstore.json``) shows only what we export: every
metric of every panel's query is declared in ``/metrics``, the connector's (its Prometheus
registry, as a vLLM engine process exposes it) or a real ``kvstore serve``'s."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest

from kvstore.metrics import prometheus
from kvstore.testing.serve_proc import StoreProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
METRIC = re.compile(r"\b(kvstore_[a-z0-9_]+)\b")


def exported(text: str) -> set[str]:
    """Sample names a scrape of ``text`` may have (declared families and their suffixes)."""
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":  # declared with or without its _total, by client version
            names.add(family if family.endswith("_total") else family + "_total")
        else:
            names |= {family + s for s in SUFFIXES.get(kind, ("",))}
    return names | {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def queried(dashboard: dict) -> dict[str, set[str]]:
    """Panel title -> the metric names its queries use."""
    return {
        p["title"]: {m for t in p["targets"] for m in METRIC.findall(t["expr"])}
        for p in dashboard["panels"]
        if p["type"] != "row"
    }


def test_every_panel_metric_is_exported(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    prometheus()  # the connector's collectors, as a scheduler half creates them
    connector = exported(generate_latest(REGISTRY).decode())
    with StoreProcess(tmp_path, "--metrics-port", "0", "--kv-events", f"ipc://{tmp_path}/ev") as store:
        server = exported(urllib.request.urlopen(store.metrics_url, timeout=10).read().decode())
    panels = queried(dashboard)
    assert len(panels) >= 20 and all(panels.values())
    missing = {title: names - connector - server for title, names in panels.items() if names - connector - server}
    assert not missing, missing
    used = set().union(*panels.values())
    for wanted in (
        "kvstore_hit_tokens_total",
        "kvstore_looked_up_tokens_total",
        "kvstore_bytes_total",
        "kvstore_stage_seconds_bucket",
        "kvstore_failures_total",
        "kvstore_breaker_open",
        "kvstore_server_breaker_open",
        "kvstore_server_leases_held",
        "kvstore_server_tenant_quota",
        "kvstore_server_lookup_keys_total",
        "kvstore_server_stage_seconds_bucket",
    ):
        assert wanted in used, wanted


def test_a_metric_we_do_not_export_is_caught():
    prometheus()
    connector = exported(generate_latest(REGISTRY).decode())
    assert "kvstore_hit_tokens_total" in connector and "kvstore_stage_seconds_bucket" in connector
    assert "kvstore_hit_token_total" not in connector and "kvstore_breaker_open_total" not in connector
