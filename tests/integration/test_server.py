"""The store process end to end: real ``kvstore serve`` children, raw generated stubs.

Round trips through shared memory and streams (1 KiB .. 32 MiB, both directions crossed),
a 512-key Lookup with tiers and sizes, restart on the same SSD directory (objects promoted
back on Get), Redis as the lowest tier shared by two store processes (and then dead),
leases (never evicted under pressure, expiry at release, renewal), reaped reservations,
racing clients, health (and ``kvstore health``), reflection, /metrics, ``kvstore stats``, TLS
and start-up errors.
"""

import json
import re
import subprocess
import sys
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import TierError
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, chain_keys, random_key, rpc_code, wait_until

SIZES = [1 * KiB, 64 * KiB + 3, 1 * MiB, 3 * MiB + 5, 32 * MiB]


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "160MiB", "--ssd-dir", "{work}/ssd", "--metrics-port", "0")


@pytest.fixture(scope="module")
def objects():
    return Objects(33 * MiB), Objects(33 * MiB)  # (to send, expected)


@pytest.fixture
def client(store):
    with StoreClient(store.target) as c:
        yield c


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("put_path", ["shm", "stream"])
def test_round_trip(client, objects, size, put_path):
    send, expect = objects
    key = random_key(np.random.default_rng(size * 2 + (put_path == "shm")))
    obj = send.make(key, size, seed=size)
    put = client.put_shm if put_path == "shm" else client.put_stream
    assert put(key, obj) == pb.PUT_OUTCOME_STORED
    assert put(key, obj) == pb.PUT_OUTCOME_EXISTS
    want = expect.make(key, size, seed=size)
    for get in (client.get_shm, client.get_stream):
        out = np.zeros(size + 4096, np.uint8)
        assert get(key, out) == size
        assert np.array_equal(out[:size], np.frombuffer(want, np.uint8))  # rekeyed to our key
    reply = client.lookup([key])
    assert (reply.hits, list(reply.tiers), list(reply.sizes)) == (1, [pb.TIER_HOST], [size])


def test_miss_and_delete(client, objects):
    key = random_key(np.random.default_rng(7))
    out = np.zeros(8 * KiB, np.uint8)
    assert client.get_shm(key, out) is None and client.get_stream(key, out) is None
    assert client.delete(key) is False
    assert client.put_stream(key, objects[0].make(key, 4 * KiB)) == pb.PUT_OUTCOME_STORED
    assert client.delete(key) is True  # its write-through to SSD settles first: no resurrection
    assert wait_until(lambda: client.stats()[1]["write_throughs_in_flight"] == 0)
    assert client.lookup([key]).hits == 0 and client.get_stream(key, out) is None
    assert client.delete(key) is False


def test_lookup_512_keys_then_restart_promotes_from_ssd(tmp_path, objects):
    keys = chain_keys(np.random.default_rng(512), 512)
    sizes = [300 + 7 * i for i in range(512)]
    send, expect = objects
    with StoreProcess(tmp_path, "--host-capacity", "32MiB", "--ssd-dir", str(tmp_path / "ssd")) as proc:
        with StoreClient(proc.target) as c:
            for key, size in zip(keys, sizes):
                assert c.put_stream(key, send.make(key, size, seed=size)) == pb.PUT_OUTCOME_STORED
            reply = c.lookup(keys)
            assert reply.hits == 512 and list(reply.tiers) == [pb.TIER_HOST] * 512
            assert list(reply.sizes) == sizes
        assert proc.terminate() == 0  # graceful: write-throughs finish before exit
        proc.start()  # same SSD directory, empty host pool, new port
        with StoreClient(proc.target) as c:
            reply = c.lookup(keys)
            assert reply.hits == 512 and list(reply.tiers) == [pb.TIER_SSD] * 512
            assert list(reply.sizes) == sizes
            out = np.zeros(8 * KiB, np.uint8)
            for i in range(10):
                got = c.call(
                    "Get",
                    pb.GetRequest(namespace=bytes(keys[i].namespace), chunk_hash=bytes(keys[i].chunk_hash), tag="r0"),
                )
                assert got.found and got.tier == pb.TIER_SSD and got.length == sizes[i]
                c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[got.lease_id]))
                assert c.get_shm(keys[i], out) == sizes[i]
                assert bytes(out[: sizes[i]]) == bytes(expect.make(keys[i], sizes[i], seed=sizes[i]))
            reply = c.lookup(keys)
            assert list(reply.tiers) == [pb.TIER_HOST] * 10 + [pb.TIER_SSD] * 502
            missing = random_key(np.random.default_rng(0), namespace=keys[0].namespace)
            assert c.lookup(keys[:100] + [missing] + keys[100:]).hits == 100
            doc, counters = c.stats()
            assert counters["store.promotions.ssd"] == 10
            assert counters["store.lookup_keys"] == 512 + 512 + 513


