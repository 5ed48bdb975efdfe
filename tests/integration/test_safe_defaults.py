"""Unsafe defaults of the store process, each refused or fixed (issue 12, attack 5), against a
real ``kvstore serve``: a listen address beyond loopback needs TLS and tokens (or a loud
``--insecure``); ``Stats`` shows only the caller's tenant without ``admin``; SSD files are
0600 in 0700 directories and the rebuild follows no symlink; a stale pool name is skipped
with a clear message; tokens never reach logs or the process list; the connector presents
a client certificate."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import grpc
import numpy as np

from connector.config import ConnectorConfig
from connector.lower import open_store
from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing.serve_proc import ROOT, StoreProcess
from tests.kits.hostile import keys, start_store, write_tokens
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, rpc_code, wait_until
from tiers.base import PutResult
from tiers.host import HostTier
from tiers.host_shm import SHM_DIR


def process_list() -> list[str]:
    """Every running process's command line, as ``ps`` shows it to any user."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:  # gone meanwhile
                pass
    return out


def serve(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--host-capacity", "16MiB", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_beyond_loopback_needs_tls_and_tokens_or_a_loud_insecure(tmp_path):
    tokens = write_tokens(tmp_path / "tokens.yaml")
    for extra in ([], ["--auth-tokens", str(tokens)]):
        run = serve("--listen", "0.0.0.0:0", *extra)
        assert run.returncode == 2 and "is not loopback: serving it needs TLS" in run.stderr
    proc = StoreProcess(
        tmp_path, "--host-capacity", "16MiB", "--listen", "0.0.0.0:0", "--insecure", "--metrics-port", "0"
    ).start()
    try:
        log = proc.log_text()
        assert "WARNING: --insecure: 0.0.0.0:0 is served beyond loopback without TLS and without tokens" in log
        assert "WARNING: /metrics on 0.0.0.0 is reachable beyond this host" in log
    finally:
        assert proc.terminate(30) == 0


def test_stats_shows_only_the_callers_tenant_unless_admin(tmp_path):
    proc = start_store(tmp_path)
    try:
        objects = Objects(64 * KiB)
        with StoreClient(proc.target, "tok-b") as b:
            key = keys(1, seed=30)[0]
            assert b.put_stream(key, objects.make(key, 64 * KiB)) == pb.PUT_OUTCOME_STORED
        with StoreClient(proc.target, "tok-a") as a, StoreClient(proc.target, "tok-ops") as ops:
            doc, counters = a.stats()
            text = json.dumps(doc)
            assert doc["tenant"] == "a" and '"b"' not in text and "tenants" not in doc
            assert set(doc["tiers"]) == {"host", "ssd"} and doc["tiers"]["host"]["objects"] == 0
            assert counters["quota.host_bytes"] == 16 * MiB and "store.lookups" not in counters
            full = ops.stats()[0]
            assert set(full["tenants"]) == {"a", "b", "c", "ops"}
            assert full["tenants"]["b"]["tiers"]["host"]["objects"] == 1 and full["server"]["pid"] == proc.pid
    finally:
        assert proc.terminate(30) == 0


def test_ssd_files_are_private_and_the_rebuild_follows_no_symlink(tmp_path):
    proc = start_store(tmp_path)
    ssd, precious = tmp_path / "ssd", tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.kv").write_text("keep me")
    try:
        with StoreClient(proc.target, "tok-a") as a:
            for key in keys(3, seed=31):
                assert a.put_stream(key, Objects(64 * KiB).make(key, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: len(list(ssd.glob("??/*.kv"))) == 3)
        files = list(ssd.glob("??/*.kv"))
        assert {stat.S_IMODE(os.stat(f).st_mode) for f in files} == {0o600}
        assert {stat.S_IMODE(os.stat(p).st_mode) for p in (ssd, ssd / "tmp", *(f.parent for f in files))} == {0o700}
        assert proc.terminate(30) == 0
        os.rmdir(ssd / "tmp")
        os.symlink(precious, ssd / "tmp")  # the trap for the rebuild
        proc.start()
        assert (precious / "keep.kv").read_text() == "keep me" and not (ssd / "tmp").is_symlink()
        with StoreClient(proc.target, "tok-a") as a:
            assert a.lookup(keys(3, seed=31)).hits == 3
    finally:
        assert proc.terminate(30) == 0


def test_a_stale_pool_name_is_skipped_with_a_clear_message(caplog):
    planted = SHM_DIR / "kvstore-pool-999999999-feedfacefeedface"  # a dead owner's name...
    planted.mkdir()  # ... that cannot be unlinked
    try:
        with caplog.at_level(logging.WARNING, logger="tiers.host"):
            tier = HostTier(64 * KiB, shared=True, pin=False)
        tier.close()
        assert f"skipping stale {planted}: cannot remove it" in caplog.text
    finally:
        planted.rmdir()


def test_tokens_never_reach_logs_or_the_process_list(tmp_path):
    proc = start_store(tmp_path)
    try:
        with StoreClient(proc.target, "tok-a") as a, StoreClient(proc.target, "tok-zzz-unknown") as stranger:
            a.stats()
            assert rpc_code(stranger.stats) is grpc.StatusCode.UNAUTHENTICATED
        (tmp_path / "ops.token").write_text("tok-ops\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cli = [sys.executable, "-m", "kvstore", "stats", "--target", proc.target, "--json"]
        by_file = subprocess.run(
            [*cli, "--token-file", str(tmp_path / "ops.token")],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        by_env = subprocess.run(
            cli, capture_output=True, text=True, env={**env, "KVSTORE_TOKEN": "tok-a"}, cwd=ROOT, timeout=60
        )
        on_line = subprocess.run(
            [*cli, "--token", "tok-a"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
        )
        assert by_file.returncode == 0 and "tenants" in json.loads(by_file.stdout)
        assert by_env.returncode == 0 and json.loads(by_env.stdout)["tenant"] == "a"
        assert on_line.returncode == 0 and "--token puts the token in the process list" in on_line.stderr
        # The process list itself: no running process's command line carries a token (the
        # store was given a file; clients here use files or the environment).  The control,
        # a process started with a token on its command line, shows the scan would see one.
        control = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--token", "tok-control"])
        try:
            assert wait_until(lambda: "tok-control" in " ".join(process_list()), timeout=10)
        finally:
            control.kill()
            control.wait()
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"--auth-tokens" in f.read()  # the store is in the list, with its tokens file's name
        assert not [line for line in process_list() if "tok-" in line]
    finally:
        assert proc.terminate(30) == 0
    log = proc.log_text()
    assert "tok-" not in log and "listening on" in log


async def test_the_connector_presents_its_client_certificate(tmp_path):
    from kvstore.testing.tls_files import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    proc = StoreProcess(
        tmp_path,
        "--host-capacity",
        "32MiB",
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        "--tls-client-ca",
        str(tls.ca_cert),
    ).start()
    try:
        cfg = ConnectorConfig.from_extra_config(
            {
                "host_capacity": "16MiB",
                "store_target": proc.target,
                "store_tls_ca": str(tls.ca_cert),
                "store_tls_cert": str(tls.client_cert),
                "store_tls_key": str(tls.client_key),
            },
            env={},
        )
        key = keys(1, seed=32)[0]
        obj = np.frombuffer(Objects(256 * KiB).make(key, 256 * KiB), np.uint8).copy()
        store = await open_store(cfg, lambda *a: None, lambda *a: None)
        try:
            remote = store.lower[0]
            assert await remote.put(key, memoryview(obj)) is PutResult.STORED
            out = np.empty(len(obj), np.uint8)
            assert await remote.read_into(key, memoryview(out)) == len(obj) and np.array_equal(out, obj)
        finally:
            await store.aclose()
    finally:
        assert proc.terminate(30) == 0


def test_kvstore_tokens_writes_private_digests_that_a_real_store_accepts(tmp_path):
    """``kvstore tokens`` as an operator runs it: the server's file holds digests only, each
    tenant's token file is private, a rerun keeps the tokens (a restart must not lock clients
    out) unless ``--force``, a bad spec is refused with a clear message, and a real store
    started on the file authenticates each tenant's token with its permissions."""

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvstore", "tokens", "--dir", str(tmp_path / "t"), *a]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)

    made = run("--tenant", "engine=read,write,shm", "--tenant", "ops=read,admin")
    assert made.returncode == 0, made.stderr
    table, engine, ops = tmp_path / "t" / "tokens.yaml", tmp_path / "t" / "engine.token", tmp_path / "t" / "ops.token"
    assert made.stdout.split() == [str(table), str(engine), str(ops)]
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in (table, engine, ops)} == {0o600}
    secret = {p: p.read_text().strip() for p in (engine, ops)}
    assert all(len(t) == 64 and t not in table.read_text() for t in secret.values())

    kept = run("--tenant", "engine=read")
    assert kept.returncode == 0 and "kept" in kept.stdout and engine.read_text().strip() == secret[engine]
    bad = run("--tenant", "engine=read,fly", "--force")
    assert bad.returncode != 0 and "expected NAME=PERM" in bad.stderr and engine.read_text().strip() == secret[engine]

    proc = StoreProcess(tmp_path / "store", "--host-capacity", "16MiB", "--auth-tokens", str(table)).start()
    try:
        objects, key = Objects(64 * KiB), keys(1, seed=41)[0]
        with (
            StoreClient(proc.target, secret[engine]) as e,
            StoreClient(proc.target, secret[ops]) as o,
            StoreClient(proc.target, "not-a-token") as nobody,
        ):
            assert e.put_stream(key, objects.make(key, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            assert o.stats()[0]["tenants"]["engine"]["tiers"]["host"]["objects"] == 1  # admin sees all
            assert rpc_code(lambda: o.put_stream(key, objects.make(key, 64 * KiB))) == grpc.StatusCode.PERMISSION_DENIED
            assert rpc_code(lambda: nobody.stats()) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert proc.terminate(30) == 0

    forced = run("--tenant", "engine=read", "--force")
    assert forced.returncode == 0 and engine.read_text().strip() != secret[engine]
