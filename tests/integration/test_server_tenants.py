"""Tenants and tokens against one real ``kvstore serve --auth-tokens``: isolation (another
tenant cannot read, delete or detect an object, even knowing its hashes), authentication,
permissions per RPC, and ids (leases, puts) bound to the tenant that got them."""

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore._proto import kvstore_pb2 as pb
from tests.kits.store_calls import KiB, Objects, StoreClient, key_fields, random_key, rpc_code, stream_frames

TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
    {"token": "tok-a-read", "tenant": "a", "permissions": ["read"]},
    {"token": "tok-a-noshm", "tenant": "a", "permissions": ["read", "write"]},
]
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
SIZE = 8 * KiB


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "32MiB", tokens=TOKENS, name="tenants")


@pytest.fixture(scope="module")
def clients(store):
    made = {
        name: StoreClient(store.target, token)
        for name, token in (
            ("a", "tok-a"),
            ("b", "tok-b"),
            ("ro", "tok-a-read"),
            ("noshm", "tok-a-noshm"),
            ("none", None),
            ("wrong", "tok-zzz"),
        )
    }
    yield made
    for c in made.values():
        c.close()


@pytest.fixture(scope="module")
def objects():
    return Objects(64 * KiB)


def _rpcs(key):
    """Every KVStore RPC with a well-formed request."""
    fields = key_fields(key)
    return {
        "Hello": pb.HelloRequest(),
        "Lookup": pb.LookupRequest(namespace=fields["namespace"], chunk_hashes=[fields["chunk_hash"]], tag="r0"),
        "Get": pb.GetRequest(**fields),
        "PutStart": pb.PutStartRequest(size=SIZE, **fields),
        "PutCommit": pb.PutCommitRequest(put_id=1),
        "Delete": pb.DeleteRequest(**fields),
        "RenewLease": pb.RenewLeaseRequest(lease_id=1),
        "ReleaseLease": pb.ReleaseLeaseRequest(lease_ids=[1]),
        "Stats": pb.StatsRequest(),
    }


def _stream_code(c: StoreClient, method: str, key) -> grpc.StatusCode:
    if method == "GetStream":
        return rpc_code(lambda: list(c.call("GetStream", pb.GetRequest(**key_fields(key)))))
    obj = Objects(SIZE).make(key, SIZE)
    return rpc_code(lambda: c.put_frames(stream_frames(key, obj)))


def test_hello_names_the_tenant_and_offers_shm_only_with_permission(clients):
    a, noshm = clients["a"].hello(), clients["noshm"].hello()
    assert (a.tenant, list(a.permissions)) == ("a", ["read", "write", "shm"])
    assert a.shm_socket.endswith(".sock") and a.segment_path == ""  # a socket, no pool name
    assert a.segment_size == 16 << 20  # a's pool: half of 32 MiB
    assert (noshm.tenant, list(noshm.permissions)) == ("a", ["read", "write"])
    assert noshm.shm_socket == "" and noshm.segment_size == 0 and noshm.segment_inode == 0
    assert noshm.boot_id == "" and a.boot_id == open("/proc/sys/kernel/random/boot_id").read().strip()
    assert clients["b"].hello().tenant == "b"