def test_lease_protects_an_object_from_eviction(tmp_path, objects):
    """8 MiB pool: a leased object survives 5 pool-fulls of puts, an unleased one does not,
    and a pool full of leased objects answers NO_ROOM."""
    send, expect = objects
    rng = np.random.default_rng(9)
    size = 1 * MiB
    with StoreProcess(tmp_path, "--host-capacity", "8MiB") as proc, StoreClient(proc.target) as c:
        leased, plain = random_key(rng), random_key(rng)
        for key in (leased, plain):
            assert c.put_shm(key, send.make(key, size, seed=1)) == pb.PUT_OUTCOME_STORED
        got = c.call(
            "Get", pb.GetRequest(namespace=bytes(leased.namespace), chunk_hash=bytes(leased.chunk_hash), tag="r0")
        )
        assert got.found
        for i in range(40):
            key = random_key(rng)
            assert c.put_stream(key, send.make(key, size, seed=i)) == pb.PUT_OUTCOME_STORED
        assert c.lookup([plain]).hits == 0  # churned out
        reply = c.lookup([leased])
        assert reply.hits == 1 and list(reply.tiers) == [pb.TIER_HOST]
        want = np.frombuffer(expect.make(leased, size, seed=1), np.uint8).copy()
        want_scoped = c.segment[got.offset : got.offset + size].copy()
        assert np.array_equal(want_scoped[256:], want[256:])  # payload never overwritten
        assert list(c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[got.lease_id])).valid) == [True]
        counters = c.stats()[1]
        assert counters["host.objects"] == 8 and counters["host.evictions"] == 42 - 8


def test_pool_of_leased_objects_answers_no_room(tmp_path, objects):
    send = objects[0]
    rng = np.random.default_rng(10)
    with StoreProcess(tmp_path, "--host-capacity", "4MiB") as proc, StoreClient(proc.target) as c:
        keys = [random_key(rng) for _ in range(4)]
        leases = []
        for key in keys:
            assert c.put_shm(key, send.make(key, 1 * MiB)) == pb.PUT_OUTCOME_STORED
            leases.append(
                c.call(
                    "Get", pb.GetRequest(namespace=bytes(key.namespace), chunk_hash=bytes(key.chunk_hash), tag="r0")
                ).lease_id
            )
        extra = random_key(rng)
        assert c.put_shm(extra, send.make(extra, 1 * MiB)) == pb.PUT_OUTCOME_NO_ROOM
        assert c.put_stream(extra, send.make(extra, 1 * MiB)) == pb.PUT_OUTCOME_NO_ROOM
        assert c.stats()[1]["leases_held"] == 4
        assert list(c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=leases[:1])).valid) == [True]
        assert c.put_shm(extra, send.make(extra, 1 * MiB)) == pb.PUT_OUTCOME_STORED
        assert c.lookup([keys[0]]).hits == 0 and all(c.lookup([k]).hits == 1 for k in keys[1:])


