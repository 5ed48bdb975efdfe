"""Exposure of the store on one host (issue 23, part 2; docs/exposure.md), against a real
``kvstore serve`` and a real second uid (65534, never root):

* without a tokens file the store still requires its default token, a 0600 file of the
  store's user (``kvstore.localtoken``): same-uid clients (the test client, ``StoreClient``,
  ``kvstore stats``) find it with no token given; uid 65534 can neither read it nor read,
  delete or ``Stats`` anything; a restart reuses it;
* a tenant with a ``uid`` has its KV event and replay sockets in a directory of that uid:
  another tenant's uid cannot connect to them, the owner replays its stream;
* ``--metrics-tenant-labels hash|off`` keeps tenant names out of ``/metrics``;
* ``/metrics`` beyond loopback answers only a scrape with an ``admin`` token.

Cost: about 10 s (nine short store processes, a few subprocesses as other uids).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.store_client import StoreClient as AsyncClient
from kvstore.errors import ConfigError
from kvstore.localtoken import default_token_path, ensure_token
from kvstore.testing.serve_proc import ROOT, StoreProcess
from tests.kits.hostile import keys
from tests.kits.second_uid import NOBODY, json_as
from tests.kits.store_calls import KiB, Objects, StoreClient

TENANT_A_UID = 61001


def as_uid(uid: int, code: str, env: dict | None = None) -> dict:
    """Run ``code`` (which prints one JSON line) as ``uid`` (group ``uid``, no other groups)."""
    return json_as(uid, uid, code, env=env)


ATTACK = """
import json, grpc
from kvstore._proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
from kvstore.localtoken import default_token_path, local_token
out = {}
try:
    open(default_token_path()).read()
    out["read_token"] = "read"
except OSError as err:
    out["read_token"] = type(err).__name__
out["local_token"] = local_token()
stub = pb_grpc.KVStoreStub(grpc.insecure_channel(TARGET))
req = pb.GetRequest(namespace=NS, chunk_hash=CH, tag="r0")
for name, call in (("stats", lambda md: stub.Stats(pb.StatsRequest(), metadata=md, timeout=20)),
                   ("lookup", lambda md: stub.Lookup(pb.LookupRequest(namespace=NS, chunk_hashes=[CH], tag="r0"),
                                                     metadata=md, timeout=20)),
                   ("get", lambda md: list(stub.GetStream(req, metadata=md, timeout=20))),
                   ("delete", lambda md: stub.Delete(pb.DeleteRequest(namespace=NS, chunk_hash=CH, tag="r0"),
                                                     metadata=md, timeout=20))):
    for label, md in (("none", None), ("guess", (("authorization", "Bearer guess"),))):
        try:
            call(md)
            out[f"{name}/{label}"] = "OK"
        except grpc.RpcError as err:
            out[f"{name}/{label}"] = err.code().name
