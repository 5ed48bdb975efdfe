"""Bad input over every RPC, generated with hypothesis, against ONE real ``kvstore serve``.

Each example asserts the exact status code.  After each test the server must still serve a
valid round trip, the objects stored at the start must read back intact, and memory must be
back at its baseline: no puts in flight, no leases, host ``bytes_used`` unchanged.
"""

import functools

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from kvstore.localtoken import local_token
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, key_fields, random_key, rpc_code, stream_frames

OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED, NOT_FOUND = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
MAX_KEYS, MAX_OBJECT, HOST = 64, 48 * MiB, 32 * MiB
FUZZ = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
digest = st.binary(min_size=32, max_size=32)
any_bytes = st.binary(max_size=40)
tags = st.one_of(st.sampled_from(["r0", "tp3_pp1", "x" * 32, "x" * 33, "r0\n", "", "é", "a b"]), st.text(max_size=40))


TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def valid_tag(tag: str) -> bool:
    """The documented rule, restated on its own (not the code's regex): 1 to 32 characters,
    each an ASCII letter, digit, ``_`` or ``-``."""
    return 1 <= len(tag) <= 32 and all(c in TAG_CHARS for c in tag)


@pytest.fixture(scope="module")
def store(store_process):
    return store_process(
        "--host-capacity",
        str(HOST),
        "--max-keys-per-call",
        str(MAX_KEYS),
        "--max-object-bytes",
        str(MAX_OBJECT),
        "--max-message-bytes",
        "2MiB",
        "--frame-bytes",
        "1MiB",
        name="bad-input",
    )


@pytest.fixture(scope="module")
def client(store):
    with StoreClient(store.target) as c:
        yield c


@pytest.fixture(scope="module")
def objects():
    return Objects(1 * MiB)


@pytest.fixture(scope="module")
def stored(client, objects):
    """Objects put before any bad input, with a copy of their bytes."""
    rng = np.random.default_rng(0)
    kept = []
    for i, size in enumerate((300, 64 * KiB, 1 * MiB)):
        key = random_key(rng)
        assert client.put_shm(key, objects.make(key, size, seed=i)) == pb.PUT_OUTCOME_STORED
        kept.append((key, bytes(objects.make(key, size, seed=i))))
    return kept


@pytest.fixture(scope="module")
def baseline(client, stored):
    return client.stats()[1]["host.bytes_used"]


@pytest.fixture(autouse=True)
def still_serving(client, stored, baseline, objects):
    """After each test: a round trip works, stored objects are intact, memory is at baseline."""
    yield
    key = random_key(np.random.default_rng(99))
    assert client.put_stream(key, objects.make(key, 5000, seed=9)) == pb.PUT_OUTCOME_STORED
    out = np.zeros(1 * MiB, np.uint8)
    assert client.get_shm(key, out) == 5000 and bytes(out[:5000]) == bytes(objects.make(key, 5000, seed=9))
    assert client.delete(key)
    for key, want in stored:
        assert client.get_stream(key, out) == len(want) and bytes(out[: len(want)]) == want
    counters = client.stats()[1]
    assert counters["puts_in_flight"] == 0 and counters["leases_held"] == 0
    assert counters["host.bytes_used"] == baseline and counters["host.pending"] == 0
    assert counters["host.refs_held"] == 0


def key_code(namespace: bytes, chunk_hash: bytes, tag: str) -> grpc.StatusCode:
    ok = len(namespace) == 32 and len(chunk_hash) == 32 and valid_tag(tag)
    return OK if ok else INVALID


@FUZZ
@given(namespace=st.one_of(digest, any_bytes), hashes=st.lists(st.one_of(digest, any_bytes), max_size=6), tag=tags)
def test_lookup_malformed_keys(client, namespace, hashes, tag):
    request = pb.LookupRequest(namespace=namespace, chunk_hashes=hashes, tag=tag)
    ok = len(namespace) == 32 and valid_tag(tag) and all(len(h) == 32 for h in hashes)
    assert rpc_code(lambda: client.call("Lookup", request)) == (OK if ok else INVALID)


@FUZZ
@given(n=st.integers(MAX_KEYS + 1, 4 * MAX_KEYS), n_ids=st.integers(MAX_KEYS + 1, 4 * MAX_KEYS))
def test_too_many_keys_or_lease_ids(client, n, n_ids):
    request = pb.LookupRequest(namespace=bytes(32), chunk_hashes=[bytes(32)] * n, tag="r0")
    assert rpc_code(lambda: client.call("Lookup", request)) == EXHAUSTED
    release = pb.ReleaseLeaseRequest(lease_ids=list(range(n_ids)))
    assert rpc_code(lambda: client.call("ReleaseLease", release)) == EXHAUSTED