@pytest.mark.parametrize("who", ["none", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated_everywhere(clients, who):
    c = clients[who]
    key = random_key(np.random.default_rng(1))
    for method, request in _rpcs(key).items():
        assert rpc_code(lambda: c.call(method, request)) == UNAUTH, method
    assert _stream_code(c, "GetStream", key) == UNAUTH
    assert _stream_code(c, "PutStream", key) == UNAUTH


def test_malformed_authorization_header(store):
    with grpc.insecure_channel(store.target) as channel:
        hello = channel.unary_unary(
            "/kvstore.v1.KVStore/Hello",
            request_serializer=pb.HelloRequest.SerializeToString,
            response_deserializer=pb.HelloResponse.FromString,
        )
        for value in ("tok-a", "Basic tok-a", "Bearer"):
            assert rpc_code(lambda: hello(pb.HelloRequest(), metadata=(("authorization", value),), timeout=5)) == UNAUTH


def test_health_needs_no_token(store):
    with grpc.insecure_channel(store.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tenant_b_cannot_read_delete_or_detect_a(clients, objects):
    a, b = clients["a"], clients["b"]
    key = random_key(np.random.default_rng(2))
    assert a.put_shm(key, objects.make(key, SIZE, seed=1)) == pb.PUT_OUTCOME_STORED
    out = np.zeros(SIZE, np.uint8)
    assert b.lookup([key]).hits == 0
    assert b.get_shm(key, out) is None and b.get_stream(key, out) is None
    assert b.delete(key) is False
    assert b.call("Get", pb.GetRequest(**key_fields(key))).found is False
    # the same hashes under B are B's own object, with B's bytes
    assert b.put_stream(key, objects.make(key, SIZE, seed=2)) == pb.PUT_OUTCOME_STORED
    assert b.get_stream(key, out) == SIZE and bytes(out) == bytes(objects.make(key, SIZE, seed=2))
    assert a.get_shm(key, out) == SIZE and bytes(out) == bytes(objects.make(key, SIZE, seed=1))
    assert b.delete(key) is True
    assert a.lookup([key]).hits == 1 and a.get_stream(key, out) == SIZE
    assert bytes(out) == bytes(objects.make(key, SIZE, seed=1))


def test_read_only_token_cannot_write(clients, objects):
    ro, a = clients["ro"], clients["a"]
    key = random_key(np.random.default_rng(3))
    assert a.put_stream(key, objects.make(key, SIZE)) == pb.PUT_OUTCOME_STORED
    requests = _rpcs(key)
    for method in ("PutStart", "PutCommit", "Delete", "Get"):
        assert rpc_code(lambda: ro.call(method, requests[method])) == DENIED, method
    assert _stream_code(ro, "PutStream", key) == DENIED
    out = np.zeros(SIZE, np.uint8)
    assert ro.lookup([key]).hits == 1  # same tenant: it sees a's object
    assert ro.get_stream(key, out) == SIZE  # streaming needs read only
    assert ro.stats()[1]["leases_held"] == 0
    assert a.lookup([key]).hits == 1  # nothing was deleted


def test_shm_needs_its_permission_streams_do_not(clients, objects):
    noshm = clients["noshm"]
    key = random_key(np.random.default_rng(4))
    requests = _rpcs(key)
    assert rpc_code(lambda: noshm.call("Get", requests["Get"])) == DENIED
    assert rpc_code(lambda: noshm.call("PutStart", requests["PutStart"])) == DENIED
    assert noshm.put_stream(key, objects.make(key, SIZE, seed=5)) == pb.PUT_OUTCOME_STORED
    out = np.zeros(SIZE, np.uint8)
    assert noshm.get_stream(key, out) == SIZE and bytes(out) == bytes(objects.make(key, SIZE, seed=5))


def test_leases_and_put_ids_belong_to_their_tenant(clients, objects):
    a, b = clients["a"], clients["b"]
    key = random_key(np.random.default_rng(5))
    assert a.put_shm(key, objects.make(key, SIZE)) == pb.PUT_OUTCOME_STORED
    lease = a.call("Get", pb.GetRequest(**key_fields(key))).lease_id
    assert list(b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[lease])).valid) == [False]
    assert rpc_code(lambda: b.call("RenewLease", pb.RenewLeaseRequest(lease_id=lease))) == grpc.StatusCode.NOT_FOUND
    assert list(a.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[lease])).valid) == [True]

    other = random_key(np.random.default_rng(6))
    start = a.put_start(other, SIZE)
    assert start.outcome == pb.PUT_OUTCOME_UNSPECIFIED
    assert rpc_code(lambda: b.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id))) == grpc.StatusCode.NOT_FOUND
    a.segment[start.offset : start.offset + SIZE] = np.frombuffer(objects.make(other, SIZE), np.uint8)
    assert a.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id)).outcome == pb.PUT_OUTCOME_STORED
    assert b.lookup([other]).hits == 0 and a.lookup([other]).hits == 1
