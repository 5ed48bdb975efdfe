"""kvstore as an L2 of LMCache 0.5.6, proven with LMCache's own config parsing, factory and
adapter interface.

LMCache lives in a site directory of its own, ``.venv-lmcache`` (``make lmcache``; ``make test``
makes it), put on PYTHONPATH of a child process only: ``lmcache_l2_probe.py`` runs there
against a real ``kvstore serve`` (two tenants, an SSD directory, a real redis-server below
it), which this module restarts halfway, and reports each part; the tests assert on them:

1. LMCache's ``--l2-adapter`` parsing and its ``plugin`` factory build our adapter from the
   documented JSON (config class found by LMCache's convention); bad parameters are refused
   with an error naming the key;
2. through LMCache's submit / event fd / query cycle, objects stored are found by
   lookup-and-lock (absent keys are not) and load back byte for byte; LMCache's usage
   accounting counts their bytes, and a delete removes one (lookup and usage both show it);
3. two tenants (tokens) with the same LMCache keys keep their own bytes; another scope,
   another model and another cache salt find nothing;
4. the objects survive a restart of the store (its SSD; Redis below holds them too).

Cost: about 5-15 s on this 2-core host (one LMCache import in the child, one store process
started twice, one redis-server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis as redis_py

from kvstore import integrity
from kvstore.testing.redis_proc import RedisServer

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_SITE = ROOT / ".venv-lmcache"
PROBE = Path(__file__).with_name("lmcache_l2_probe.py")
TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
]
OBJECT_BYTES = 2 * 4 * 16 * 32 * 4  # the probe's SHAPE in float32


def _check(phase: dict) -> dict:
    assert "error" not in phase, f"probe failed: {phase['error']['traceback']}"
    return phase


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reports(store_process, redis, tmp_path_factory) -> dict:
    assert (LMCACHE_SITE / ".installed-stamp").exists(), f"{LMCACHE_SITE} is missing: run `make lmcache`"
    store = store_process(
        "--host-capacity", "64MiB", "--ssd-dir", "{work}/ssd", "--ssd-capacity", "256MiB",
        "--redis", redis.url, tokens=TOKENS, name="lmcache-l2-store",
    )  # fmt: skip
    work = tmp_path_factory.mktemp("lmcache-l2")
    args = {"target": store.target}
    for tenant in ("a", "b"):
        integrity.write_private(work / f"token-{tenant}", f"tok-{tenant}\n")
        args[f"token_{tenant}"] = str(work / f"token-{tenant}")
    env = {**os.environ, "PYTHONPATH": f"{LMCACHE_SITE}:{ROOT}", "LMCACHE_TRACK_USAGE": "false"}
    with (
        open(work / "probe.log", "w") as log,
        subprocess.Popen(
            [sys.executable, str(PROBE), json.dumps(args)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        ) as proc,  # fmt: skip
    ):
        assert proc.stdin is not None and proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "RESTART":
                redis_keys = redis_py.Redis.from_url(redis.url).dbsize()
                store.restart()  # SIGTERM, then the same flags: a new process over the same SSD directory
                proc.stdin.write(json.dumps({"target": store.target}) + "\n")
                proc.stdin.flush()
        code = proc.wait(timeout=300)
    assert code == 0, f"probe failed ({code}):\n{(work / 'probe.log').read_text()[-6000:]}"
    report = json.loads(lines[-1])
    report["redis_keys"] = redis_keys
    sys.stderr.write(f"lmcache l2 probe: {report['main']['seconds']} s + {report['restart']['seconds']} s\n")
    return report


def test_lmcache_plugin_loader_builds_ours(reports):
    loader = _check(reports["main"])["loader"]
    assert loader["class"] == "adapters.lmcache_l2.adapter.KVStoreL2Adapter"
    assert loader["is_l2_adapter"] is True and loader["config_class"] == "KVStoreL2AdapterConfig"
    assert loader["fds_distinct"] == 6  # two adapters, three distinct event fds each
    version, where = loader["lmcache"]
    assert version == "0.5.6" and Path(where).is_relative_to(LMCACHE_SITE), where


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("no_tier", "store_target"),
        ("unknown_key", "'stor_token'"),
        ("engine_key", "'chunk_size'"),
        ("host_pool", "'host_capacity'"),
        ("bad_scope", "scope"),
        ("bad_capacity", "max_capacity_gb"),
        ("bad_target", "no-port"),
    ],
)
def test_bad_parameters_are_refused_by_name(reports, case, names):
    message = _check(reports["main"])["bad_configs"][case]
    assert message != "accepted" and names in message, message
    assert "ConfigError" in message or "ValueError" in message, message


def test_objects_round_trip_through_lmcache_cycle(reports):
    main = _check(reports["main"])
    assert main["store"] == [True, 6 * OBJECT_BYTES]
    assert main["usage_after_store"] == 6 * OBJECT_BYTES
    assert main["lookup"] == [1] * 6 + [0] * 2
    assert main["load"] == {"bits": [1] * 6, "equal": True}
    assert main["status"]["counters"]["remote:write:stored"] >= 6


def test_delete_removes_and_uncounts(reports):
    main = _check(reports["main"])
    assert main["after_delete"] == {"lookup": [0] + [1] * 5, "usage": 5 * OBJECT_BYTES}


def test_tenants_scopes_models_salts_stay_apart(reports):
    main = _check(reports["main"])
    assert main["tenant_b_before"] == [0] * 6
    assert main["tenant_b_store"] == [True, 6 * OBJECT_BYTES]
    assert main["tenants"] == {"a_equal": True, "b_equal": True, "bits": [1] * 12}
    assert main["apart"] == {"other_scope": [0] * 6, "other_model": [0] * 6, "other_salt": [0] * 6}


def test_objects_survive_a_store_restart(reports):
    restart = _check(reports["restart"])
    assert restart["lookup"] == [0] + [1] * 5  # the deleted one stays deleted
    assert restart["load"] == {"bits": [1] * 5, "equal": True}
    assert restart["load_b"] == {"bits": [1] * 6, "equal": True}
    assert reports["redis_keys"] >= 11  # the store wrote them down to Redis too (both tenants)