@FUZZ
@given(
    namespace=st.one_of(digest, any_bytes),
    chunk_hash=st.one_of(digest, any_bytes),
    tag=tags,
    lease_ms=st.sampled_from([0, 1, 2**32 - 1]),
)
def test_get_getstream_delete_malformed_keys(client, namespace, chunk_hash, tag, lease_ms):
    expected = key_code(namespace, chunk_hash, tag)
    fields = {"namespace": namespace, "chunk_hash": chunk_hash, "tag": tag}
    get = pb.GetRequest(lease_ms=lease_ms, **fields)
    assert rpc_code(lambda: client.call("Get", get)) == expected
    assert rpc_code(lambda: list(client.call("GetStream", get))) == expected
    assert rpc_code(lambda: client.call("Delete", pb.DeleteRequest(**fields))) == expected
    if expected is OK:  # well formed but absent: a miss, never an error
        assert client.call("Get", get).found is False
        assert [f.found for f in client.call("GetStream", get)] == [False]


def _raw(store_target: str, method: str):
    """A raw unary call carrying this user's default token (kvstore.localtoken), as clients do."""
    channel = grpc.insecure_channel(store_target)
    call = channel.unary_unary(
        f"/kvstore.v1.KVStore/{method}", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
    )
    token = local_token()
    return channel, functools.partial(call, metadata=(("authorization", f"Bearer {token}"),) if token else None)


UNARY = {
    "Hello": pb.HelloRequest,
    "Lookup": pb.LookupRequest,
    "Get": pb.GetRequest,
    "PutStart": pb.PutStartRequest,
    "PutCommit": pb.PutCommitRequest,
    "Delete": pb.DeleteRequest,
    "RenewLease": pb.RenewLeaseRequest,
    "ReleaseLease": pb.ReleaseLeaseRequest,
    "Stats": pb.StatsRequest,
}


@FUZZ
@given(method=st.sampled_from(sorted(UNARY)), raw=st.binary(min_size=1, max_size=64))
def test_unparsable_request_bytes(store, method, raw):
    try:
        UNARY[method].FromString(raw)
    except DecodeError:
        pass
    else:
        assume(False)  # only bytes protobuf refuses: their answer is always INVALID_ARGUMENT
    channel, call = _raw(store.target, method)
    with channel:
        assert rpc_code(lambda: call(raw, timeout=10)) == INVALID


@FUZZ
@given(method=st.sampled_from(["Lookup", "Get", "Delete", "PutStart"]), tag=st.binary(min_size=1, max_size=40))
def test_tags_that_are_not_utf8(store, method, tag):
    try:
        tag.decode("utf-8")
        assume(False)
    except UnicodeDecodeError:
        pass
    field = 3  # tag is field 3 in every request that carries one
    raw = bytes([field << 3 | 2, len(tag)]) + tag
    channel, call = _raw(store.target, method)
    with channel:
        assert rpc_code(lambda: call(raw, timeout=10)) == INVALID


@FUZZ
@given(
    size=st.one_of(
        st.integers(0, 255),
        st.integers(256, 4 * MiB),
        st.integers(HOST + 1, MAX_OBJECT),
        st.integers(MAX_OBJECT + 1, 2**64 - 1),
    ),
    parent=st.one_of(st.just(b""), digest, any_bytes),
    seed=st.integers(0, 2**32 - 1),
)
def test_put_start_sizes_and_parents(client, size, parent, seed):
    key = random_key(np.random.default_rng([seed, 1]))
    request = pb.PutStartRequest(
        size=size, parent_hash=parent, session=client.open_session().session_id, **key_fields(key)
    )
    if len(parent) not in (0, 32) or size < 256:
        expected = INVALID
    elif size > MAX_OBJECT or size > HOST:  # larger than allowed, or than the pool can ever hold
        expected = EXHAUSTED
    else:
        expected = OK
    if expected is not OK:
        assert rpc_code(lambda: client.call("PutStart", request)) == expected
    else:  # reserve, then abort: the slot is freed at once
        start = client.call("PutStart", request)
        assert start.outcome == pb.PUT_OUTCOME_UNSPECIFIED and start.length == size
        abort = pb.PutCommitRequest(put_id=start.put_id, abort=True)
        assert client.call("PutCommit", abort).outcome == pb.PUT_OUTCOME_FAILED
        assert rpc_code(lambda: client.call("PutCommit", abort)) == NOT_FOUND
        assert client.stats()[1]["puts_in_flight"] == 0
    frames = iter([pb.PutFrame(start=request)])  # announces bytes it never sends
    assert rpc_code(lambda: client.put_frames(frames)) == (INVALID if expected is OK else expected)