def test_lease_expiry_renewal_and_release(tmp_path, objects):
    rng = np.random.default_rng(11)
    with StoreProcess(tmp_path, "--host-capacity", "8MiB") as proc, StoreClient(proc.target) as c:
        key = random_key(rng)
        assert c.put_shm(key, objects[0].make(key, 64 * KiB)) == pb.PUT_OUTCOME_STORED
        req = pb.GetRequest(namespace=bytes(key.namespace), chunk_hash=bytes(key.chunk_hash), tag="r0")

        def get(lease_ms: int) -> int:
            req.lease_ms = lease_ms
            reply = c.call("Get", req)
            assert reply.found and reply.lease_ms == lease_ms
            return reply.lease_id

        def release(lease_id: int) -> bool:
            return list(c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[lease_id])).valid) == [True]

        # The rules are stories in tests/unit/test_server_core.py (fake clock); here the
        # process's own clock and the RPCs: two 200 ms leases, one renewed at once; once the
        # other has expired, the renewed one has outlived its first TTL.
        renewed, short = get(200), get(200)
        assert c.call("RenewLease", pb.RenewLeaseRequest(lease_id=renewed, lease_ms=5000)).lease_ms == 5000
        assert wait_until(lambda: c.stats()[1]["leases_held"] == 1, timeout=5, interval=0.02)
        assert not release(short)  # expired: the copy is a miss
        assert rpc_code(lambda: c.call("RenewLease", pb.RenewLeaseRequest(lease_id=short))) == grpc.StatusCode.NOT_FOUND
        assert release(renewed)
        assert not release(renewed)  # released twice: not valid
        deleted = get(5000)
        assert c.delete(key)
        assert not release(deleted)  # object deleted meanwhile
        assert c.stats()[1]["leases_held"] == 0


def test_uncommitted_put_start_is_fenced_then_freed_by_its_commit(tmp_path, objects):
    """An expired reservation stays reserved (fenced: its client may still be copying into
    it) until its PutCommit says the client is done; then its room is reused."""
    rng = np.random.default_rng(12)
    size = 3 * MiB
    with StoreProcess(tmp_path, "--host-capacity", "4MiB", "--lease-ttl", "1") as proc, StoreClient(proc.target) as c:
        base = c.stats()[1]["host.bytes_used"]
        first, second = random_key(rng), random_key(rng)
        start = c.put_start(first, size)
        assert start.outcome == pb.PUT_OUTCOME_UNSPECIFIED and start.ttl_ms == 1000
        counters = c.stats()[1]
        assert counters["puts_in_flight"] == 1 and counters["host.bytes_used"] == base + size
        assert c.put_start(second, size).outcome == pb.PUT_OUTCOME_NO_ROOM  # the room is held
        assert wait_until(lambda: c.stats()[1]["puts_fenced"] == 1, timeout=5)
        counters = c.stats()[1]
        assert counters["host.bytes_used"] == base + size and counters["store.puts_reaped"] == 1
        assert c.put_start(second, size).outcome == pb.PUT_OUTCOME_NO_ROOM  # fenced, not reused
        assert (
            rpc_code(lambda: c.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id))) == grpc.StatusCode.NOT_FOUND
        )
        counters = c.stats()[1]
        assert (counters["puts_in_flight"], counters["puts_fenced"]) == (0, 0)
        assert counters["host.bytes_used"] == base and counters["store.puts_reaped"] == 1
        assert c.put_shm(second, objects[0].make(second, size)) == pb.PUT_OUTCOME_STORED