print(json.dumps(out))
"""


def test_the_default_token_lets_the_stores_user_in_and_keeps_another_uid_out(tmp_path):
    path = default_token_path()
    proc = StoreProcess(tmp_path, "--host-capacity", "16MiB").start()
    try:
        token = path.read_text().strip()
        assert len(token) == 64
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700

        key = keys(1, seed=90)[0]
        objects = Objects(64 * KiB)
        with StoreClient(proc.target) as same_uid:  # no token given: found in the default file
            assert same_uid.put_stream(key, objects.make(key, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            assert same_uid.lookup([key]).hits == 1

        code = f"TARGET = {proc.target!r}\nNS = {bytes(key.namespace)!r}\nCH = {bytes(key.chunk_hash)!r}\n"
        seen = as_uid(NOBODY, code + ATTACK)
        assert seen["read_token"] == "PermissionError" and seen["local_token"] is None
        assert {k: v for k, v in seen.items() if "/" in k} == {
            f"{call}/{how}": "UNAUTHENTICATED"
            for call in ("stats", "lookup", "get", "delete")
            for how in ("none", "guess")
        }

        with StoreClient(proc.target) as same_uid:  # the attack deleted nothing
            assert same_uid.lookup([key]).hits == 1
            assert same_uid.stats()[0]["server"]["pid"] == proc.pid  # tenant default has admin

        stats = subprocess.run(
            [sys.executable, "-m", "kvstore", "stats", "--target", proc.target, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "KVSTORE_TOKEN"} | {"PYTHONPATH": str(ROOT)},
        )
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["server"]["pid"] == proc.pid

        assert f"auth: the default token in {path}" in proc.log_text()
        proc.restart()  # a later server reuses the token
        assert path.read_text().strip() == token
        with StoreClient(proc.target) as same_uid:
            assert same_uid.lookup([key]).hits == 0 and same_uid.tenant == "default"
    finally:
        assert proc.terminate(30) == 0
    assert token not in proc.log_text()


async def test_the_engines_client_finds_the_default_token(tmp_path):
    proc = StoreProcess(tmp_path, "--host-capacity", "16MiB").start()
    try:
        client = await AsyncClient.connect(proc.target)
        try:
            assert client.info.tenant == "default"
        finally:
            await client.close()
        with StoreClient(proc.target, "not-the-token") as wrong:
            with pytest.raises(grpc.RpcError) as err:
                wrong.stats()
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert proc.terminate(30) == 0


def test_a_default_token_of_another_owner_or_a_symlink_is_refused(tmp_path):
    theirs = tmp_path / "theirs" / "token"
    theirs.parent.mkdir(mode=0o700)
    theirs.write_text("f" * 64 + "\n")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        ensure_token(theirs)
    link = tmp_path / "link" / "token"
    link.parent.mkdir(mode=0o700)
    os.symlink(theirs, link)
    with pytest.raises(ConfigError, match="symlink"):
        ensure_token(link)
    loose = tmp_path / "loose" / "token"
    loose.parent.mkdir(mode=0o755)
    loose.write_text("e" * 64 + "\n")
    os.chmod(loose, 0o644)
    assert ensure_token(loose) == "e" * 64  # group/other bits are taken away
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o600 and stat.S_IMODE(os.stat(loose.parent).st_mode) == 0o700
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--host-capacity",
            "16MiB",
            "--default-token-file",
            str(theirs),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 2 and "belongs to uid 65534" in run.stderr and "f" * 64 not in run.stderr


@pytest.fixture
def open_dir():
    """A directory every uid may traverse (pytest's own are 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-exposure-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


PROBE = """
import json, socket, zmq
out = {}
for name, path in PATHS.items():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        out[name] = "connected"
    except OSError as err:
        out[name] = type(err).__name__
    finally:
        s.close()
if REPLAY:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect("ipc://" + REPLAY)
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = []
    while d.poll(10000):
        f = d.recv_multipart()
        frames.append(f)
        if f[1] == b"":
            break
    out["replay"] = [f[1].decode() for f in frames]
print(json.dumps(out))
"""


def test_a_tenants_event_sockets_belong_to_its_uid_alone(open_dir):
    tokens = open_dir / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write"]},
                    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write"]},
                ],
                "tenants": {"a": {"uid": TENANT_A_UID}, "b": {"uid": NOBODY, "gid": NOBODY}},
            }
        )
    )
    events = open_dir / "events"
    proc = StoreProcess(
        open_dir / "work",
        "--host-capacity",
        "16MiB",
        "--auth-tokens",
        str(tokens),
        "--kv-events",
        f"ipc://{events}/{{tenant}}/pub",
        "--kv-events-replay",
        f"ipc://{events}/{{tenant}}/replay",
        "--kv-events-topic",
        "kv@{tenant}",
    ).start()
    try:
        for tenant, uid, dmode, smode in (("a", TENANT_A_UID, 0o700, 0o600), ("b", NOBODY, 0o710, 0o660)):
            for p, mode in (
                (events / tenant, dmode),
                (events / tenant / "pub", smode),
                (events / tenant / "replay", smode),
            ):
                st = os.lstat(p)
                assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, mode), p
        paths = {f"{t}/{s}": str(events / t / s) for t in ("a", "b") for s in ("pub", "replay")}
        b_sees = as_uid(NOBODY, f"PATHS = {paths!r}\nREPLAY = {str(events / 'b' / 'replay')!r}\n" + PROBE)
        assert b_sees == {
            "a/pub": "PermissionError",
            "a/replay": "PermissionError",
            "b/pub": "connected",
            "b/replay": "connected",
            "replay": ["kv@b", ""],
        }
        a_sees = as_uid(TENANT_A_UID, f"PATHS = {paths!r}\nREPLAY = {str(events / 'a' / 'replay')!r}\n" + PROBE)
        assert a_sees == {
            "a/pub": "connected",
            "a/replay": "connected",
            "b/pub": "PermissionError",
            "b/replay": "PermissionError",
            "replay": ["kv@a", ""],
        }
        proc.restart()  # the directories, now the tenants', are reused
        assert os.lstat(events / "a").st_uid == TENANT_A_UID
        assert as_uid(NOBODY, f"PATHS = {paths!r}\nREPLAY = None\n" + PROBE)["a/replay"] == "PermissionError"
    finally:
        assert proc.terminate(30) == 0