@FUZZ
@given(
    ids=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=MAX_KEYS),
    lease_ms=st.integers(0, 2**32 - 1),
    abort=st.booleans(),
)
def test_unknown_lease_and_put_ids(client, ids, lease_ms, abort):
    assert list(client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=ids)).valid) == [False] * len(ids)
    renew = pb.RenewLeaseRequest(lease_id=ids[0], lease_ms=lease_ms)
    assert rpc_code(lambda: client.call("RenewLease", renew)) == NOT_FOUND
    commit = pb.PutCommitRequest(put_id=ids[-1], abort=abort)
    assert rpc_code(lambda: client.call("PutCommit", commit)) == NOT_FOUND


DAMAGE = ["payload", "header", "wrong_key", "announced_size"]


@FUZZ
@given(
    size=st.integers(257, 256 * KiB),
    where=st.floats(0, 1, exclude_max=True),
    xor=st.integers(1, 255),
    damage=st.sampled_from(DAMAGE),
    path=st.sampled_from(["shm", "stream"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_commits_of_damaged_objects_fail_cleanly(client, objects, size, where, xor, damage, path, seed):
    rng = np.random.default_rng([seed, 2])
    key = random_key(rng)
    if damage == "wrong_key":
        obj = objects.make(random_key(rng), size, seed=seed)  # an intact object of another key
    else:
        obj = objects.make(key, size, seed=seed)
    announced = size
    if damage == "payload":
        objects.buf[256 + int(where * (size - 256))] ^= xor
    elif damage == "header":
        objects.buf[int(where * 256)] ^= xor
    elif damage == "announced_size":
        announced = size + 1 + int(where * 4096)
    if path == "shm":
        start = client.put_start(key, announced)
        assert start.outcome == pb.PUT_OUTCOME_UNSPECIFIED
        client.segment[start.offset : start.offset + size] = np.frombuffer(obj, np.uint8)
        commit = pb.PutCommitRequest(put_id=start.put_id)
        assert rpc_code(lambda: client.call("PutCommit", commit)) == PRECONDITION
        assert rpc_code(lambda: client.call("PutCommit", commit)) == NOT_FOUND  # the slot is gone
    else:
        padded = obj if announced == size else memoryview(bytes(obj) + bytes(announced - size))
        code = rpc_code(lambda: client.put_frames(stream_frames(key, padded, frame=64 * KiB)))
        assert code == PRECONDITION
    assert client.lookup([key]).hits == 0


@FUZZ
@given(
    size=st.integers(300, 300 * KiB),
    delta=st.integers(-299, 64 * KiB).filter(lambda d: d != 0),
    frame=st.integers(4 * KiB, 128 * KiB),
    seed=st.integers(0, 2**32 - 1),
)
def test_put_stream_with_too_few_or_too_many_bytes(client, objects, size, delta, frame, seed):
    key = random_key(np.random.default_rng([seed, 1]))
    obj = objects.make(key, size + max(delta, 0), seed=seed)
    sent = memoryview(obj)[: size + delta]
    code = rpc_code(lambda: client.put_frames(stream_frames(key, sent, frame=frame, size=size)))
    assert code == INVALID
    assert client.lookup([key]).hits == 0


def test_put_stream_frame_order(client, objects):
    key = random_key(np.random.default_rng(5))
    obj = bytes(objects.make(key, 4096))
    start = pb.PutFrame(start=pb.PutStartRequest(size=4096, **key_fields(key)))
    data = pb.PutFrame(data=obj)
    for frames in ([data, start], [], [start, data, start], [start, pb.PutFrame(), data]):
        assert rpc_code(lambda: client.put_frames(iter(frames))) == INVALID
    assert client.lookup([key]).hits == 0
    assert client.put_frames(iter([start, data])) == pb.PUT_OUTCOME_STORED
    assert client.put_frames(iter([start, data])) == pb.PUT_OUTCOME_EXISTS  # answered after draining
    assert client.delete(key)


@pytest.mark.parametrize("nbytes", [2 * MiB + 1, 5 * MiB])
def test_oversized_messages(client, nbytes):
    huge = pb.LookupRequest(namespace=bytes(nbytes), tag="r0")
    assert rpc_code(lambda: client.call("Lookup", huge)) == EXHAUSTED
    key = random_key(np.random.default_rng(6))
    start = pb.PutFrame(start=pb.PutStartRequest(size=nbytes + 256, **key_fields(key)))
    frames = iter([start, pb.PutFrame(data=bytes(nbytes))])
    assert rpc_code(lambda: client.put_frames(frames)) == EXHAUSTED
    assert client.lookup([key]).hits == 0


def test_huge_lease_request_is_capped(client, stored):
    key, _ = stored[0]
    reply = client.call("Get", pb.GetRequest(lease_ms=2**32 - 1, **key_fields(key)))
    assert reply.found and reply.lease_ms == 300_000  # max_lease_ttl
    assert list(client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[reply.lease_id])).valid) == [True]