def test_concurrent_clients_on_shared_keys(tmp_path):
    """Six clients race puts (both paths), gets (both paths), deletes and lookups over ten
    keys in a pool that holds only some of them: every get returns the right bytes or a
    miss, and nothing stays held afterwards."""
    keys = chain_keys(np.random.default_rng(17), 10)
    size = 700 * KiB
    maker = Objects(size)
    want = {key: bytes(maker.make(key, size, seed=i)) for i, key in enumerate(keys)}
    errors: list[BaseException] = []

    def worker(seed: int, target: str) -> None:
        rng = np.random.default_rng(seed)
        objs, out = Objects(size), np.zeros(size, np.uint8)
        try:
            with StoreClient(target) as c:
                for _ in range(40):
                    i = int(rng.integers(len(keys)))
                    key, op = (
                        keys[i],
                        rng.choice(["put_shm", "put_stream", "get_shm", "get_stream", "delete", "lookup"]),
                    )
                    if op.startswith("put"):
                        outcome = getattr(c, op)(key, objs.make(key, size, seed=i))
                        assert outcome in (pb.PUT_OUTCOME_STORED, pb.PUT_OUTCOME_EXISTS, pb.PUT_OUTCOME_NO_ROOM)
                    elif op.startswith("get"):
                        n = getattr(c, op)(key, out)
                        assert n is None or (n == size and bytes(out) == want[key])
                    elif op == "delete":
                        c.delete(key)
                    else:
                        assert c.lookup(keys).hits <= len(keys)
        except BaseException as err:  # noqa: BLE001 - reported by the test thread
            errors.append(err)

    with StoreProcess(tmp_path, "--host-capacity", "4MiB") as proc:
        threads = [threading.Thread(target=worker, args=(s, proc.target)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        with StoreClient(proc.target) as c:
            counters = c.stats()[1]
            assert counters["leases_held"] == 0 and counters["puts_in_flight"] == 0
            assert counters["host.refs_held"] == 0 and counters["host.pending"] == 0
            assert counters.get("store.puts.shm.stored", 0) + counters.get("store.puts.stream.stored", 0) > 0


def test_health_and_reflection(store):
    with grpc.insecure_channel(store.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names
    health_cli = [sys.executable, "-m", "kvstore", "health", "--target"]
    ok = subprocess.run([*health_cli, store.target], capture_output=True, text=True, timeout=30)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"{store.target}: SERVING")
    closed = subprocess.run([*health_cli, "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert closed.returncode == 1 and "UNAVAILABLE" in closed.stdout


def test_metrics_and_stats_cli(store, client, objects):
    keys = chain_keys(np.random.default_rng(13), 5)
    for key in keys[:3]:
        assert client.put_stream(key, objects[0].make(key, 2 * KiB)) == pb.PUT_OUTCOME_STORED
    before = client.stats()[1]
    assert client.lookup(keys).hits == 3
    text = urllib.request.urlopen(store.metrics_url, timeout=5).read().decode()
    metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(metrics["kvstore_server_lookup_keys_total"]) == before["store.lookup_keys"] + 5
    assert (
        float(metrics['kvstore_server_lookup_hits_total{tier="host"}']) == before.get("store.lookup_hits.host", 0) + 3
    )
    for name in (
        'kvstore_server_bytes_total{direction="write",tier="host"}',
        "kvstore_server_leases_held",
        'kvstore_server_evictions_total{tier="ssd"}',
        'kvstore_server_stage_seconds_count{stage="lookup"}',
        "kvstore_server_leases_expired_total",
        "kvstore_server_puts_in_flight",
    ):
        assert name in metrics, name
    cli = [sys.executable, "-m", "kvstore", "stats", "--target", store.target]
    summary = subprocess.run(cli, capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"kvstore store at {store.target}" in summary
    assert "hit keys / looked-up keys" in summary and "tier ssd" in summary and "leases" in summary
    # Hits by tier with their shares (of every hit so far), and each stage's p50/p99.
    shares = re.search(r"hits by tier: (.*)$", summary, re.M).group(1)
    split = re.findall(r"(\w+) (\d+) \((\d+)%\)", shares)
    assert split and "host" in {t for t, _, _ in split} and abs(sum(int(p) for _, _, p in split) - 100) <= len(split)
    stages = re.search(r"^  stages +(.*) \(p50/p99\)$", summary, re.M).group(1)
    assert re.search(r"\blookup \d+\.\d\d/\d+\.\d\d ms", stages), stages
    doc = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=30, check=True).stdout)
    assert doc["store"]["lookup_keys"] == before["store.lookup_keys"] + 5


def test_tls_and_client_certificates(tmp_path, objects, tls_files):
    tls = tls_files
    ca = tls.ca_cert.read_bytes()
    with StoreProcess(tmp_path / "one", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)) as proc:
        with StoreClient(proc.target, credentials=grpc.ssl_channel_credentials(ca)) as c:
            assert c.hello().tenant == "default"
        with StoreClient(proc.target) as plain:
            assert rpc_code(plain.hello) == grpc.StatusCode.UNAVAILABLE
        health = [sys.executable, "-m", "kvstore", "health", "--target", proc.target, "--tls-ca", str(tls.ca_cert)]
        assert subprocess.run(health, capture_output=True, timeout=30).returncode == 0
    with StoreProcess(
        tmp_path / "two", "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-client-ca", str(tls.ca_cert)
    ) as proc:
        with StoreClient(proc.target, credentials=grpc.ssl_channel_credentials(ca)) as anonymous:
            assert rpc_code(anonymous.hello) == grpc.StatusCode.UNAVAILABLE
        mutual = grpc.ssl_channel_credentials(ca, tls.client_key.read_bytes(), tls.client_cert.read_bytes())
        with StoreClient(proc.target, credentials=mutual) as c:
            key = random_key(np.random.default_rng(14))
            assert c.put_stream(key, objects[0].make(key, 4 * KiB)) == pb.PUT_OUTCOME_STORED


def test_redis_is_the_lowest_tier_shared_by_store_processes(tmp_path, objects, redis_server):
    """Store 1 writes through to Redis; store 2 (empty pool, no SSD) finds the objects there,
    promotes them on Get; with Redis dead, lookups stop at the host hits and puts still work."""
    send, expect = objects
    keys = chain_keys(np.random.default_rng(15), 6)
    sizes = [4 * KiB, 300 * KiB, 1 * MiB, 1 * MiB + 1, 3 * MiB + 7, 5 * KiB]
    with (
        StoreProcess(tmp_path / "one", "--host-capacity", "64MiB", "--redis", redis_server.url) as one,
        StoreClient(one.target) as c,
    ):
        for i, (key, size) in enumerate(zip(keys, sizes)):
            assert c.put_stream(key, send.make(key, size, seed=i)) == pb.PUT_OUTCOME_STORED
        assert wait_until(lambda: c.stats()[1]["write_throughs_in_flight"] == 0)
        doc, counters = c.stats()
        assert counters["store.write_through.redis.stored"] == 6
        assert doc["breakers"]["redis"]["breaker_open"] == 0
    with (
        StoreProcess(tmp_path / "two", "--host-capacity", "64MiB", "--redis", redis_server.url) as two,
        StoreClient(two.target) as c,
    ):
        reply = c.lookup(keys)
        assert reply.hits == 6 and list(reply.tiers) == [pb.TIER_REDIS] * 6 and list(reply.sizes) == sizes
        out = np.zeros(4 * MiB, np.uint8)
        got = c.call(
            "Get", pb.GetRequest(namespace=bytes(keys[0].namespace), chunk_hash=bytes(keys[0].chunk_hash), tag="r0")
        )
        assert got.found and got.tier == pb.TIER_REDIS
        c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[got.lease_id]))
        assert c.get_stream(keys[1], out) == sizes[1]
        assert bytes(out[: sizes[1]]) == bytes(expect.make(keys[1], sizes[1], seed=1))
        reply = c.lookup(keys)
        assert list(reply.tiers) == [pb.TIER_HOST] * 2 + [pb.TIER_REDIS] * 4
        redis_server.kill()
        assert c.lookup(keys).hits == 2  # Redis down: a miss, not an error
        assert c.get_stream(keys[2], out) is None
        extra = random_key(np.random.default_rng(16))
        assert c.put_stream(extra, send.make(extra, 8 * KiB)) == pb.PUT_OUTCOME_STORED
        assert wait_until(lambda: c.stats()[1]["write_throughs_in_flight"] == 0)
        doc, counters = c.stats()
        refused = sum(counters.get(f"store.write_through.redis.{r}", 0) for r in ("failed", "no_room"))
        assert refused == 1 and counters.get("store.write_through.redis.stored", 0) == 0
        assert doc["breakers"]["redis"]["breaker_open"] == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--auth-tokens", "/nonexistent/tokens.yaml"), "auth tokens file /nonexistent/tokens.yaml does not exist"),
        (("--host-capacity", "lots"), "--host-capacity: cannot parse size 'lots'"),
        (("--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"), "tls_cert /nonexistent/c.pem"),
        (("--ssd-dir", "/proc/kvstore-ssd"), "SSD tier directory /proc/kvstore-ssd is not usable"),
        (
            ("--tls-cert", "/proc/self/status", "--tls-key", "/proc/self/status"),
            "tls_cert /proc/self/status / tls_key /proc/self/status: not a PEM certificate",
        ),
        (("--redis", "http://cache:6379"), "unknown redis URL scheme 'http'"),
        (("--redis", "redis://127.0.0.1:1/0"), "cannot reach redis at 127.0.0.1:1"),
    ],
)
def test_startup_errors_name_the_problem(tmp_path, args, needle):
    proc = StoreProcess(tmp_path, *args)
    with pytest.raises(TierError, match="exited with code 2") as info:
        proc.start(timeout=20)
    assert needle in str(info.value)


def test_port_in_use_is_an_error(store, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--listen", store.target, "--host-capacity", "4MiB"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert f"cannot listen on {store.target}" in done.stderr