def test_a_tenant_uid_needs_a_per_tenant_ipc_directory(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [{"token": "tok-a", "tenant": "a", "permissions": ["read"]}],
                "tenants": {"a": {"uid": TENANT_A_UID}},
            }
        )
    )
    for endpoint in (f"ipc://{tmp_path}/{{tenant}}.events", "tcp://127.0.0.1:0"):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--host-capacity",
                "16MiB",
                "--auth-tokens",
                str(tokens),
                "--kv-events",
                endpoint,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert run.returncode == 2 and "with {tenant} in a directory" in run.stderr, run.stderr


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as reply:
        return reply.read().decode()


@pytest.mark.parametrize("mode", ["name", "hash", "off"])
def test_metrics_tenant_labels(tmp_path, mode):
    from kvstore.server.metrics import tenant_label

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "acme-secret-team", "permissions": ["read", "write"]},
                    {"token": "tok-b", "tenant": "bravo-secret-team", "permissions": ["read", "write"]},
                ]
            }
        )
    )
    proc = StoreProcess(
        tmp_path,
        "--host-capacity",
        "16MiB",
        "--auth-tokens",
        str(tokens),
        "--metrics-port",
        "0",
        "--metrics-tenant-labels",
        mode,
    ).start()
    try:
        with StoreClient(proc.target, "tok-a") as a:  # something held, so tenant series exist
            a.stats()
        text = scrape(proc.metrics_url)
        quota_lines = [line for line in text.splitlines() if line.startswith("kvstore_server_tenant_quota{")]
        assert ("secret-team" in text) is (mode == "name")
        if mode == "off":
            assert quota_lines == []
        else:
            want = {tenant_label(t, mode) for t in ("acme-secret-team", "bravo-secret-team")}
            assert {line.split('tenant="')[1].split('"')[0] for line in quota_lines} == want
            if mode == "hash":
                assert all(len(label) == 13 and label.startswith("t") for label in want)
    finally:
        assert proc.terminate(30) == 0


def scrape_code(url: str, token: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=20) as reply:
            return reply.status if b"kvstore_server_tenant_quota" in reply.read() else -1
    except urllib.error.HTTPError as err:
        return err.code


def test_metrics_beyond_loopback_answer_only_an_admin_token(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write"]},
                    {"token": "tok-ops", "tenant": "ops", "permissions": ["read", "admin"]},
                ]
            }
        )
    )
    proc = StoreProcess(
        tmp_path,
        "--host-capacity",
        "16MiB",
        "--auth-tokens",
        str(tokens),
        "--metrics-port",
        "0",
        "--metrics-host",
        "0.0.0.0",
    ).start()
    try:
        assert "WARNING: /metrics" not in proc.log_text() and proc.metrics_url.startswith("http://0.0.0.0:")
        assert {
            who: scrape_code(proc.metrics_url, token)
            for who, token in (("nobody", None), ("stranger", "guess"), ("a", "tok-a"), ("ops", "tok-ops"))
        } == {"nobody": 401, "stranger": 401, "a": 403, "ops": 200}
    finally:
        assert proc.terminate(30) == 0
    assert "tok-" not in proc.log_text()
    default = StoreProcess(
        tmp_path / "default", "--host-capacity", "16MiB", "--metrics-port", "0", "--metrics-host", "0.0.0.0"
    ).start()
    try:  # without a tokens file: the default token (tenant default has admin)
        assert scrape_code(default.metrics_url, None) == 401
        assert scrape_code(default.metrics_url, default_token_path().read_text().strip()) == 200
    finally:
        assert default.terminate(30) == 0


def test_a_bad_metrics_tenant_labels_value_is_refused():
    run = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--host-capacity", "16MiB", "--metrics-tenant-labels", "names"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 2 and "metrics_tenant_labels must be name, hash or off" in run.stderr
