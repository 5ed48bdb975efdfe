"""kvstore as SGLang 0.5.23's HiCache storage, proven with SGLang's own classes.

SGLang lives in an environment of its own, ``.venv-sglang`` (``make sglang``; ``make test``
makes it): its wheel ``--no-deps`` over the torch it pins.  Its engine needs CUDA, so none
runs here; its storage interface, backend factory, key generation, host memory pools and
the HiCache controller's storage methods do.  ``sglang_hicache_probe.py`` runs under that
Python once against a real ``kvstore serve`` (two tenants, an SSD directory), which this
module restarts halfway, and reports each part; the tests here assert on them:

1. our class is a ``HiCacheStorage`` with every abstract method and the v1/v2 API its own,
   and SGLang's ``dynamic`` backend factory builds it from the extra config (bad configs
   are refused by name), also from the documented command line through SGLang's own
   argument parsing (inline JSON and ``@file``);
2. SGLang's page keys are content keys: each is the sha256 of the previous page's digest
   and the page's tokens (recomputed here), so a change in a page changes its key and every
   later one, and they name our objects as they are;
3. for each host layout of SGLang's ``MHATokenToKVPoolHost``, pages round-trip byte for
   byte through ``batch_set``/``batch_get`` and ``batch_set_v1``/``batch_get_v1``, and a
   page of another layout is never found;
4. SGLang's controller methods stop at the first missing page (hit query and transfer);
5. the v2 per-pool API (KV, Mamba, sliding window) answers exactly as SGLang's own
   ``HiCacheFile`` for the same calls, hit policies included;
6. two tenants (and two scopes) with the same keys never see each other's pages;
7. pages survive a restart of the store (its SSD) and a reopened SSD-only backend.

Cost: about 30-60 s on this 2-core host (one SGLang import, about 15 s of it; one store process
started twice); the first run on a host also compiles SGLang's page-hash extension (torch's
cpp_extension, about 30 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import integrity

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
PROBE = Path(__file__).with_name("sglang_hicache_probe.py")
TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
]
OURS = "adapters.sglang_hicache.backend.KVStoreHiCache"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def _check(report: dict) -> dict:
    errors = {
        f"{phase}.{name}": part["traceback"]
        for phase, parts in report.items()
        for name, part in parts.items()
        if isinstance(part, dict) and "error" in part
    }
    assert errors == {}, f"probe parts failed: {errors}"
    return report


@pytest.fixture(scope="module")
def reports(store_process, tmp_path_factory) -> dict:
    assert PYTHON.exists(), f"{PYTHON} is missing: run `make sglang` (make test does)"
    store = store_process(
        "--host-capacity",
        "64MiB",
        "--ssd-dir",
        "{work}/ssd",
        "--ssd-capacity",
        "256MiB",
        tokens=TOKENS,
        name="hicache-store",
    )
    work = tmp_path_factory.mktemp("sglang-hicache")
    keys_file = work / "keys.yaml"
    integrity.write_private(keys_file, integrity.dump(integrity.new_deployment()))
    args = {"target": store.target, "work": str(work), "keys_file": str(keys_file)}
    for tenant in ("a", "b"):
        integrity.write_private(work / f"token-{tenant}", f"tok-{tenant}\n")
        args[f"token_{tenant}"] = str(work / f"token-{tenant}")
    with (
        open(work / "probe.log", "w") as log,
        subprocess.Popen(
            [str(PYTHON), str(PROBE), json.dumps(args)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        ) as proc,
    ):
        assert proc.stdin is not None and proc.stdout is not None
        lines = []
        for line in proc.stdout:  # phase main, until the probe asks for the restart
            lines.append(line)
            if line.strip() == "RESTART":
                store.restart()  # SIGTERM, then the same flags: a new process over the same SSD directory
                proc.stdin.write(json.dumps({"target": store.target}) + "\n")
                proc.stdin.flush()
        code = proc.wait(timeout=300)
    assert code == 0, f"probe failed ({code}):\n{(work / 'probe.log').read_text()[-6000:]}"
    report = json.loads(lines[-1])
    (work / "report.json").write_text(json.dumps(report, indent=1))
    sys.stderr.write(
        f"sglang hicache probe report: {work / 'report.json'} (seconds: "
        f"{report['main']['seconds']}, {report['restart']['seconds']})\n"
    )
    return _check(report)


def test_probe_ran_sglang_0_5_23(reports):
    env = reports["main"]["env"]
    assert env["sglang"] == "0.5.23"
    assert Path(env["sglang_file"]).is_relative_to(ROOT / ".venv-sglang"), env["sglang_file"]


def test_our_class_implements_hicache_storage(reports):
    iface = reports["main"]["interface"]
    assert iface["subclass"] is True
    assert set(iface["abstract"]) == {"get", "batch_get", "set", "batch_set", "exists"}
    assert set(iface["abstract"].values()) == {OURS}
    assert iface["still_abstract"] == []
    assert set(iface["defines"].values()) == {OURS}  # v1, v2 and pool registration: none inherited


def test_sglang_dynamic_factory_builds_ours(reports):
    factory = reports["main"]["factory"]
    assert factory["class"] == OURS
    assert factory["tiers"][1:] == ["remote"]  # our host staging pool, then the store process
    assert "chunk_size" in factory["engine_key"]["message"]
    assert factory["engine_key"]["type"] == "ConfigError"
    assert "needs a tier below host memory" in factory["no_lower_tier"]["message"]


def test_the_documented_command_line_builds_ours(reports):
    """docs/sglang-hicache.md's flags, through SGLang's own argument parsing to its factory."""
    for form in ("inline", "file"):
        assert reports["main"]["cli"][form] == {
            "backend": "dynamic",
            "hierarchical": True,
            "class": OURS,
            "tiers": ["host", "remote"],
        }, form


def test_sglang_keys_are_chained_content_keys(reports):
    keys = reports["main"]["keys"]
    assert keys["hex64"] and keys["repeat_equal"] and len(set(keys["keys"])) == 6
    assert keys["first_page_changed"] == [True] * 6  # the chain: every later key changes
    assert keys["last_page_changed"] == [False] * 5 + [True]  # earlier pages keep their keys
    assert keys["object_names_are_keys"]
    # What they hash: sha256 over the previous page's digest and the page's tokens (uint32 LE)
    digest, page = b"", keys["page"]
    for i, key in enumerate(keys["keys"]):
        tokens = keys["tokens"][i * page : (i + 1) * page]
        digest = hashlib.sha256(digest + struct.pack(f"<{page}I", *tokens)).digest()
        assert key == digest.hex(), i


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_in_each_host_layout(reports, layout):
    row = reports["main"]["layouts"][layout]
    assert row["exists_before"] == 0
    assert row["batch_set"] is True and row["batch_get_equal"] == [True] * 3
    assert row["set_v1"] == [True] * 3 and row["get_v1"] == [True] * 3 and row["get_v1_equal"] == [True] * 3
    assert row["exists_after"] == 6 and row["not_all_zero"]
    if layout != LAYOUTS[0]:
        assert row["other_layout_hits"] == 0  # the previous layout's pages, same keys: not found


def test_controller_stops_at_the_first_missing_page(reports):
    ctl = reports["main"]["controller"]
    assert ctl["exists_each"] == [True, True, True, True, False, True]
    assert ctl["hit_query"] == {"tokens": 4 * 4, "keys_equal": True}
    for path in ("generic", "v1"):
        assert ctl[path] == {"pages": 4, "equal": [True] * 4}, path
    assert ctl["acks"] == [16, 16]  # one batch per transfer, 4 pages of 4 tokens each


def test_v2_pools_answer_as_sglang_hicache_file(reports):
    pools = reports["main"]["pools"]
    ours, peer = pools["ours"], pools["file"]
    assert ours == peer
    assert ours["kv_only"]["kv_hit_pages"] == 6
    assert ours["mamba_trailing"]["restorable"] == [3, 6]  # states at pages 2 and 5
    assert ours["swa_trailing"]["restorable"] == [6]  # the window of 2 is whole only at 6
    assert ours["both_trailing"]["kv_hit_pages"] == 6
    assert ours["swa_all_pages"]["kv_hit_pages"] == 0  # page 0 has no window page
    assert ours["get"] == {"mamba": [True, True], "swa": [True, True]}
    assert ours["mamba_equal"] == [True, True] and ours["swa_equal"] == [True, True]
    assert ours["missing_mamba"] == [False]
    assert "'indexer'" in pools["unknown_pool"]["message"] and "never registered" in pools["unknown_pool"]["message"]


def test_tenants_and_scopes_stay_apart(reports):
    t = reports["main"]["tenants"]
    assert t["a_set"] == [True, True]
    assert t["b_exists"] == 0 and t["other_scope_exists"] == 0 and t["b_get"] == [False, False]
    assert t["b_get_one"] is None and t["a_get_one"] is True  # get(key), one page: only a's
    assert t["other_scope_set_one"] is True and t["other_scope_get_one"] is True
    assert t["b_set"] == [True, True]
    assert t["a_get"] == [True, True] and t["b_get_own"] == [True, True]
    assert t["a_reads_a"] == [True, True] and t["b_reads_b"] == [True, True] and t["a_differs_b"]


@pytest.mark.parametrize("where", ["store", "ssd"])
def test_pages_survive_a_restart(reports, where):
    assert reports["main"]["persist"][where] == {"set": [True, True, True]}
    after = reports["restart"]["persist"][where]
    assert after == {"exists": 3, "get": [True, True, True], "equal": [True, True, True]}
